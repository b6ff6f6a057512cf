"""Memory tiers a slice is offloaded to: the device itself, another device's memory.

The disk tier lives in :mod:`shardkit.nn.offload.disk`. Every tier implements
:meth:`Tier.load` (make a slice runnable on the compute device) and
:meth:`Tier.offload` (send it, and any gradients it accumulated, back), and keeps the
:class:`~shardkit.nn.offload.slices.SliceState` of each slice.

=================  ==================================  ================================
tier               parameters while offloaded          ``model.parameters()`` usable by
=================  ==================================  ================================
ResidentTier       on ``device`` (no move)             any torch optimizer
MemoryTier         on ``offload_device`` (flat buffer)  any torch optimizer (steps there)
DiskTier           in files (``.data`` is empty)       ``OffloadModel.sliced_optimizer``
=================  ==================================  ================================
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch.profiler import record_function

from shardkit.nn.offload.device import DeviceOps
from shardkit.nn.offload.flat import FlatBuffer
from shardkit.nn.offload.slices import Slice, SliceState

__all__ = ["MemoryTier", "ResidentTier", "Tier"]


class Tier(ABC):
    """Where offloaded slices live, and how they move to the compute device.

    Args:
        device: the compute device.
    """

    kind = "abstract"

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.ops = DeviceOps(self.device)
        self.slices: list[Slice] = []

    def attach(self, slices: list[Slice]) -> None:
        """Take over the parameters of ``slices`` (called once, by ``OffloadModel``)."""
        self.slices = slices
        for s in slices:
            if s.pinned:
                s.point_at([p.data.to(self.device) for p in s.parameters])
                s.state = SliceState.RESIDENT
            else:
                self._attach(s)

    def load(self, s: Slice) -> None:
        """Make ``s`` runnable on the device (its gradients come along); OFFLOADED -> RESIDENT."""
        if s.pinned:
            return
        if s.state is not SliceState.OFFLOADED:
            raise RuntimeError(f"{s.name} is already resident; a slice is loaded once at a time")
        with record_function(f"OffloadModel::load {s.name} from {self.kind}"):
            self._load(s)
        s.state = SliceState.RESIDENT

    def read_ahead(self, s: Slice, optim_state: bool = True) -> None:
        """Start bringing ``s`` in, to run next (the disk tier reads it on a background
        thread; other tiers: nothing to do); ``optim_state``: its optimizer state too."""
        return None

    def offload(self, s: Slice, *, loaded_next: bool = False) -> None:
        """Send ``s`` and its gradients back to the tier; RESIDENT -> OFFLOADED.

        ``loaded_next``: ``s`` is the next slice loaded (forward's last slice is
        backward's first; backward's last is the step's first): the tier may keep its
        parameters at hand instead of reading them again. Default False.
        """
        if s.pinned:
            return
        if s.state is not SliceState.RESIDENT:
            raise RuntimeError(f"{s.name} is not resident; cannot offload it")
        with record_function(f"OffloadModel::evict {s.name} to {self.kind}"):
            if loaded_next:
                self._offload_next(s)
            else:
                self._offload(s)
        s.state = SliceState.OFFLOADED

    @abstractmethod
    def _attach(self, s: Slice) -> None: ...

    @abstractmethod
    def _load(self, s: Slice) -> None: ...

    @abstractmethod
    def _offload(self, s: Slice) -> None: ...

    def _offload_next(self, s: Slice) -> None:
        self._offload(s)


class ResidentTier(Tier):
    """``offload_device == device``: parameters never move; load and offload only track state."""

    kind = "resident"

    def _attach(self, s: Slice) -> None:
        s.point_at([p.data.to(self.device) for p in s.parameters])

    def _load(self, s: Slice) -> None:
        pass

    def _offload(self, s: Slice) -> None:
        pass


class MemoryTier(Tier):
    """Slices kept in another device's memory (CPU RAM for a CUDA device), copied in per use.

    Each slice's parameters live in one flat buffer on ``offload_device`` (page-locked
    when feeding CUDA); while offloaded, ``param.data`` views that buffer, so any torch
    optimizer over ``model.parameters()`` steps them there, as in FairScale. ``load``
    copies the buffer into the slice's compute buffer in one transfer and points the
    parameters (and moves their gradients) there; ``offload`` points them back, moves
    the gradients back and frees the compute buffer.

    Args:
        device: the compute device.
        offload_device: where slices live; may equal ``device`` (then every load and
            offload really copies: useful to test the mechanics on a CPU-only machine).
    """

    kind = "memory"

    def __init__(self, device: torch.device, offload_device: torch.device) -> None:
        super().__init__(device)
        self.offload_device = torch.device(offload_device)
        self.masters: dict[str, tuple[FlatBuffer, list[torch.Tensor]]] = {}

    def _attach(self, s: Slice) -> None:
        pin = self.ops.pin_host_memory(self.offload_device)
        master = FlatBuffer(s.layout.nbytes, self.offload_device, pin=pin)
        views = s.layout.views(master.tensor)
        for view, p in zip(views, s.parameters, strict=True):
            view.copy_(p.data)
        s.point_at(views)
        s.attach_compute(self.device)
        self.masters[s.name] = (master, views)

    def _load(self, s: Slice) -> None:
        assert s.compute is not None
        s.compute.allocate()
        s.compute.tensor.copy_(self.masters[s.name][0].tensor, non_blocking=True)
        s.point_at(s.compute_views)
        _move_grads(s, self.device)

    def _offload(self, s: Slice) -> None:
        assert s.compute is not None
        s.point_at(self.masters[s.name][1])
        _move_grads(s, self.offload_device)
        self.ops.synchronize()
        s.compute.free()


def _move_grads(s: Slice, device: torch.device) -> None:
    for p in s.parameters:
        if p.grad is not None and p.grad.device != device:
            p.grad = p.grad.to(device)
