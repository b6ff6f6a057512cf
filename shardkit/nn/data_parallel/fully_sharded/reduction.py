"""How a unit's gradient becomes this rank's reduced shard: the gradient-reducer policy.

A :class:`~.unit.UnitRuntime` holds one :class:`ShardReducer`, picked once when the
unit is built (:func:`pick_reducer`, from ``grad_compression`` and the sharding
strategy's groups); the unit calls it without asking which one it is.

[Note: the gradient reducers]
A unit's padded flat gradient ``(N * S,)`` (already divided by the pre-divide factor)
is reduced in two stages:

1. :meth:`ShardReducer.reduce_scatter` over the shard group of N ranks: this rank's
   ``(S,)`` sum, complete when the returned :class:`~.collectives.Pending` is waited.
2. :meth:`ShardReducer.across_replicas` with hybrid sharding: the shard is summed over
   the replica group (deferred while ``requires_all_reduce`` is False: the sums add up
   locally until an all-reduce runs), then handed to the shard store. Without replicas
   the shard goes to the store at once.

Two reducers:

- :class:`ExactReducer`: both stages with FSDP's asynchronous collectives
  (:func:`~.collectives.reduce_scatter_flat`, :func:`~.collectives.all_reduce_sum`);
  the cross-replica all-reduce overlaps the next unit's backward and is waited at
  ``finalize_backward``.
- :class:`CompressedReducer`: the stage that crosses the slowest link goes through a
  :class:`~shardkit.distributed.compression.GradCompressor` (synchronous, see its
  contract): the cross-replica all-reduce with replicas (the reduce-scatter inside a
  node stays exact), else the reduce-scatter. Its error-feedback state is kept per
  unit ``key``.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from shardkit.distributed.collectives import group_size
from shardkit.distributed.compression import GradCompressor
from shardkit.distributed.optim_guard import add_step_check
from shardkit.nn.data_parallel.fully_sharded.collectives import (
    Pending,
    all_reduce_sum,
    reduce_scatter_flat,
)

__all__ = ["CompressedReducer", "ExactReducer", "ShardReducer", "pick_reducer"]

Key = tuple[str, int]
ShapesOf = Callable[[], list[tuple[int, ...]]]  # the pieces' shapes, for a compressor
Deliver = Callable[[torch.Tensor], None]  # takes the finished (S,) gradient shard


class ShardReducer(abc.ABC):
    """Reduces one unit's flat gradient into this rank's shard: the two stages of
    [Note: the gradient reducers]; the replica stage's deferral is common to both
    reducers, the collectives are theirs.

    Args:
        group: the shard group (N ranks; None: the world).
        replicate_group: hybrid sharding's replica group; None: no replicas.
        label: the unit's label, for messages.
        params: the unit's sharded parameters (to tell which optimizer a deferred
            gradient concerns).

    Attributes:
        requires_all_reduce: False defers the cross-replica all-reduce (gradient
            accumulation across micro-batches); set by ``set_requires_all_reduce``.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        replicate_group: dist.ProcessGroup | None,
        label: str,
        params: Sequence[nn.Parameter],
    ) -> None:
        self.group = group
        self.replicate_group = replicate_group
        self.label = label
        self.params = params
        self.distributed = group_size(group) > 1
        self.requires_all_reduce = True
        self.deferred: torch.Tensor | None = None  # reduced shards not yet all-reduced

    def drop_deferred(self) -> None:
        """Forget the gradient shards summed while the cross-replica all-reduce was
        deferred (a micro-batch the user dropped with ``zero_grad``). Between steps only."""
        self.deferred = None
        _DEFERRED.pop(self, None)

    @abc.abstractmethod
    def reduce_scatter(
        self, flat: torch.Tensor, shard_numel: int, key: Key, shapes: ShapesOf
    ) -> tuple[torch.Tensor, Pending]:
        """Issue the reduction of ``flat`` ``(N * S,)`` over the shard group.

        Args:
            flat: the padded flat gradient, in the reduce dtype.
            shard_numel: S, elements of this rank's shard.
            key: names the unit's reductions (a compressor keeps state per key).
            shapes: the pieces' shapes of ``flat`` (called only by a compressor).

        Returns:
            the shard ``(S,)`` (``flat`` itself on one rank) and the collective; the
            shard holds the sum once the Pending is waited.
        """

    def across_replicas(
        self, shard: torch.Tensor, key: Key, shapes: ShapesOf, deliver: Deliver
    ) -> Pending | None:
        """The reduce-scatter finished: sum ``shard`` ``(S,)`` over the replicas (unless
        deferred), then ``deliver`` the total.

        Returns:
            an all-reduce still in flight (its ``wait()`` delivers: the caller waits for
            it at the end of backward), or None when delivered already or deferred.
        """
        if self.replicate_group is None:
            deliver(shard)
            return None
        total = shard if self.deferred is None else self.deferred.add_(shard)
        if not self.requires_all_reduce:
            self.deferred = total
            _watch_deferred(self)
            return None
        self.deferred = None
        _DEFERRED.pop(self, None)
        return self._all_reduce(total, key, shapes, deliver)

    @abc.abstractmethod
    def _all_reduce(
        self, total: torch.Tensor, key: Key, shapes: ShapesOf, deliver: Deliver
    ) -> Pending | None:
        """Sum ``total`` over the replica group and ``deliver`` it; returns the
        all-reduce if still in flight (its ``wait()`` delivers), else None."""


class ExactReducer(ShardReducer):
    """Exact sums: reduce-scatter, and the all-reduce across replicas with hybrid
    sharding, both asynchronous (see [Note: the gradient reducers])."""

    def reduce_scatter(
        self, flat: torch.Tensor, shard_numel: int, key: Key, shapes: ShapesOf
    ) -> tuple[torch.Tensor, Pending]:
        """See :meth:`ShardReducer.reduce_scatter` (FSDP's reduce-scatter)."""
        if not self.distributed:
            return flat, Pending(nbytes=0)
        shard = flat.new_empty(shard_numel)
        return shard, reduce_scatter_flat(shard, flat, self.group, async_op=True)

    def _all_reduce(
        self, total: torch.Tensor, key: Key, shapes: ShapesOf, deliver: Deliver
    ) -> Pending | None:
        # asynchronous: the next unit's backward overlaps it; finalize_backward waits
        assert self.replicate_group is not None
        pending = all_reduce_sum(total, self.replicate_group, async_op=True)
        pending.then = functools.partial(deliver, total)
        return pending


class CompressedReducer(ExactReducer):
    """The reduction over the slowest link compressed (see [Note: the gradient reducers]).

    Args:
        compressor: the compressor (shared by the units of a model; state per ``key``).
        group, replicate_group, label, params: as :class:`ShardReducer`.
    """

    def __init__(
        self,
        compressor: GradCompressor,
        group: dist.ProcessGroup | None,
        replicate_group: dist.ProcessGroup | None,
        label: str,
        params: Sequence[nn.Parameter],
    ) -> None:
        super().__init__(group, replicate_group, label, params)
        self.compressor = compressor
        self.compress_scatter = replicate_group is None  # else the all-reduce is compressed

    def reduce_scatter(
        self, flat: torch.Tensor, shard_numel: int, key: Key, shapes: ShapesOf
    ) -> tuple[torch.Tensor, Pending]:
        """As :meth:`ShardReducer.reduce_scatter`; without replicas compressed and
        synchronous (the Pending only runs its continuation)."""
        if not (self.distributed and self.compress_scatter):
            return super().reduce_scatter(flat, shard_numel, key, shapes)
        shard = flat.new_empty(shard_numel)
        self.compressor.reduce_scatter(shard, flat, self.group, key=key, shapes=shapes())
        return shard, Pending(nbytes=0)  # done: ``then`` runs at the wait

    def _all_reduce(
        self, total: torch.Tensor, key: Key, shapes: ShapesOf, deliver: Deliver
    ) -> Pending | None:
        # synchronous (see the compressor's contract): delivered now
        self.compressor.all_reduce(total, self.replicate_group, key=key, shapes=shapes())
        deliver(total)
        return None


def pick_reducer(
    compressor: GradCompressor | None,
    group: dist.ProcessGroup | None,
    replicate_group: dist.ProcessGroup | None,
    label: str,
    params: Sequence[nn.Parameter],
) -> ShardReducer:
    """The unit's reducer: :class:`CompressedReducer` with a compressor, else
    :class:`ExactReducer` (arguments as theirs)."""
    if compressor is None:
        return ExactReducer(group, replicate_group, label, params)
    return CompressedReducer(compressor, group, replicate_group, label, params)


_DEFERRED: Any = WeakIdKeyDictionary()  # reducers holding deferred gradient shards -> None


def _watch_deferred(reducer: ShardReducer) -> None:
    _DEFERRED[reducer] = None
    add_step_check(_refuse_step_with_deferred)  # the one optimizer-step guard


def _refuse_step_with_deferred(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """Optimizer step pre-hook: a step over parameters whose gradient shards still wait
    for the cross-replica all-reduce would use a part of the gradient only.

    Raises:
        RuntimeError: naming the unit and the fix.
    """
    if not _DEFERRED:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for reducer in list(_DEFERRED):
        if reducer.deferred is not None and any(id(p) in held for p in reducer.params):
            raise RuntimeError(
                f"{reducer.label}: optimizer.step() while its gradient is still deferred "
                "(no_replica_sync / set_requires_all_reduce(False)): the gradient would "
                "miss the other replicas' part. Run the last micro-batch's backward with "
                "the cross-replica all-reduce enabled, then step"
            )
