"""``shardkit.distributed.collectives.new_group``: no member leaves before every member
has connected, so a group dropped at once cannot break a peer still connecting (see
[Note: a new group is connected on every member])."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shardkit.distributed.collectives import group_timeout, new_group

DELAY_S = 1.0  # how long the slow member stays inside group creation after torch's call


def _slow_member(members: list[int], slow: int) -> dict[str, float]:
    """Every rank creates ``members``' group; rank ``slow`` stays ``DELAY_S`` inside the
    creation after torch's own ``new_group`` returned (a member descheduled at its end);
    each rank then drops the group at once."""
    real = dist.new_group
    slow_done = [0.0]

    def delayed(*args: Any, **kwargs: Any) -> Any:
        group = real(*args, **kwargs)
        time.sleep(DELAY_S)
        slow_done[0] = time.time()
        return group

    if dist.get_rank() == slow:
        dist.new_group = delayed  # type: ignore[assignment]
    try:
        group = new_group(members, timeout=timedelta(seconds=30))
        returned = time.time()
    finally:
        dist.new_group = real
    timeout = group_timeout(group) if dist.get_rank() in members else None
    if group is not dist.GroupMember.NON_GROUP_MEMBER:
        dist.destroy_process_group(group)
    del group
    # the ranks drop it at once: a member still connecting would fail here, not later
    dist.barrier()
    return {
        "returned": returned,
        "slow_done": slow_done[0],
        "timeout_s": -1.0 if timeout is None else timeout.total_seconds(),
    }


def test_no_member_leaves_before_the_slowest_has_connected(rank_pool: Any) -> None:
    members, slow = [1, 2], 2
    per_rank = rank_pool(4).run(_slow_member, members, slow)
    slow_done = per_rank[slow]["slow_done"]
    assert slow_done > 0
    # the other member waits for the slow one (before: it returned DELAY_S earlier)
    assert per_rank[1]["returned"] >= slow_done - 0.05, per_rank
    # ranks outside the group do not wait
    for rank in (0, 3):
        assert per_rank[rank]["returned"] < slow_done - DELAY_S / 2, per_rank
    # the timeout given is the group's
    assert per_rank[1]["timeout_s"] == per_rank[2]["timeout_s"] == 30.0


def _create_and_drop(rounds: int) -> int:
    """The pattern CI failed on: a group of every rank, never used, dropped at once,
    ``rounds`` times (each a collective of the whole world)."""
    for _ in range(rounds):
        group = new_group(list(range(dist.get_world_size())))
        dist.destroy_process_group(group)
        del group
    dist.barrier()
    return rounds


def test_groups_dropped_at_once_do_not_break_the_next(rank_pool: Any) -> None:
    assert rank_pool(4).run(_create_and_drop, 20) == [20] * 4
