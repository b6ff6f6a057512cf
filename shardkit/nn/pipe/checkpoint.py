"""Checkpointing (re-materialization) of micro-batches inside a partition.

A checkpointed micro-batch keeps only its partition input during forward and runs the
partition again during backward to rebuild what backward needs (GPipe, Huang et al.
2019, section 2.3; Chen et al. 2016). The recomputation is shardkit's one primitive,
:func:`shardkit.nn.checkpoint.run_checkpointed`: it restores the random number
generators (dropout draws the same mask twice) and the BatchNorm statistics (the
second forward changes no module state); :func:`is_recomputing` (the same function as
``shardkit.nn.checkpoint.is_recomputing``) lets ``DeferredBatchNorm`` skip its own
bookkeeping meanwhile. This module adds only the pipeline's policy: which micro-batches
are checkpointed.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import nn

from shardkit.nn.checkpoint import is_recomputing
from shardkit.nn.checkpoint import run_checkpointed as checkpoint_call
from shardkit.nn.pipe.microbatch import TensorOrTensors

__all__ = ["CheckpointMode", "is_recomputing", "run_checkpointed", "should_checkpoint"]


class CheckpointMode(str, enum.Enum):
    """Which micro-batches are checkpointed (torchgpipe / FairScale ``checkpoint=``)."""

    ALWAYS = "always"  #: every micro-batch: least activation memory, one extra forward each
    EXCEPT_LAST = "except_last"  #: all but the last, whose backward starts right away
    NEVER = "never"  #: none: most memory, no recomputation

    @classmethod
    def parse(cls, value: str | CheckpointMode) -> CheckpointMode:
        """The mode named ``value``.

        Raises:
            ValueError: an unknown name, listing the known ones.
        """
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                "checkpoint is not one of 'always', 'except_last', or 'never': unknown "
                f"checkpoint mode {value!r}"
            ) from None


def should_checkpoint(mode: CheckpointMode, index: int, chunks: int) -> bool:
    """Whether micro-batch ``index`` of ``chunks`` is checkpointed under ``mode``."""
    if mode is CheckpointMode.ALWAYS:
        return True
    if mode is CheckpointMode.EXCEPT_LAST:
        return index < chunks - 1
    return False


def run_checkpointed(module: nn.Module, value: TensorOrTensors) -> Any:
    """``module(value)`` under non-reentrant activation checkpointing.

    The recomputation autograd runs during backward happens inside
    :func:`is_recomputing`, with BatchNorm statistics frozen (see the module note).
    The outputs carry the two marker nodes of [Note: checkpoint markers].
    """
    inputs = value if isinstance(value, tuple) else (value,)
    output = checkpoint_call(module, (value,))
    outputs = output if isinstance(output, tuple) else (output,)
    markable = tuple(t for t in outputs if _markable(t, inputs))
    if markable:
        Checkpoint.apply(*Recompute.apply(*markable))
    return output


# [Note: checkpoint markers]
# FairScale's Pipe builds a checkpointed micro-batch from two autograd functions of
# its own, ``Checkpoint`` and ``Recompute``, and its users (and tests) find them in the
# graph (``CheckpointBackward``, ``RecomputeBackward``) to see which micro-batches are
# checkpointed. Here the recomputation is the one primitive's (torch's non-reentrant
# checkpoint, run when backward first needs a dropped activation); the outputs of a
# checkpointed (micro-batch, partition) pass through two identity nodes of those names,
# so the graph shows the same thing: ``RecomputeBackward`` where backward enters the
# region (its forward is recomputed next), then ``CheckpointBackward``. The nodes copy
# nothing: each takes the output tensors in place (``mark_dirty``, so no view is made and
# the next partition receives the same tensor objects). Outputs that are views, leaves or the
# partition's own inputs are left unmarked (taking those in place would rewrite another
# tensor's history).


def _markable(tensor: object, inputs: tuple[Any, ...]) -> bool:
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.requires_grad
        and tensor.grad_fn is not None
        and not tensor._is_view()
        and not any(tensor is t for t in inputs)
    )


class _Marker(torch.autograd.Function):
    """An identity node over tensors taken in place (see [Note: checkpoint markers])."""

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.mark_dirty(*tensors)
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grads


class Checkpoint(_Marker):
    """Marks the end of a checkpointed region in the graph (``CheckpointBackward``)."""


class Recompute(_Marker):
    """Marks where backward enters a checkpointed region (``RecomputeBackward``)."""
