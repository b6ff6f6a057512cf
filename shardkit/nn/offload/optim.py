"""Slice-by-slice optimizer stepping for the disk tier (ZeRO-Infinity-style, on files).

[Note: why a torch optimizer per slice, rebuilt each step]
Per-parameter optimizers (SGD, Adam, AdamW, ...) update each parameter from its own
gradient and state only, so stepping slice after slice with one instance per slice
gives exactly the update of one instance over the whole model. Each visit builds the
instance over the (resident) slice, loads the slice's state dict from its file,
steps, and writes the new parameters and state as the next generation: no optimizer
state stays resident between slices, and the files are the only copy. Optimizers
that couple parameters (LBFGS, a global gradient norm) are not supported.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from shardkit.distributed.optim_guard import exempt_optimizer
from shardkit.nn.offload.slices import Slice

if TYPE_CHECKING:
    from shardkit.nn.offload.disk import DiskTier

__all__ = ["SlicedOptimizer"]


class SlicedOptimizer(torch.optim.Optimizer):
    """Steps an ``OffloadModel`` on the disk tier one slice at a time; state in files.

    A ``torch.optim.Optimizer`` with one parameter group (all parameters) holding the
    hyperparameters, so LR schedulers work; its ``state`` stays empty: the optimizer
    state lives in the slices' files (during a universal checkpoint's save or load it
    holds memory maps of them, see :mod:`~shardkit.nn.offload.disk_universal`).

    Made by :meth:`OffloadModel.sliced_optimizer`. Used like a torch optimizer::

        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

    ``step`` visits the pinned ``shared`` group and every slice: load parameters,
    gradients (from the gradient file) and optimizer state, step, write generation
    ``g + 1``; then commits ``g + 1`` atomically (see ``disk.py``). A crash mid-step
    leaves generation ``g``.

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
        name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
        if tier.optimizer_class not in (None, name):
            raise ValueError(
                f"offload_dir holds optimizer state of {tier.optimizer_class}, not {name}; "
                "resume with the same optimizer class"
            )
        params = [p for s in tier.slices for p in s.parameters]
        # every hyperparameter of the class, not only those passed: one restored from a
        # universal checkpoint (say eps) must reach the slices' steps
        super().__init__(params, {**_class_defaults(optimizer_class, defaults), **defaults})
        self.tier = tier
        self.optimizer_class = optimizer_class
        self.class_name = name
        self._hyper_keys = set(defaults) | set(_class_defaults(optimizer_class, defaults))
        exempt_optimizer(self)  # it steps the disk tier's placeholders by design

    def hyperparameters(self) -> dict[str, Any]:
        """The keyword arguments each slice's ``optimizer_class`` instance gets:
        ``param_groups[0]``'s entries that the class's constructor takes."""
        group = self.param_groups[0]
        return {k: group[k] for k in self._hyper_keys}

    def slice_optimizer(self, s: Slice) -> torch.optim.Optimizer:
        """A fresh ``optimizer_class`` instance over the parameters of resident ``s``
        (no state), with :meth:`hyperparameters`; its ``state_dict()`` is the format of
        the slice's optimizer-state file."""
        optimizer = self.optimizer_class(s.parameters, **self.hyperparameters())
        exempt_optimizer(optimizer)
        return optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        """Forget all gradients (deletes the gradient files).

        Raises:
            ValueError: for ``set_to_none=False`` (zero gradients would change AdamW's update
                of parameters that received none; the disk tier keeps None semantics).
        """
        if not set_to_none:
            raise ValueError("the disk tier supports only zero_grad(set_to_none=True)")
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
        for s in self.tier.slices:
            self._step_slice(s, generation)
        self.tier.commit(generation, self.class_name)

    def _step_slice(self, s: Slice, generation: int) -> None:
        if not s.params:
            return
        if not s.pinned:
            self.tier.load(s)
        try:
            self.tier.open_grads(s)
            hyper = self.hyperparameters()
            optimizer = self.slice_optimizer(s)
            state = self.tier.load_optim_state(s)
            if state is not None:
                optimizer.load_state_dict(state)
                optimizer.param_groups[0].update(hyper)
            optimizer.step()
            self.tier.step_slice(s, generation, optimizer.state_dict())
        finally:
            if not s.pinned:
                for p in s.parameters:
                    p.grad = None  # views of the gradient file: not flushed back
                self.tier.offload(s)


def _class_defaults(
    optimizer_class: type[torch.optim.Optimizer], defaults: dict[str, Any]
) -> dict[str, Any]:
    """The hyperparameters of ``optimizer_class(params, **defaults)`` that its
    constructor takes (AdamW's ``defaults`` hold ``decoupled_weight_decay`` too)."""
    full = optimizer_class([torch.nn.Parameter(torch.zeros(1))], **defaults).defaults
    accepted = inspect.signature(optimizer_class.__init__).parameters
    return {k: v for k, v in full.items() if k in accepted}
