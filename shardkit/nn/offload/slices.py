"""One slice of an offloaded model: its layers, parameters, layout and residency state."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import nn

from shardkit.nn.offload.flat import FlatBuffer, SliceLayout

__all__ = ["Slice", "SliceState", "shared_parameter_ids"]


class SliceState(Enum):
    """Where a slice's parameters are.

    - ``OFFLOADED``: on the slow tier (CPU memory or files); the compute buffer is freed.
      Entered after construction and after each forward / backward / optimizer visit.
    - ``RESIDENT``: on the compute device, the slice can run. Entered by ``Tier.load``
      before the slice's forward, backward (or recomputation) and optimizer step.
    """

    OFFLOADED = "offloaded"
    RESIDENT = "resident"


@dataclass(eq=False)
class Slice:
    """A contiguous group of layers moved in and out as one unit.

    Attributes:
        name: ``"slice<i>"``, or ``"shared"`` for the pinned group of parameters used by
            more than one slice (tied weights), which stays resident on the device.
        module: the slice's layers (an ``nn.Sequential``); None for the shared group.
        params: ``(name, parameter)`` pairs this slice owns (shared ones excluded),
            names as in ``OffloadModel.named_parameters()``.
        layout: where each parameter lives in the slice's flat buffers.
        pinned: True for the shared group: never offloaded.
        state: current :class:`SliceState`.
        compute: the flat buffer on the compute device (None while a tier keeps the
            parameters where they are).
        compute_views: the parameters' views into ``compute``.
    """

    name: str
    module: nn.Module | None
    params: list[tuple[str, nn.Parameter]]
    layout: SliceLayout
    pinned: bool = False
    state: SliceState = SliceState.OFFLOADED
    compute: FlatBuffer | None = None
    compute_views: list[torch.Tensor] = field(default_factory=list)

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The parameters this slice owns, in layout order."""
        return [p for _, p in self.params]

    def numel(self) -> int:
        """Parameter elements this slice owns."""
        return sum(e.nbytes // e.dtype.itemsize for e in self.layout.entries)

    def attach_compute(self, device: torch.device) -> None:
        """Create the (freed) compute buffer on ``device`` and the parameter views into it."""
        self.compute = FlatBuffer(self.layout.nbytes, device)
        self.compute_views = self.layout.views(self.compute.tensor)
        self.compute.free()

    def point_at(self, tensors: list[torch.Tensor]) -> None:
        """Make each parameter's ``.data`` the matching tensor of ``tensors``."""
        for p, t in zip(self.parameters, tensors, strict=True):
            p.data = t


def shared_parameter_ids(modules: list[nn.Module]) -> set[int]:
    """Ids of parameters that appear in more than one of ``modules`` (tied weights)."""
    owner: dict[int, int] = {}
    shared: set[int] = set()
    for i, module in enumerate(modules):
        for p in module.parameters():
            if owner.setdefault(id(p), i) != i:
                shared.add(id(p))
    return shared
