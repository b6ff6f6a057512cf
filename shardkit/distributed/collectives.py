"""Collective helpers: group-relative ranks and bucketed broadcasts from shard owners.

Every helper takes an optional process group and never assumes the world group:
source and destination ranks are given as ranks *within the group* and translated
with :func:`global_rank` (``torch.distributed`` collectives take global ranks).

[Note: bucketed broadcast from owners]
After a sharded optimizer step, rank ``r`` of the group holds the up-to-date values of
the tensors it owns and every other rank needs them. :func:`broadcast_from_owners`
walks the owners in group-rank order, splits each owner's tensors into buckets of at
most ``bucket_bytes`` (:func:`~shardkit.distributed.buckets.plan_buckets`), packs the
small ones into a pooled flat buffer and broadcasts each bucket asynchronously, keeping
at most ``max_in_flight`` buckets in flight (bounded memory) while the next one is
packed. A tensor of at least ``bucket_bytes`` is broadcast in place (no copy) when no
dtype change is asked for. Every rank computes the same plan from the same inputs, so
the collectives match one to one across ranks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shardkit.distributed.buckets import BufferPool, pack, plan_buckets, unpack

__all__ = [
    "BroadcastBucket",
    "broadcast_from_owners",
    "check_group",
    "global_rank",
    "group_rank",
    "group_size",
    "group_timeout",
    "new_group",
    "plan_owner_broadcast",
]


def _is_stand_in(group: object) -> bool:
    """A group object that is not torch's: FairScale's ``DummyProcessGroup`` and the like."""
    return (
        group is not None
        and not isinstance(group, dist.ProcessGroup)
        and group is not dist.GroupMember.NON_GROUP_MEMBER
    )


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group`` (the world group if None).

    Also for a stand-in object with ``rank()`` and ``size()`` methods (FairScale's
    ``DummyProcessGroup``), which works without ``init_process_group``: see
    :func:`check_group`.
    """
    if _is_stand_in(group):
        return int(group.rank())  # type: ignore[union-attr]
    return dist.get_rank(group)


def check_group(group: object, owner: str) -> None:
    """Refuse a stand-in group that would have to communicate.

    A process group that is not torch's (an object with ``rank()`` and ``size()``, as
    FairScale's ``DummyProcessGroup``) is accepted when it has one rank: nothing is
    then sent or received, and no ``init_process_group`` is needed.

    Raises:
        TypeError: ``group`` is neither None, a torch ``ProcessGroup``, nor an object
            with ``rank()`` and ``size()`` methods.
        ValueError: a stand-in whose ``size()`` is not 1 or ``rank()`` not 0.
    """
    if not _is_stand_in(group):
        return
    name = type(group).__name__
    if not (callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None))):
        raise TypeError(
            f"{owner}: process_group must be None or a torch.distributed ProcessGroup "
            f"(dist.new_group(ranks)); got a {name}"
        )
    rank, size = group_rank(group), group_size(group)  # type: ignore[arg-type]
    if (rank, size) != (0, 1):
        raise ValueError(
            f"{owner}: process_group is a {name} with rank() {rank} and size() {size}, "
            "not a torch.distributed ProcessGroup; such a stand-in works only with one "
            f"rank (size() 1, rank() 0), where nothing is communicated. For {size} "
            "ranks call dist.init_process_group and pass dist.new_group(ranks)"
        )


def group_size(group: dist.ProcessGroup | None) -> int:
    """The number of ranks in ``group`` (the world group if None); stand-ins as in
    :func:`group_rank`."""
    if _is_stand_in(group):
        return int(group.size())  # type: ignore[union-attr]
    return dist.get_world_size(group)


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of rank ``group_rank`` of ``group`` (the world group if None)."""
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    if _is_stand_in(group):  # one rank (check_group): this process
        return dist.get_rank() if dist.is_initialized() else group_rank
    return dist.get_global_rank(group, group_rank)


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` (the world group if None), in group-rank order."""
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    if _is_stand_in(group):
        return [global_rank(group, 0)]
    return list(dist.get_process_group_ranks(group))


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The collective timeout of ``group`` (the default group if None), or None where it
    cannot be read (no process group, a stand-in, a backend other than gloo or NCCL)."""
    if not dist.is_available() or not dist.is_initialized() or _is_stand_in(group):
        return None
    pg = dist.group.WORLD if group is None else group
    for device in ("cpu", "cuda"):
        try:
            options = pg._get_backend(torch.device(device)).options  # type: ignore[union-attr]
        except (AttributeError, RuntimeError):
            continue
        timeout = getattr(options, "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return None


def new_group(
    ranks: Sequence[int] | None = None,
    *,
    backend: str | None = None,
    timeout: timedelta | None = None,
) -> dist.ProcessGroup:
    """``torch.distributed.new_group(ranks)`` whose collectives time out like the default
    group's when ``timeout`` is None.

    torch gives a new group its backend's default timeout (30 minutes on gloo) whatever
    the default group's is, so a hang inside a subgroup would outlive a short timeout
    set at ``init_process_group``. Every rank must call it, in the same order (as
    torch's). A gloo group's members leave it together: it ends with a barrier over the
    new group (see [Note: a new group is connected on every member]).

    Args:
        ranks: global ranks of the group; None for all ranks.
        backend: the group's backend; default None (the default group's).
        timeout: the group's collective timeout; default None (the default group's,
            see :func:`group_timeout`).

    Raises:
        RuntimeError: a member did not join within ``timeout`` (torch's error).
    """
    if timeout is None:
        timeout = group_timeout()
    group = dist.new_group(None if ranks is None else list(ranks), backend=backend, timeout=timeout)
    assert group is not None
    if group is not dist.GroupMember.NON_GROUP_MEMBER and dist.get_backend(group) == "gloo":
        dist.barrier(group=group)
    return group


# [Note: a new group is connected on every member]
# ``torch.distributed.new_group`` returns on a member as soon as that member's own gloo
# connections are made (torch 2.13 runs no barrier after it unless
# ``TORCH_DIST_INIT_BARRIER=1``). A gloo member that starts a connection returns once it
# has sent its handshake, before the peer has taken the connection in. If it then
# drops the group (``ProcessMesh.destroy()`` after asking for a group it never used,
# the next configuration's mesh) it closes that socket, and the peer, still connecting
# its other pairs, fails in ``new_group`` with "Gloo connectFullMesh failed ...
# Connection closed by peer" while the other ranks wait for it in their next
# collective. CI hit this twice in tests/distributed/test_mesh.py (4 and 8 ranks); a
# loop of create-then-destroy on 8 heavily loaded ranks hit it in 1 of 12 runs of 40
# rounds, and 0 of 13 with the barrier. The barrier returns on no member before every
# member has finished connecting, for one small collective per group created. Only gloo
# groups: the race is in gloo's TCP connection set-up, and a barrier on an NCCL group
# needs this rank's device.


@dataclass
class BroadcastBucket:
    """One broadcast: ``tensors`` of owner ``src`` (a group rank), packed unless direct.

    Attributes:
        src: owner of the tensors, as a rank of the process group.
        tensors: the tensors, all of one dtype, in packing order.
        numel: total elements.
        direct: True when the single tensor is broadcast in place (no flat buffer).
    """

    src: int
    tensors: list[torch.Tensor]
    numel: int
    direct: bool


def plan_owner_broadcast(
    owned: Sequence[Sequence[torch.Tensor]],
    bucket_bytes: int,
    comm_dtype: torch.dtype | None = None,
    direct_bytes: int | None = None,
) -> list[BroadcastBucket]:
    """The buckets :func:`broadcast_from_owners` sends, in order (pure, same on every rank).

    Per owner and dtype (first appearance order): each contiguous tensor of at least
    ``direct_bytes`` is sent alone, in place (no copy), when no ``comm_dtype``
    conversion is needed; the others are packed into buckets by
    :func:`~shardkit.distributed.buckets.plan_buckets`. The number of broadcasts is at
    most ``total / direct_bytes + total / bucket_bytes + (owners x dtypes)``.

    Args:
        owned: ``owned[r]`` lists the tensors owned by group rank ``r``.
        bucket_bytes: bucket capacity in bytes (of the communication dtype); ``<= 0``
            sends each tensor alone.
        comm_dtype: dtype on the wire (e.g. ``torch.float16``); None keeps each tensor's.
        direct_bytes: size from which a tensor is sent in place, in bytes; default
            None means ``bucket_bytes``.
    """
    threshold = bucket_bytes if direct_bytes is None else direct_bytes
    plan: list[BroadcastBucket] = []
    for src, tensors in enumerate(owned):
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for dtype, group in by_dtype.items():
            wire = comm_dtype or dtype
            itemsize = wire.itemsize

            def direct(t: torch.Tensor, wire: torch.dtype = wire) -> bool:
                big = threshold <= 0 or t.numel() * wire.itemsize >= threshold
                return big and wire == t.dtype and t.is_contiguous()

            plan += [BroadcastBucket(src, [t], t.numel(), True) for t in group if direct(t)]
            packed = [t for t in group if not direct(t)]
            for indices in plan_buckets([t.numel() * itemsize for t in packed], bucket_bytes):
                members = [packed[i] for i in indices]
                plan.append(BroadcastBucket(src, members, sum(t.numel() for t in members), False))
    return plan


def broadcast_from_owners(
    plan: Sequence[BroadcastBucket],
    group: dist.ProcessGroup | None = None,
    *,
    pool: BufferPool | None = None,
    comm_dtype: torch.dtype | None = None,
    max_in_flight: int = 2,
) -> int:
    """Broadcast every bucket of ``plan`` from its owner to all ranks of ``group``.

    A collective: every rank of ``group`` calls it with the same plan (the same shapes
    and dtypes in the same order; see :func:`plan_owner_broadcast`). On return every
    rank's tensors hold the owner's values. With a lower-precision ``comm_dtype`` the
    owner's tensors are overwritten with the rounded values too, so that all ranks stay
    identical.

    Args:
        plan: buckets from :func:`plan_owner_broadcast`.
        group: the process group; default None (the world group).
        pool: flat buffers to reuse; default a fresh pool (on the tensors' device).
        comm_dtype: the wire dtype used when planning; default None (each tensor's own).
        max_in_flight: buckets broadcast concurrently (each holds a flat buffer); >= 1.

    Returns:
        The number of broadcasts issued (``len(plan)``).
    """
    if not plan:
        return 0
    me = dist.get_rank(group)
    pool = pool or BufferPool(plan[0].tensors[0].device)
    pending: deque[tuple[dist.Work | None, BroadcastBucket, torch.Tensor]] = deque()
    for bucket in plan:
        if bucket.direct:
            buffer = bucket.tensors[0]
        else:
            buffer = pool.get(bucket.numel, comm_dtype or bucket.tensors[0].dtype)
            if bucket.src == me:
                pack(bucket.tensors, buffer)
        work = dist.broadcast(
            buffer, src=global_rank(group, bucket.src), group=group, async_op=True
        )
        pending.append((work, bucket, buffer))
        if len(pending) >= max(1, max_in_flight):
            _finish_broadcast(*pending.popleft(), me=me, pool=pool)
    while pending:
        _finish_broadcast(*pending.popleft(), me=me, pool=pool)
    return len(plan)


def _finish_broadcast(
    work: dist.Work | None,
    bucket: BroadcastBucket,
    buffer: torch.Tensor,
    *,
    me: int,
    pool: BufferPool,
) -> None:
    if work is not None:
        work.wait()
    if bucket.direct:
        return
    if bucket.src != me or buffer.dtype != bucket.tensors[0].dtype:
        unpack(buffer, bucket.tensors)
    pool.put(buffer)
