"""Slice-by-slice optimizer stepping for the disk tier (ZeRO-Infinity-style, on files).

The file-backed optimizer of :mod:`shardkit.optim.file_backed` (FSDP's disk tier uses
the same one): see its [Note: one torch optimizer per piece, rebuilt each step]; here a
piece is one slice, and ``step()`` visits every slice, then commits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import record_function

from shardkit.nn.offload.slices import Slice
from shardkit.optim.file_backed import FileBackedOptimizer

if TYPE_CHECKING:
    from shardkit.nn.offload.disk import DiskTier

__all__ = ["SlicedOptimizer"]


class SlicedOptimizer(FileBackedOptimizer):
    """Steps an ``OffloadModel`` on the disk tier one slice at a time; state in files.

    A :class:`~shardkit.optim.file_backed.FileBackedOptimizer` (a ``torch.optim.Optimizer``
    with one parameter group, all parameters, holding the hyperparameters, so LR
    schedulers work); its ``state`` stays empty: the optimizer state lives in the
    slices' files (during a universal checkpoint's save or load it holds memory maps of
    them, see :mod:`~shardkit.nn.offload.disk_universal`).

    Made by :meth:`OffloadModel.sliced_optimizer`. Used like a torch optimizer::

        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

    ``step`` visits the pinned ``shared`` group and every slice: load parameters,
    gradients (from the gradient file) and optimizer state, step, write generation
    ``g + 1``; then commits ``g + 1`` atomically (see ``disk.py``). The next slice is
    read ahead and the previous one written behind while a slice steps (see [Note: the
    step at the disk's speed] in ``disk.py``); with ``disk_io_bytes > 0`` the commit
    itself runs in the background (see [Note: background step commits] there). A crash
    before the commit leaves generation ``g``.

    Args:
        tier: the model's disk tier.
        optimizer_class: a per-parameter ``torch.optim.Optimizer`` class.
        defaults: its hyperparameters (keyword arguments of ``optimizer_class``);
            ``param_groups[0]`` holds them and may be edited between steps, by hand or by
            an LR scheduler.

    Raises:
        ValueError: if the directory was written with another optimizer class.
    """

    def __init__(
        self, tier: DiskTier, optimizer_class: type[torch.optim.Optimizer], defaults: dict[str, Any]
    ) -> None:
        params = [p for s in tier.slices for p in s.parameters]
        super().__init__(
            params,
            optimizer_class,
            defaults,
            stored_class=tier.optimizer_class,
            where="offload_dir",
        )
        self.tier = tier

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        """Forget all gradients (deletes the gradient files).

        Raises:
            ValueError: for ``set_to_none=False`` (zero gradients would change AdamW's update
                of parameters that received none; the disk tier keeps None semantics).
        """
        if not set_to_none:
            raise ValueError(
                "the disk tier supports only zero_grad(set_to_none=True): its gradients live "
                "in files, and zeros instead of None would change AdamW's update of "
                "parameters that received no gradient; call optimizer.zero_grad()"
            )
        self.tier.zero_grads()

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """One optimizer step over every slice, then an atomic commit of the new generation.

        Raises:
            ValueError: if ``closure`` is given (a closure would re-run forward per slice).
        """
        if closure is not None:
            raise ValueError("SlicedOptimizer.step does not take a closure")
        generation = self.tier.generation + 1
        order = [s for s in self.tier.slices if s.params]
        for index, s in enumerate(order):
            for ahead in order[index + 1 : index + 3]:  # see [Note: the step at the disk's speed]
                self.tier.read_ahead(ahead)
            self._step_slice(s, generation)
        for s in order[:2]:  # the next forward starts with them
            self.tier.read_ahead(s, optim_state=False)
        with record_function("OffloadModel::step commit"):  # with write-behind, in the background
            self.tier.commit(generation, self.class_name, background=self.tier.io_bytes > 0)

    def _step_slice(self, s: Slice, generation: int) -> None:
        if not s.params:
            return
        if not s.pinned:
            self.tier.load(s)
        try:
            with record_function(f"OffloadModel::step {s.name} read gradients"):
                self.tier.open_grads(s)
            with record_function(f"OffloadModel::step {s.name} read optimizer state"):
                state = self.tier.load_optim_state(s) or {}
            new_state = self.step_piece(s.parameters, state)
            with record_function(f"OffloadModel::step {s.name} write"):
                self.tier.step_slice(s, generation, new_state)
        finally:
            if not s.pinned:
                if self.tier.grads.present.get(s.name):  # views of its gradient file,
                    for p in s.parameters:  # which keeps them: not written back
                        p.grad = None
                self.tier.offload(s)  # gradients it held: held again (see disk.py)
