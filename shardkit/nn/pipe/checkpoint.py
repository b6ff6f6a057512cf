"""Checkpointing (re-materialization) of micro-batches inside a partition.

A checkpointed micro-batch keeps only its partition input during forward and runs the
partition again during backward to rebuild what backward needs (GPipe, Huang et al.
2019, section 2.3; Chen et al. 2016). It uses ``torch.utils.checkpoint`` in its
non-reentrant form, which saves nothing but the inputs and restores the RNG state so
that dropout draws the same mask twice.

[Note: side effects of the second forward]
A recomputation must not change module state a second time. BatchNorm layers in
training mode update ``running_mean``, ``running_var`` and ``num_batches_tracked`` on
every forward, so the recomputation snapshots those buffers and restores them
afterwards; :func:`is_recomputing` lets other layers (``DeferredBatchNorm``) skip
their own bookkeeping.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint as torch_checkpoint

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
            known = [m.value for m in cls]
            raise ValueError(f"unknown checkpoint mode {value!r}; choose one of {known}") from None


def should_checkpoint(mode: CheckpointMode, index: int, chunks: int) -> bool:
    """Whether micro-batch ``index`` of ``chunks`` is checkpointed under ``mode``."""
    if mode is CheckpointMode.ALWAYS:
        return True
    if mode is CheckpointMode.EXCEPT_LAST:
        return index < chunks - 1
    return False


_state = threading.local()


def is_recomputing() -> bool:
    """True while a checkpointed partition is running its second (backward-time) forward."""
    return bool(getattr(_state, "recomputing", False))


@contextlib.contextmanager
def _recomputing(module: nn.Module) -> Iterator[None]:
    stats = [m for m in module.modules() if isinstance(m, _BatchNorm) and m.training]
    saved = [[b.clone() for b in m.buffers(recurse=False)] for m in stats]
    previous, _state.recomputing = is_recomputing(), True
    try:
        yield
    finally:
        _state.recomputing = previous
        with torch.no_grad():
            for m, copies in zip(stats, saved):
                for buf, copy in zip(m.buffers(recurse=False), copies):
                    buf.copy_(copy)


def run_checkpointed(module: nn.Module, value: TensorOrTensors) -> Any:
    """``module(value)`` under non-reentrant activation checkpointing.

    The recomputation autograd runs during backward happens inside
    :func:`is_recomputing`, with BatchNorm statistics frozen (see the module note).
    """

    def contexts() -> tuple[
        contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]
    ]:
        return contextlib.nullcontext(), _recomputing(module)

    return torch_checkpoint(module, value, use_reentrant=False, context_fn=contexts)
