"""Bucketed reduction of gradients to their owner rank during backward (ZeRO stage 2).

[Note: buckets and their order]
Trainable parameters, taken in reverse registration order (about the order backward
produces their gradients), are grouped per owner rank (and dtype) into buckets of at
most ``bucket_numel`` elements. Each bucket has a flat buffer of its elements plus one
*used flag* per parameter. The buckets are numbered by the position of their last
parameter; they are reduced (``dist.reduce`` to the owner, summing gradients already
divided by the world size: DDP's average) strictly in that order on every rank, so the
collectives match across ranks even when gradients arrive in another order or some are
missing on one rank.

[Note: one backward, step by step]
- *pre-accumulate* (a tensor hook on the parameter, before autograd writes ``.grad``):
  on the owner, a gradient that an earlier reduction produced is moved aside (the
  stash), so that autograd accumulates only this backward's local gradient.
- *post-accumulate* (``Tensor.register_post_accumulate_grad_hook``): the gradient is
  copied (divided by the world size, cast to the reduce dtype) into its bucket and
  ``.grad`` is freed on every rank (the bucket holds it now). When a bucket is full and
  all earlier buckets were launched, it is launched asynchronously; at most
  ``max_in_flight`` buckets are in flight (bounded memory).
- *finalize* (an autograd-engine callback at the end of backward): buckets still open
  (some parameter was unused on this rank) are completed with zeros and launched in
  order; every bucket is waited for; the owner sets ``.grad`` = reduced + stash for each
  parameter some rank used, and leaves it as it was for a parameter no rank used (as
  DDP with ``find_unused_parameters`` does). Non-owners hold no gradient.

Nothing is kept between backwards except the owner's gradients, so setting ``.grad`` to
None (``optimizer.zero_grad()``) is always safe: FairScale's ShardedDDP exposed views
into persistent buckets as ``.grad``, which ``set_to_none`` silently detached.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.profiler import record_function
from torch.utils.hooks import RemovableHandle

from shardkit.distributed import (
    BufferPool,
    copy_scaled,
    global_rank,
    group_rank,
    group_size,
    plan_buckets,
)
from shardkit.distributed.compression import GradCompressor
from shardkit.distributed.failures import collective_context

__all__ = ["GradReducer", "ReduceBucket", "ReducerState", "grad_with_graph_message"]

_WRAPPER = "ShardedDataParallel"


def grad_with_graph_message(what: str) -> str:
    """The error for a gradient that requires grad (its graph would be dropped)."""
    return (
        f"ShardedDataParallel: the gradient of {what} requires grad (it carries an "
        "autograd graph: backward(create_graph=True), or a .grad set by hand); gradients "
        "are reduced as plain tensors, which would silently drop that graph. Call "
        "backward() without create_graph (for a gradient penalty, take the gradient with "
        "torch.autograd.grad(..., create_graph=True), which does not write .grad), or "
        "detach it first: p.grad = p.grad.detach()"
    )


class ReducerState(enum.Enum):
    """Where the reducer is in a backward pass."""

    IDLE = "idle"
    """No backward in progress (entered at construction and by :meth:`GradReducer.finalize`)."""
    REDUCING = "reducing"
    """A backward produced a first gradient; buckets fill and launch until finalize."""


@dataclass
class ReduceBucket:
    """Parameters of one owner reduced together through one flat buffer.

    Attributes:
        index: launch order (the same on every rank).
        owner: the rank (in the process group) that receives the sum.
        params: the parameters, in buffer order.
        offsets: element offset of each parameter in the buffer.
        numel: elements of all parameters (the flags follow them).
    """

    index: int
    owner: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    numel: int
    packed: list[bool] = field(default_factory=list)
    buffer: torch.Tensor | None = None
    work: dist.Work | None = None

    @property
    def ready(self) -> bool:
        return all(self.packed)


def build_buckets(
    params: Sequence[torch.nn.Parameter],
    owner: dict[torch.nn.Parameter, int],
    bucket_numel: int,
) -> list[ReduceBucket]:
    """Group ``params`` (in expected gradient order) by owner and dtype into buckets.

    Buckets are ordered by the position of their last parameter in ``params``.
    """
    by_key: dict[tuple[int, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        by_key.setdefault((owner[p], p.dtype), []).append(i)
    groups: list[tuple[int, int, list[int]]] = []  # (last position, owner, positions)
    for (rank, _), positions in by_key.items():
        sizes = [params[i].numel() for i in positions]
        for chunk in plan_buckets(sizes, bucket_numel):
            members = [positions[j] for j in chunk]
            groups.append((members[-1], rank, members))
    buckets = []
    for index, (_, rank, members) in enumerate(sorted(groups)):
        ps = [params[i] for i in members]
        offsets = [sum(p.numel() for p in ps[:k]) for k in range(len(ps))]
        numel = sum(p.numel() for p in ps)
        buckets.append(ReduceBucket(index, rank, ps, offsets, numel, [False] * len(ps)))
    return buckets


class GradReducer:
    """Reduce each gradient to its owner through ordered buckets, during backward.

    Args:
        params: trainable parameters, in expected gradient order (reverse registration).
        owner: owner of each parameter (a rank of ``group``).
        group: process group; None for the world group.
        bucket_numel: bucket capacity in elements (a larger parameter gets its own).
        reduce_dtype: dtype on the wire (e.g. ``torch.float16``); None keeps the
            gradient's.
        max_in_flight: buckets being reduced at once (each holds a flat buffer).
        grad_compression: a gradient compressor
            (:mod:`shardkit.distributed.compression`): each bucket's gradients are
            reduced through its ``reduce`` (key ``("sdp", bucket index)``, the
            parameters' shapes passed), synchronously, and its used flags by an exact
            ``dist.reduce`` of ``len(params)`` elements. Default None: one asynchronous
            ``dist.reduce`` of the whole buffer, as without the argument.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        owner: dict[torch.nn.Parameter, int],
        group: dist.ProcessGroup | None,
        bucket_numel: int,
        reduce_dtype: torch.dtype | None = None,
        max_in_flight: int = 2,
        grad_compression: GradCompressor | None = None,
    ) -> None:
        self.group = group
        self.grad_compression = grad_compression
        self.rank = group_rank(group)
        self.world_size = group_size(group)
        self.reduce_dtype = reduce_dtype
        self.max_in_flight = max(1, max_in_flight)
        self.buckets = build_buckets(params, owner, bucket_numel)
        self._slot = {p: (b, k) for b in self.buckets for k, p in enumerate(b.params)}
        self._pool = BufferPool(params[0].device if params else torch.device("cpu"), 2)
        self._handles: list[RemovableHandle] = []
        self._reduced: set[torch.nn.Parameter] = set()  # owner grads set by a reduction
        self._stash: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._in_flight: deque[ReduceBucket] = deque()
        self._next = 0
        self.state = ReducerState.IDLE
        self.sync = True  # False under no_sync(): gradients accumulate locally

    # hooks ---------------------------------------------------------------------------
    def register_hooks(self) -> None:
        """Attach the pre- and post-accumulate hooks to every parameter (once)."""
        for p in self._slot:
            self._handles.append(p.register_hook(self._make_pre_accumulate(p)))
            self._handles.append(p.register_post_accumulate_grad_hook(self._post_accumulate))

    def remove_hooks(self) -> None:
        """Detach every hook (before the reducer is replaced)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _make_pre_accumulate(self, p: torch.nn.Parameter):  # type: ignore[no-untyped-def]
        def pre_accumulate(grad: torch.Tensor) -> None:
            self.stash_reduced(p)

        return pre_accumulate

    def stash_reduced(self, p: torch.nn.Parameter) -> None:
        """Move an already reduced ``p.grad`` aside so new local gradients start at zero."""
        if p not in self._reduced:
            return
        self._reduced.discard(p)
        if p.grad is None:
            return
        previous = self._stash.get(p)
        self._stash[p] = p.grad if previous is None else previous + p.grad
        p.grad = None

    def _post_accumulate(self, p: torch.Tensor) -> None:
        if p.grad is not None and p.grad.requires_grad:  # before any state changes
            raise RuntimeError(grad_with_graph_message(f"a parameter of shape {tuple(p.shape)}"))
        if not self.sync:
            return
        if self.state is ReducerState.IDLE:
            self.state = ReducerState.REDUCING
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize)
        self.pack(p)  # type: ignore[arg-type]

    # reduction -----------------------------------------------------------------------
    def pack(self, p: torch.nn.Parameter) -> None:
        """Copy ``p.grad`` (averaged) into its bucket, free it, launch ready buckets."""
        bucket, k = self._slot[p]
        if bucket.packed[k] or p.grad is None:
            return
        buffer = self._buffer(bucket)
        start = bucket.offsets[k]
        out = buffer[start : start + p.numel()].view_as(p)
        copy_scaled(p.grad, out, divide_by=float(self.world_size))
        buffer[bucket.numel + k] = 1.0
        bucket.packed[k] = True
        p.grad = None
        self._launch_ready()

    def _buffer(self, bucket: ReduceBucket) -> torch.Tensor:
        if bucket.buffer is None:
            dtype = self.reduce_dtype or bucket.params[0].dtype
            bucket.buffer = self._pool.get(bucket.numel + len(bucket.params), dtype)
            bucket.buffer[bucket.numel :].zero_()
        return bucket.buffer

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets) and (force or self.buckets[self._next].ready):
            bucket = self.buckets[self._next]
            buffer = self._fill_unused(bucket)
            dst = global_rank(self.group, bucket.owner)
            with (
                record_function(f"ShardedDDP::reduce bucket={bucket.index} owner={bucket.owner}"),
                collective_context(_WRAPPER, "backward: reduce of gradients", self.group),
            ):
                if self.world_size == 1:  # the sum over one rank is the buffer itself
                    bucket.work = None
                elif self.grad_compression is None:
                    bucket.work = dist.reduce(buffer, dst=dst, group=self.group, async_op=True)
                else:
                    self._reduce_compressed(self.grad_compression, bucket, buffer, dst)
            self._in_flight.append(bucket)
            self._next += 1
            if len(self._in_flight) > self.max_in_flight:
                self._complete(self._in_flight.popleft())

    def _reduce_compressed(
        self, compressor: GradCompressor, bucket: ReduceBucket, buffer: torch.Tensor, dst: int
    ) -> None:
        """Reduce a bucket's gradients through ``compressor`` and its used flags exactly
        (a lossy compressor must not blur a flag, nor carry a residual into one)."""
        shapes = [p.shape for p in bucket.params]
        grads = buffer[: bucket.numel]
        compressor.reduce(grads, dst, self.group, key=("sdp", bucket.index), shapes=shapes)
        dist.reduce(buffer[bucket.numel :], dst=dst, group=self.group)
        bucket.work = None

    def _fill_unused(self, bucket: ReduceBucket) -> torch.Tensor:
        """Zeros for the parameters that produced no gradient on this rank; the buffer."""
        buffer = self._buffer(bucket)
        for k, p in enumerate(bucket.params):
            if not bucket.packed[k]:
                start = bucket.offsets[k]
                buffer[start : start + p.numel()].zero_()
        return buffer

    def _complete(self, bucket: ReduceBucket) -> None:
        """Wait for a bucket; on its owner, set ``.grad`` of every parameter some rank used."""
        assert bucket.buffer is not None
        if bucket.work is not None:  # None: reduced synchronously (compressed, one rank)
            with (
                record_function(f"ShardedDDP::wait bucket={bucket.index}"),
                collective_context(_WRAPPER, "backward: reduce of gradients", self.group),
            ):
                bucket.work.wait()
        if bucket.owner == self.rank:
            flags = bucket.buffer[bucket.numel :].tolist()
            for k, p in enumerate(bucket.params):
                if flags[k] == 0:
                    continue  # unused on every rank: .grad stays as it was (DDP)
                self.stash_reduced(p)  # no local gradient here, but an earlier reduced one
                start = bucket.offsets[k]
                grad = bucket.buffer[start : start + p.numel()].view_as(p).to(p.dtype, copy=True)
                stashed = self._stash.pop(p, None)
                p.grad = grad if stashed is None else grad.add_(stashed)
                self._reduced.add(p)
        self._pool.put(bucket.buffer)
        bucket.buffer, bucket.work = None, None
        bucket.packed = [False] * len(bucket.params)

    def finalize(self) -> None:
        """Launch the buckets still open (unused parameters), wait for all, reset."""
        with record_function("ShardedDDP::finalize_backward"):
            self._launch_ready(force=True)
            while self._in_flight:
                self._complete(self._in_flight.popleft())
        self._next = 0
        self.state = ReducerState.IDLE

    def reduce_held(self) -> None:
        """Reduce the gradients held now, outside backward (after ``no_sync`` steps)."""
        for p in self._slot:
            if p.grad is not None and p not in self._reduced:
                self.pack(p)
        self.finalize()

    def clear(self) -> None:
        """Forget stashed and reduced gradients (after ``zero_grad``)."""
        self._stash.clear()
        self._reduced.clear()
