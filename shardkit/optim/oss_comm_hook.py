"""Reduce-to-owner DDP communication hook: torch DDP + OSS at 2 psi per step (ZeRO-1).

Plain torch DDP all-reduces every gradient (2 psi (N-1)/N elements sent per rank),
then :class:`~shardkit.optim.OSS` broadcasts each owner's updated parameters
(psi (N-1)/N): 3 psi in all, 1.5x what ZeRO stage 1 needs. With the optimizer state
partitioned, a gradient is only needed on the rank that owns the parameter's state,
so reducing it there (psi) and gathering the updated parameters (psi) is enough:
2 psi (Rajbhandari et al. 2020, "ZeRO", section 7.2.1). :func:`reduce_to_owner_hook`
is that reduction, plugged into DDP through torch's extension point,
``DistributedDataParallel.register_comm_hook(state, hook)``, with the OSS as the state.

[Note: the bucket layout]
DDP's reducer hands the hook one bucket at a time (``torch.distributed.GradBucket``): a
flat 1-D buffer and its parameters, whose gradients lie one after another in the
buffer; ``bucket.gradients()`` are views of the buffer, in the order of
``bucket.parameters()``. The hook reads each gradient's place (element offset from the
buffer's storage offset, length = numel), checks that the view lies in the buffer,
then reduces each run of consecutive parameters with the same owner as one slice of
the buffer (``dist.reduce`` to the owner). A bucket whose views do not pass the check
(sparse gradients, or a torch whose layout differs) is all-reduced whole instead:
correct, at the plain DDP cost for that bucket. Parameters the OSS does not own (not
passed to it, or frozen) are all-reduced too, so that nothing is left unreduced.

[Note: what p.grad holds afterwards]
After backward, ``p.grad`` holds the mean gradient over the ranks *only on the rank
that owns p* (``optimizer.param_to_rank[p]``); on the other ranks it is zero (the
hook zeroes the slices it reduced away, once their reduce is done: a backend leaves
its input of a reduce as scratch). Everything in shardkit that reads gradients after
backward reads only owned ones: :meth:`OSS.step`, :meth:`OSS.clip_grad_norm`;
:class:`ShardedGradScaler` looks at every gradient, which stays right (an inf/NaN in
any rank's local gradient makes the reduced gradient on its owner inf/NaN, and the
ranks agree with a MAX). Code that reads every gradient on every rank
(``torch.nn.utils.clip_grad_norm_`` over all parameters, logging gradient norms per
rank) must not use the hook.

[Note: one synchronised backward per step]
Plain DDP can accumulate over two synchronised backwards (its all-reduced mean is on
every rank, so the second backward adds to the same value everywhere). With the hook
the first backward's mean lives on the owner only, and the second reduce would divide
it by N again: a wrong gradient. So a bucket reduced twice before ``OSS.step()`` or
``OSS.zero_grad()`` (which clear :attr:`OSS.hook_reduced_buckets`) raises; accumulate
under ``ddp.no_sync()`` for all but the last micro-batch, which is also what saves
the communication.

[Note: a stale partition]
The owner map is read when each bucket is reduced, so a re-partition
(:meth:`OSS.refresh_trainable`) is seen by the next backward. When ``requires_grad``
changed since the partition, the next :meth:`OSS.step` re-partitions, so the owners
of this backward's gradients are not known yet: the hook then all-reduces every
bucket of that backward.

[Note: completion]
The reduces of a bucket are asynchronous; the hook returns
``torch.futures.collect_all`` of their futures, continued by a callback that waits on
each one (re-raising a failed reduce) and then yields the buffer. On gloo the works
may finish in any order, so every one is waited for. On NCCL, ``wait()`` on a work's
future makes the calling thread's current stream wait for the NCCL stream; this path
is written for CUDA but tested only on CPU (gloo) here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # torch.distributed.GradBucket
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function

from shardkit.distributed import global_rank, group_ranks
from shardkit.distributed.compression import GradCompressor, get_compressor
from shardkit.distributed.failures import collective_context
from shardkit.optim.oss import OSS

__all__ = [
    "OwnerRun",
    "ReduceToOwnerState",
    "bucket_layout",
    "owner_runs",
    "reduce_to_owner_hook",
    "register_reduce_to_owner_hook",
]

_OPERATION = "backward: reduce of gradients to their owners (reduce_to_owner_hook)"


@dataclass(frozen=True)
class OwnerRun:
    """One collective of a bucket: elements ``[start, end)`` of its flat buffer.

    Attributes:
        owner: the rank (of the OSS group) the slice is reduced to; None: all-reduced
            (every rank needs it).
        start: first element of the slice.
        end: one past its last element.
    """

    owner: int | None
    start: int
    end: int


def bucket_layout(buffer: torch.Tensor, gradients: Sequence[torch.Tensor]) -> list[int] | None:
    """Element offset of each gradient view in the flat ``buffer``; None if a view is not
    a slice of it (see [Note: the bucket layout]).

    Args:
        buffer: the bucket's 1-D buffer.
        gradients: the bucket's gradients (views of ``buffer``), one per parameter.
    """
    if buffer.is_sparse or buffer.dim() != 1 or not buffer.is_contiguous():
        return None
    base = buffer.untyped_storage().data_ptr()
    offsets = []
    for g in gradients:
        offset = int(g.storage_offset() - buffer.storage_offset())
        inside = offset >= 0 and offset + g.numel() <= buffer.numel()
        same = not g.is_sparse and g.untyped_storage().data_ptr() == base
        if not (inside and same and g.is_contiguous()):
            return None
        offsets.append(offset)
    return offsets


def owner_runs(
    offsets: Sequence[int], lengths: Sequence[int], owners: Sequence[int | None]
) -> list[OwnerRun]:
    """Coalesce per-parameter slices into runs of one owner each.

    Slices are taken in buffer order; two neighbours merge when they touch (one ends
    where the next starts) and have the same owner. Empty slices are skipped.

    Args:
        offsets: element offset of each parameter's gradient in the buffer.
        lengths: its number of elements.
        owners: its owner (a group rank), or None for "all-reduce".

    Returns:
        The runs, in buffer order; together they cover every non-empty slice once.

    Example:
        >>> owner_runs([0, 4, 6, 9], [4, 2, 3, 1], [1, 1, 0, None])
        [OwnerRun(owner=1, start=0, end=6), OwnerRun(owner=0, start=6, end=9),
         OwnerRun(owner=None, start=9, end=10)]
    """
    runs: list[OwnerRun] = []
    for offset, length, owner in sorted(zip(offsets, lengths, owners), key=lambda s: s[0]):
        if length == 0:
            continue
        last = runs[-1] if runs else None
        if last is not None and last.owner == owner and last.end == offset:
            runs[-1] = OwnerRun(owner, last.start, offset + length)
        else:
            runs.append(OwnerRun(owner, offset, offset + length))
    return runs


def _plan(optimizer: OSS, bucket: GradBucket, buffer: torch.Tensor) -> list[OwnerRun]:
    """The runs of ``bucket``: per owner, or the whole buffer all-reduced (fallback)."""
    whole = [OwnerRun(None, 0, buffer.numel())]
    owner_of: Mapping[torch.Tensor, int] = optimizer.param_to_rank
    gradients = bucket.gradients()
    offsets = bucket_layout(buffer, gradients)
    if offsets is None or optimizer.trainable_changed():
        return whole
    owners = [owner_of.get(p) for p in bucket.parameters()]
    return owner_runs(offsets, [g.numel() for g in gradients], owners)


def _launch(run: OwnerRun, buffer: torch.Tensor, group: dist.ProcessGroup | None) -> Any:
    """Start the collective of one run asynchronously; its Work."""
    part = buffer[run.start : run.end]
    if run.owner is None:
        return dist.all_reduce(part, group=group, async_op=True)
    return dist.reduce(part, dst=global_rank(group, run.owner), group=group, async_op=True)


@dataclass
class ReduceToOwnerState:
    """The state of :func:`reduce_to_owner_hook` with gradient compression.

    Attributes:
        optimizer: the :class:`OSS` stepping the DDP model's parameters.
        grad_compression: every run of a bucket goes through it: ``reduce`` to the
            owner, ``all_reduce`` for parameters the OSS does not own (key
            ``("oss", bucket index, first element of the run)``, the shapes of the
            run's gradients passed). None: the plain hook.
    """

    optimizer: OSS
    grad_compression: GradCompressor | None = None


def _check_state(state: object) -> OSS:
    if isinstance(state, ReduceToOwnerState):
        state = state.optimizer
    if not isinstance(state, OSS):
        raise TypeError(
            "reduce_to_owner_hook needs the shardkit.optim.OSS that steps the DDP model's "
            f"parameters as its state; got {type(state).__module__}.{type(state).__name__}. "
            "Register it as ddp_model.register_comm_hook(optimizer, reduce_to_owner_hook) "
            "with optimizer = OSS(ddp_model.parameters(), ...), or use "
            "shardkit.optim.oss_comm_hook.register_reduce_to_owner_hook(ddp_model, optimizer)"
        )
    return state


def reduce_to_owner_hook(
    state: OSS | ReduceToOwnerState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: reduce each gradient only to the rank owning its
    optimizer state (ZeRO-1 at 2 psi per step instead of 3 psi).

    Register it with the OSS as the state, before the first backward::

        model = DistributedDataParallel(model)
        optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=3e-4)
        model.register_comm_hook(optimizer, reduce_to_owner_hook)
        # or register_reduce_to_owner_hook(model, optimizer): also checks the process groups

    For each bucket: divide the buffer by the group size (DDP's mean), then reduce
    each run of consecutive parameters with one owner (``dist.reduce`` of a slice of
    the flat buffer, asynchronous) to that owner; parameters the OSS does not own are
    all-reduced. Under ``no_sync()`` DDP does not call the hook; the next synchronised
    backward reduces the accumulated gradients.

    Args:
        state: the :class:`OSS` over the DDP model's parameters, sharding over the same
            process group as DDP (which the hook cannot see: :func:`register_reduce_to_owner_hook`
            checks it); or a :class:`ReduceToOwnerState` holding it and a gradient
            compressor (:mod:`shardkit.distributed.compression`): the runs are then
            reduced through the compressor, synchronously.
        bucket: the gradient bucket DDP passes (a flat buffer of ``bucket.parameters()``'
            gradients).

    Returns:
        A Future of the bucket buffer, completed when every reduce is done. After
        backward, ``p.grad`` is the mean gradient on the rank owning ``p`` only;
        elsewhere it is zero (see [Note: what p.grad holds afterwards]).

    Raises:
        TypeError: if ``state`` is not an :class:`OSS` (at the first backward).
        RuntimeError: on a second synchronised backward before ``optimizer.step()`` or
            ``optimizer.zero_grad()`` (see [Note: one synchronised backward per step]).
    """
    optimizer = _check_state(state)
    buffer = bucket.buffer()
    if optimizer.world_size > 1:
        _check_once(optimizer, bucket.index())
        buffer.div_(optimizer.world_size)
        runs = _plan(optimizer, bucket, buffer)
        compressor = state.grad_compression if isinstance(state, ReduceToOwnerState) else None
        label = f"OSS::reduce_to_owner bucket={bucket.index()} runs={len(runs)}"
        if compressor is not None:
            with record_function(label):
                return _reduce_compressed(compressor, optimizer, bucket, buffer, runs)
        with record_function(label), collective_context("OSS", _OPERATION, optimizer.group):
            works = [_launch(r, buffer, optimizer.group) for r in runs]
        rank = optimizer.rank
        away = [r for r in runs if r.owner is not None and r.owner != rank]
        return torch.futures.collect_all([w.get_future() for w in works]).then(
            lambda done: _result(done, buffer, away)
        )
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def _run_shapes(bucket: GradBucket, buffer: torch.Tensor, run: OwnerRun) -> list[torch.Size] | None:
    """Shapes of the gradients tiling ``run`` in buffer order; None if they do not."""
    gradients = bucket.gradients()
    offsets = bucket_layout(buffer, gradients)
    if offsets is None:
        return None
    inside = sorted(
        (o, g.shape) for o, g in zip(offsets, gradients) if run.start <= o < run.end and g.numel()
    )
    position = run.start
    for offset, shape in inside:
        if offset != position:
            return None
        position += shape.numel()
    return [shape for _, shape in inside] if position == run.end else None


def _reduce_compressed(
    compressor: GradCompressor,
    optimizer: OSS,
    bucket: GradBucket,
    buffer: torch.Tensor,
    runs: list[OwnerRun],
) -> torch.futures.Future[torch.Tensor]:
    """Reduce every run of the bucket through ``compressor`` (synchronously); a
    completed Future of the buffer, the runs of other owners zeroed."""
    group = optimizer.group
    with collective_context("OSS", _OPERATION, group):
        for run in runs:
            part = buffer[run.start : run.end]
            key = ("oss", bucket.index(), run.start)
            shapes = _run_shapes(bucket, buffer, run)
            if run.owner is None:
                compressor.all_reduce(part, group, key=key, shapes=shapes)
            else:
                dst = global_rank(group, run.owner)
                compressor.reduce(part, dst, group, key=key, shapes=shapes)
    for run in runs:
        if run.owner is not None and run.owner != optimizer.rank:
            buffer[run.start : run.end].zero_()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def _check_once(optimizer: OSS, index: int) -> None:
    """Record bucket ``index`` as reduced; raise if it already was since the last step
    (see [Note: one synchronised backward per step])."""
    if index in optimizer.hook_reduced_buckets:
        raise RuntimeError(
            "reduce_to_owner_hook: a second synchronised backward() before "
            "optimizer.step() / optimizer.zero_grad(): gradient bucket "
            f"{index} was already reduced to its owners, so accumulating onto it would give "
            "a wrong gradient. Run all but the last micro-batch under ddp_model.no_sync() "
            "(gradients accumulate locally and are reduced once), or leave the hook out"
        )
    optimizer.hook_reduced_buckets.add(index)


def _result(
    done: torch.futures.Future[list[torch.futures.Future[Any]]],
    buffer: torch.Tensor,
    away: list[OwnerRun],
) -> torch.Tensor:
    """The bucket's result once every reduce is done (see [Note: completion]); the
    slices reduced to other ranks zeroed (see [Note: what p.grad holds afterwards])."""
    for work_future in done.value():
        work_future.wait()  # re-raises the error of a failed reduce
    for run in away:
        buffer[run.start : run.end].zero_()
    return buffer


# DDP checks the hook's annotations as objects; postponed (string) annotations fail it.
reduce_to_owner_hook.__annotations__ = {
    "state": OSS | ReduceToOwnerState,
    "bucket": GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def register_reduce_to_owner_hook(
    module: DistributedDataParallel,
    optimizer: OSS,
    grad_compression: GradCompressor | str | None = None,
) -> None:
    """Register :func:`reduce_to_owner_hook` on ``module`` with ``optimizer`` as its
    state, after checking that both use the same ranks.

    Call it once, before the first backward (DDP takes one comm hook).

    Args:
        module: the torch ``DistributedDataParallel`` model.
        optimizer: the :class:`OSS` stepping its parameters.
        grad_compression: a gradient compressor
            (:class:`~shardkit.distributed.compression.GradCompressor`, or its name:
            ``"identity"``, ``"fp16"``, ``"bf16"``, ``"powersgd"``, ``"int8"``) the
            reduces go through (state :class:`ReduceToOwnerState`); default None: the
            plain hook, exactly as without the argument.

    Raises:
        TypeError: if ``module`` is not a torch DDP or ``optimizer`` not an :class:`OSS`.
        ValueError: if DDP's process group and the OSS group hold different ranks, or
            ``grad_compression`` is an unknown name.
    """
    if not isinstance(module, DistributedDataParallel):
        raise TypeError(
            "register_reduce_to_owner_hook needs a torch.nn.parallel.DistributedDataParallel model; got "
            f"{type(module).__module__}.{type(module).__name__}"
        )
    _check_state(optimizer)
    ddp_ranks, oss_ranks = group_ranks(module.process_group), group_ranks(optimizer.group)
    if ddp_ranks != oss_ranks:
        raise ValueError(
            f"DDP reduces over ranks {ddp_ranks} but the OSS shards over ranks {oss_ranks}: "
            "the hook would average over the wrong ranks. Pass the same process group to "
            "both: DistributedDataParallel(model, process_group=pg) and OSS(..., group=pg)"
        )
    compressor = get_compressor(grad_compression)
    if compressor is None:
        module.register_comm_hook(optimizer, reduce_to_owner_hook)
    else:
        module.register_comm_hook(ReduceToOwnerState(optimizer, compressor), reduce_to_owner_hook)
