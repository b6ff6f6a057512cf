"""Where each piece of a whole-tensor parameter lives, and the two all-to-alls that move them.

[Note: pieces, owners, exchange]
A parameter stepped by a whole-tensor optimizer (:mod:`shardkit.optim.whole_tensor`) is,
on rank ``r`` of the process group, the flat element range ``ranges[r] = [start, stop)``
of the row-major flattened whole tensor (FSDP's 1-D sharded parameter; an empty range
where the rank holds none of it). The ranges of the ranks partition ``[0, numel)``.
Each parameter has one *owner* (:func:`choose_owners`): largest parameter first, the
rank already holding most of its elements (FSDP cuts a unit's flat buffer, not each
parameter, so most parameters lie whole on one rank and need no traffic at all),
unless that rank would then own more than ``total / N`` plus the largest parameter;
then (and on ties) the least loaded rank, as OSS's partition does. The owners' whole
tensors, and the optimizer state that lives with them, add up to at most ``1/N`` of
the parameters plus the largest one on each rank.

One step moves, with two ``all_to_all_single`` over the group:

1. to the owners: from every rank, for every parameter, one flag (has this rank a
   gradient), the gradient piece and the parameter piece, packed per destination rank
   in parameter order (:meth:`ExchangePlan.to_owner_sizes`);
2. back from the owners: the updated parameter piece of every rank.

Bytes sent per rank and step, with ``M`` the elements of the whole-tensor parameters
held by a rank that does not own them and ``e`` bytes per element: ``3 M e / N`` on
average (gradient and parameter out, the update back). At worst (every parameter cut
evenly over the ranks, as torch's FSDP2 shards each on dim 0) ``M = (N - 1) P / N``
for ``P`` elements: ``3 (N - 1) P e / N**2``, that is ``3 / N`` of the reduce-scatter
of the same parameters, ``(N - 1) P e / N``. With FSDP's flat layout ``M`` is only
the parts of parameters that straddle a shard boundary and are not on their owner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardkit.distributed.failures import collective_context

__all__ = ["ExchangePlan", "Pieces", "all_to_all", "check_pieces", "choose_owners", "plan_exchange"]

Range = tuple[int, int]


@dataclass(frozen=True)
class Pieces:
    """One parameter's pieces over the group.

    Attributes:
        key: the parameter's name (the plain model's state-dict key).
        shape: the whole tensor's shape.
        ranges: ``ranges[r]``: rank ``r``'s flat range ``[start, stop)`` (``(0, 0)``: none).
    """

    key: str
    shape: tuple[int, ...]
    ranges: tuple[Range, ...]

    @property
    def numel(self) -> int:
        """Elements of the whole tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    def length(self, rank: int) -> int:
        """Elements rank ``rank`` holds."""
        start, stop = self.ranges[rank]
        return stop - start


def check_pieces(pieces: Pieces) -> None:
    """Raise ``ValueError`` unless the ranks' ranges partition the whole tensor.

    Raises:
        ValueError: overlapping ranges (the tensor is held whole by several ranks, as
            under DDP or OSS, or the process group is not the one the tensor was
            sharded over) or missing elements; the message names the ranges and the fix.
    """
    held = sorted(r for r in pieces.ranges if r[1] > r[0])
    at = 0
    for start, stop in held:
        if start != at:
            break
        at = stop
    else:
        if at == pieces.numel:
            return
    raise ValueError(
        f"parameter `{pieces.key}` {pieces.shape} ({pieces.numel} elements) is held as the "
        f"ranges {list(pieces.ranges)} by the ranks of the process group, which do not "
        "cover it exactly once. WholeTensorOptimizer steps parameters sharded over its "
        "process_group (FSDP's flat shards): pass the FSDP model's shard group as "
        "process_group (hybrid sharding: the shard group, not the world). Parameters "
        "every rank holds whole (DDP, ShardedDataParallel) are already whole: use "
        "WholeTensorOptimizer(param_groups) with no model, or shardkit.optim.OSS("
        "param_groups, optim=WholeTensorOptimizer) there"
    )


@dataclass(frozen=True)
class ExchangePlan:
    """The pieces of every whole-tensor parameter, their owners, and this rank.

    Attributes:
        params: the parameters' pieces, in the same order on every rank.
        owners: ``owners[i]``: the rank owning ``params[i]``.
        rank: this rank in the group.
        world_size: the group's size.
    """

    params: tuple[Pieces, ...]
    owners: tuple[int, ...]
    rank: int
    world_size: int

    def owned(self, rank: int) -> list[int]:
        """Indices of the parameters ``rank`` owns, in order."""
        return [i for i, o in enumerate(self.owners) if o == rank]

    def to_owner_sizes(self) -> tuple[list[int], list[int]]:
        """``(send sizes, receive sizes)`` per rank of the exchange to the owners, in
        elements: ``1 + 2 * length`` per parameter (flag, gradient, parameter)."""
        send = [
            sum(1 + 2 * self.params[i].length(self.rank) for i in self.owned(d))
            for d in range(self.world_size)
        ]
        mine = self.owned(self.rank)
        recv = [sum(1 + 2 * self.params[i].length(s) for i in mine) for s in range(self.world_size)]
        return send, recv

    def from_owner_sizes(self) -> tuple[list[int], list[int]]:
        """``(send sizes, receive sizes)`` per rank of the exchange back from the owners."""
        mine = self.owned(self.rank)
        send = [sum(self.params[i].length(d) for i in mine) for d in range(self.world_size)]
        recv = [
            sum(self.params[i].length(self.rank) for i in self.owned(s))
            for s in range(self.world_size)
        ]
        return send, recv

    def bytes_per_step(self, element_size: int) -> int:
        """Bytes this rank sends per step (both exchanges, to other ranks only)."""
        to_send, _ = self.to_owner_sizes()
        back, _ = self.from_owner_sizes()
        others = [d for d in range(self.world_size) if d != self.rank]
        return element_size * sum(to_send[d] + back[d] for d in others)


def choose_owners(params: Sequence[Pieces], world_size: int) -> list[int]:
    """The owner of each parameter (see ``[Note: pieces, owners, exchange]``).

    Deterministic (the same on every rank): largest first, ties in size in input
    order; the rank holding most of the parameter unless its load would pass
    ``total / world_size + max numel``, else the least loaded (lowest on ties). No
    rank owns more than ``total / world_size`` plus the largest parameter.
    """
    sizes = [p.numel for p in params]
    cap = sum(sizes) / world_size + max(sizes, default=0)
    loads = [0] * world_size
    owners = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-sizes[i], i)):
        lengths = [params[i].length(r) for r in range(world_size)]
        owner = max(range(world_size), key=lambda r: (lengths[r], -loads[r], -r))
        if lengths[owner] * world_size <= sizes[i] or loads[owner] + sizes[i] > cap:
            owner = min(range(world_size), key=lambda r: (loads[r], r))  # no clear holder
        owners[i] = owner
        loads[owner] += sizes[i]
    return owners


def plan_exchange(params: Sequence[Pieces], rank: int, world_size: int) -> ExchangePlan:
    """Owners for ``params`` (:func:`choose_owners`) and this rank's plan.

    Raises:
        ValueError: see :func:`check_pieces`.
    """
    for pieces in params:
        check_pieces(pieces)
    owners = choose_owners(params, world_size)
    return ExchangePlan(tuple(params), tuple(owners), rank, world_size)


def all_to_all(
    send: torch.Tensor,
    send_sizes: list[int],
    recv_sizes: list[int],
    group: dist.ProcessGroup | None,
    operation: str,
) -> torch.Tensor:
    """``all_to_all_single`` of ``send`` (split by ``send_sizes``) into a new tensor of
    ``sum(recv_sizes)`` elements; a failure names ``operation``. One rank (also in a
    process without ``torch.distributed``): a copy of ``send``."""
    if len(send_sizes) == 1:
        return send.clone()
    recv = send.new_empty(sum(recv_sizes))
    with collective_context("WholeTensorOptimizer", operation, group):
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    return recv
