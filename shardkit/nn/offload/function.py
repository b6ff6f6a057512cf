"""The autograd function that brings a slice in for its forward and again for its backward.

One :class:`SliceFunction` node per slice and forward call carries *all* micro-batches,
so each slice is loaded exactly once in forward and once in backward, whatever
``num_microbatches`` is (slice-major order, as in FairScale's OffloadModel)::

    forward                          backward
    slice 0: load, mb0 mb1 .., off   slice 2: load, mb.. mb1 mb0, off
    slice 1: load, mb0 mb1 .., off   slice 1: load, mb.. mb1 mb0, off
    slice 2: load, mb0 mb1 .., off   slice 0: load, mb.. mb1 mb0, off

[Note: a slice's backward inside the node's backward]
Forward runs the slice's layers on a *detached* copy of each input, building a local
autograd graph (with activation checkpointing, through shardkit's one recompute
primitive, :func:`shardkit.nn.checkpoint.run_checkpointed`: the graph keeps only the
input). ``backward`` loads the slice and runs ``torch.autograd.backward`` on the local
graph (which recomputes the activations there, while the slice is resident, with the
forward's random number generator states and BatchNorm statistics left as the forward
set them): when that
call returns, every gradient of the slice's parameters has been accumulated, so the
slice's gradients can be averaged across ranks and offloaded right there. (Relying on
autograd hooks firing before the next node would depend on engine scheduling.)
The local graph's saved tensors survive the offload: see the note in ``flat.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from shardkit.nn.checkpoint import run_checkpointed
from shardkit.nn.offload.slices import Slice
from shardkit.nn.offload.tiers import Tier

__all__ = ["SliceFunction", "SliceRunner"]


@dataclass
class _Saved:
    """What a slice's forward leaves for its backward, per micro-batch."""

    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)


@dataclass
class SliceRunner:
    """Runs one slice on micro-batches, forward and backward, loading it around each.

    Attributes:
        slice: the slice to run.
        tier: where it lives.
        checkpoint: recompute the slice's activations in backward instead of keeping them.
        after_backward: called after the slice's backward, while it is resident (gradient
            averaging across ranks), or None.
        forward_ahead / backward_ahead: the slices that run after this one in forward /
            in backward, nearest first (at most two; empty for the last), read ahead
            while this one computes (:meth:`~shardkit.nn.offload.tiers.Tier.read_ahead`).
            The last slice of forward is the first of backward, and the last of
            backward the first of the step: each is offloaded with ``loaded_next``.
    """

    slice: Slice
    tier: Tier
    checkpoint: bool
    after_backward: Callable[[Slice], None] | None = None
    forward_ahead: list[Slice] = field(default_factory=list)
    backward_ahead: list[Slice] = field(default_factory=list)

    def run_no_grad(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Forward without autograd (evaluation)."""
        assert self.slice.module is not None
        self.tier.load(self.slice)
        try:
            return [self.slice.module(x) for x in chunks]
        finally:
            self.tier.offload(self.slice)

    def forward(
        self, chunks: tuple[torch.Tensor, ...], needs_grad: list[bool]
    ) -> tuple[_Saved, list[torch.Tensor]]:
        """Run every micro-batch through the slice; returns what backward needs and the outputs."""
        module = self.slice.module
        assert module is not None
        saved, outputs = _Saved(), []
        self.tier.load(self.slice)
        for ahead in self.forward_ahead:
            self.tier.read_ahead(ahead, optim_state=False)
        try:
            for k, (chunk, grad) in enumerate(zip(chunks, needs_grad, strict=True)):
                x = chunk.detach().requires_grad_(grad)
                saved.inputs.append(x)
                label = f"OffloadModel::forward {self.slice.name} micro_batch={k}"
                with torch.enable_grad(), record_function(label):
                    y = run_checkpointed(module, (x,)) if self.checkpoint else module(x)
                saved.outputs.append(y)
                outputs.append(y.detach())
        finally:
            # backward starts with the last slice (with integer inputs too: the dummy)
            self.tier.offload(self.slice, loaded_next=not self.forward_ahead)
        return saved, outputs

    def backward(self, saved: _Saved, grads: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
        """Backward of every micro-batch through the slice; returns the input gradients."""
        self.tier.load(self.slice)
        for ahead in self.backward_ahead:
            self.tier.read_ahead(ahead, optim_state=False)
        try:
            for j in reversed(range(len(saved.inputs))):
                y = saved.outputs[j]
                if y.requires_grad:
                    label = f"OffloadModel::backward {self.slice.name} micro_batch={j}"
                    with record_function(label):
                        torch.autograd.backward(y, grads[j])
            if self.after_backward is not None:
                self.after_backward(self.slice)
        finally:  # the step starts with the last slice of backward
            self.tier.offload(self.slice, loaded_next=not self.backward_ahead)
        if not self.backward_ahead:
            self.tier.read_ahead(self.slice)  # its gradients and optimizer state
        return [x.grad if x.requires_grad else None for x in saved.inputs]


class SliceFunction(torch.autograd.Function):
    """``(runner, dummy, *micro-batches) -> micro-batch outputs`` through one offloaded slice.

    ``dummy`` is an empty tensor that requires grad: it makes the outputs require grad
    (and so this node's backward run) even when the inputs are integer token ids.
    """

    @staticmethod
    def forward(ctx: Any, runner: SliceRunner, dummy: torch.Tensor, *chunks: torch.Tensor) -> Any:
        needs = [
            bool(n) and c.is_floating_point() for n, c in zip(ctx.needs_input_grad[2:], chunks)
        ]
        ctx.runner = runner
        ctx.saved, outputs = runner.forward(chunks, needs)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        saved, ctx.saved = ctx.saved, None
        if saved is None:
            raise RuntimeError(
                "backward through an OffloadModel slice ran twice; retain_graph=True is not "
                "supported (each backward offloads the slice's graph)"
            )
        grads_in = ctx.runner.backward(saved, grads)
        return (None, None, *grads_in)


def average_gradients(group: dist.ProcessGroup | None) -> Callable[[Slice], None]:
    """An ``after_backward`` hook averaging a slice's gradients over ``group`` (DDP semantics)."""

    def hook(s: Slice) -> None:
        world = dist.get_world_size(group)
        for p in s.parameters:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(world)

    return hook
