"""The collectives of FSDP: all-gather a unit's shards, reduce-scatter its gradient.

Both take the unit's process group and may run asynchronously (``async_op=True``),
returning a :class:`Pending` whose ``wait()`` completes them; gloo runs asynchronous
collectives on its own threads, so they overlap compute on CPU as NCCL does on GPU.

[Note: version counters]
Autograd saves the unsharded parameters (views of the full flat buffer) for backward
and checks their version counter when it uses them. Re-filling the buffer by
all-gather after a reshard is not a change of value autograd should see (the same
numbers come back), so the version is recorded before the all-gather is issued and restored after it was
issued and again after its ``wait()`` (an asynchronous gloo all-gather bumps the
counter when it completes, on its own thread), with
``torch.autograd._unsafe_preserve_version_counter``, as torch's FSDP does.

[Note: reduce-scatter on gloo]
gloo has no reduce-scatter of its own: torch's gloo ``reduce_scatter_single`` clones
the whole input on the calling thread, all-reduces the clone (each rank sends
``2 (N - 1) / N`` of the buffer, twice a reduce-scatter's share) and copies its chunk
out. On CPU tensors over gloo, :func:`reduce_scatter_flat` therefore sends chunk j of
the flat gradient to rank j and receives the other ranks' chunk for this rank
(``isend`` / ``irecv`` per pair, tag ``_SCATTER_TAG``; ``(N - 1) / N`` of the buffer
sent per rank, no clone), and sums its own chunk and the ``N - 1`` received ones at
``wait()``, in rank order with one rounding per element (as ``torch.sum`` over the N
chunks: bitwise the sum an all-gather of the inputs gives). Pairs of ranks match their
sends and receives in issue order, which every rank shares (the units' backward
order), so several reduce-scatters may be in flight. Measured on 2 ranks, 25 MB fp32:
about 120 ms for gloo's reduce-scatter against 25 ms for an ``all_to_all_single`` and
the sum. The send and receive per pair beat the all-to-all in turn, which receives
``N * S`` elements (this rank's own chunk copied too) into a new tensor: the anchor
GPT's 7 units (93 MB fp32, 2 ranks, all in flight, 4 rounds of median-of-5), CPU per
rank 26-39 ms against 44-62 ms (``all_to_all_single``); on 2 ranks the receive buffer
is ``S`` elements and the sum one ``add``. NCCL (and any non-gloo backend) keeps its
native reduce-scatter.

[Note: all-gather on gloo]
torch's gloo ``all_gather_single`` gathers into a new flat tensor of its own and then
copies it into the output: an allocation (fresh pages to fault in) and a copy of the
whole full buffer per gather, on top of the transfer. On CPU tensors over gloo,
:func:`all_gather_flat` therefore copies this rank's shard into its place in ``full``
and issues one ``broadcast`` per rank of that rank's slice of ``full``, received in
place (each rank sends its ``S`` elements to the ``N - 1`` others and receives
``(N - 1) S``: a ring all-gather's volume). Measured on 2 ranks, 25 MB fp32
(``benchmarks/comm.py``'s loopback, median of 20): 21.5 ms wall, 17.9 ms CPU for
gloo's all-gather against 10.9 ms, 7.5 ms for the broadcasts; on 3 and 4 ranks (the
same host, 2 cores) 58 and 50 ms wall, 11.8 and 22.5 ms CPU per rank against 33 and
31 ms, 9.7 and 11.6 ms. Not measured: groups spanning hosts over a slow network, where
N broadcasts, each limited by its root's link, could fall behind a ring all-gather.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from shardkit.distributed.collectives import global_rank, group_rank, group_size
from shardkit.distributed.failures import collective_context

__all__ = [
    "Pending",
    "all_gather_flat",
    "all_reduce_max",
    "all_reduce_sum",
    "broadcast_data_parallel",
    "broadcast_tensors",
    "reduce_scatter_flat",
]

_WRAPPER = "FullyShardedDataParallel"
_GATHER, _SCATTER = "all-gather of parameters", "reduce-scatter of gradients"


@dataclass
class Pending:
    """An issued collective; ``wait()`` completes it and runs ``then`` once."""

    work: Any = None
    then: Callable[[], None] | None = None
    nbytes: int = 0
    done: bool = field(default=False)
    keep_version: Any = None  # a version-preserving context made before the issue
    keep_alive: Any = None  # an input that must live until the collective completes
    finish: Callable[[], Any] | None = None  # completes the result, before ``then``
    operation: str = ""  # for a CollectiveError: e.g. "all-gather of parameters"
    group: Any = None

    def wait(self) -> None:
        """Block until the collective finished, then run the continuation.

        Raises:
            CollectiveError: a peer timed out or disconnected (names the operation).
        """
        if self.done:
            return
        if self.work is not None:
            with collective_context(_WRAPPER, self.operation, self.group):
                if self.keep_version is None:
                    self.work.wait()
                else:  # waiting marks the output as written: see the module note
                    with self.keep_version:
                        self.work.wait()
        self.done = True
        if self.finish is not None:
            self.finish()
        if self.then is not None:
            self.then()


def all_gather_flat(
    full: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    async_op: bool = False,
) -> Pending:
    """All-gather every rank's ``shard`` ``(S,)`` into ``full`` ``(N * S,)`` (rank order).

    With one rank it is a copy (a cast when the dtypes differ). ``full``'s version
    counter is left unchanged (see the module note). ``shard`` is kept alive until the
    returned :class:`Pending` completes.
    """
    if full.numel() == 0:
        return Pending(done=True)
    keep = _unsafe_preserve_version_counter(full)  # records the version now
    with keep:
        if group_size(group) == 1:
            with torch.no_grad():
                full.copy_(shard)
            return Pending(done=True)
        with collective_context(_WRAPPER, _GATHER, group):
            if _over_gloo(full, group):
                work = _broadcast_pieces(full, shard, group, async_op)
            else:
                work = dist.all_gather_single(full, shard, group=group, async_op=async_op)
    nbytes = full.numel() * full.element_size()
    return Pending(
        work=work,
        nbytes=nbytes,
        keep_version=keep,
        keep_alive=shard,
        operation=_GATHER,
        group=group,
    )


class _Works:
    """Several issued collectives waited as one (``wait()`` in issue order, once: a
    second ``wait()`` of a gloo send would wait for another send)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        while self.works:
            work = self.works[0]
            if work is not None:
                work.wait()
            self.works.pop(0)


def _broadcast_pieces(
    full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool
) -> _Works:
    """All-gather ``shard`` into ``full`` as one broadcast per rank of its slice of
    ``full`` (see [Note: all-gather on gloo])."""
    size, rank = group_size(group), group_rank(group)
    pieces = full.view(size, -1)
    with torch.no_grad():
        pieces[rank].copy_(shard)
    return _Works(
        [
            dist.broadcast(pieces[r], src=global_rank(group, r), group=group, async_op=async_op)
            for r in range(size)
        ]
    )


def reduce_scatter_flat(
    shard_out: torch.Tensor,
    flat: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    async_op: bool = False,
) -> Pending:
    """Sum ``flat`` ``(N * S,)`` over ranks into ``shard_out`` ``(S,)``: rank r receives
    elements ``[r*S, (r+1)*S)``. Over gloo, a send and a receive per pair of ranks and a
    local sum (see [Note: reduce-scatter on gloo]); ``shard_out`` is written by the
    returned :class:`Pending`'s ``wait()`` when ``async_op``, else before returning."""
    if flat.numel() == 0:
        return Pending(done=True)
    if group_size(group) == 1:  # the sum over one rank: a copy, nothing sent
        with torch.no_grad():
            shard_out.copy_(flat)
        return Pending(done=True)
    nbytes = flat.numel() * flat.element_size()
    if not _over_gloo(flat, group):
        with collective_context(_WRAPPER, _SCATTER, group):
            work = dist.reduce_scatter_single(shard_out, flat, group=group, async_op=async_op)
        return Pending(work=work, nbytes=nbytes, operation=_SCATTER, group=group)
    with collective_context(_WRAPPER, _SCATTER, group):
        works, received = _exchange_chunks(flat, group)
        if not async_op:
            works.wait()
    pending = Pending(
        work=works,
        nbytes=nbytes,
        keep_alive=flat,
        operation=_SCATTER,
        group=group,
        finish=functools.partial(_sum_chunks, flat, received, group, shard_out),
    )
    if not async_op:  # complete now; ``wait()`` runs only the caller's ``then``
        _sum_chunks(flat, received, group, shard_out)
        pending.finish = None
    return pending


_SCATTER_TAG = 0x5253  # gloo send/recv tag of the reduce-scatter's chunks ("RS")


def _exchange_chunks(
    flat: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[_Works, torch.Tensor]:
    """Send chunk j of ``flat`` ``(N * S,)`` to rank j and receive every other rank's
    chunk for this rank into row k of ``(N - 1, S)`` (the other ranks in rank order)."""
    size, rank = group_size(group), group_rank(group)
    chunks = flat.view(size, -1)
    received = flat.new_empty(size - 1, chunks.shape[1])
    works = []
    for k, other in enumerate(r for r in range(size) if r != rank):
        peer = global_rank(group, other)
        works.append(dist.isend(chunks[other], dst=peer, group=group, tag=_SCATTER_TAG))
        works.append(dist.irecv(received[k], src=peer, group=group, tag=_SCATTER_TAG))
    return _Works(works), received


def _sum_chunks(
    flat: torch.Tensor,
    received: torch.Tensor,
    group: dist.ProcessGroup | None,
    out: torch.Tensor,
) -> None:
    """``out`` ``(S,)`` = the sum over ranks, in rank order, of their chunk for this rank:
    this rank's own (in ``flat``) and the ``received`` rows (one rounding per element,
    as ``torch.sum`` over the N chunks)."""
    rank = group_rank(group)
    own = flat.view(received.shape[0] + 1, -1)[rank]
    if received.shape[0] == 1:  # 2 ranks: one add, no copy
        torch.add(*((received[0], own) if rank else (own, received[0])), out=out)
    else:
        rows = torch.cat([received[:rank], own.unsqueeze(0), received[rank:]])
        torch.sum(rows, 0, out=out)


def _over_gloo(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """True if collectives on ``tensor`` in ``group`` run on gloo (CPU tensors)."""
    return tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(group))


def broadcast_tensors(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Overwrite ``tensors`` on every rank with the group's first rank's values."""
    if group_size(group) == 1:
        return
    src = global_rank(group, 0)
    with collective_context(_WRAPPER, "broadcast from rank 0", group):
        for tensor in tensors:
            if tensor.numel() > 0:
                dist.broadcast(tensor, src=src, group=group)


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup | None, operation: str) -> None:
    """Element-wise maximum of ``tensor`` over the group, in place (a failure names
    ``operation``)."""
    with collective_context(_WRAPPER, operation, group):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def broadcast_data_parallel(
    tensors: list[torch.Tensor],
    group: dist.ProcessGroup | None,
    replicate_group: dist.ProcessGroup | None,
) -> None:
    """Overwrite ``tensors`` with the values of the first rank of the first shard group:
    across replicas first (from each replica group's first rank), then inside ``group``
    (whose first rank now holds them)."""
    if replicate_group is not None:
        broadcast_tensors(tensors, replicate_group)
    broadcast_tensors(tensors, group)


def all_reduce_sum(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, *, async_op: bool = False
) -> Pending:
    """Sum ``tensor`` over ``group`` in place (the cross-replica gradient of hybrid
    sharding). The returned :class:`Pending` runs its ``then`` at ``wait()``, also when
    there was nothing to send (one replica)."""
    if tensor.numel() == 0 or group_size(group) == 1:
        return Pending()  # nothing to send; ``wait()`` still runs the continuation
    operation = "all-reduce of gradients across replicas"
    with collective_context(_WRAPPER, operation, group):
        work = dist.all_reduce(tensor, group=group, async_op=async_op)
    nbytes = tensor.numel() * tensor.element_size()
    return Pending(work=work, nbytes=nbytes, operation=operation, group=group, done=not async_op)
