"""Greedy partition and bucket planning: ownership, determinism and balance (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.distributed import plan_buckets
from shardkit.optim.partition import partition_sizes

sizes_st = st.lists(st.integers(min_value=0, max_value=10_000), min_size=0, max_size=60)


@settings(max_examples=200, deadline=None)
@given(sizes=sizes_st, world_size=st.integers(min_value=1, max_value=9))
def test_every_item_owned_once_balanced_within_largest(sizes: list[int], world_size: int) -> None:
    owner = partition_sizes(sizes, world_size)
    assert len(owner) == len(sizes)
    assert all(0 <= r < world_size for r in owner)
    loads = [0] * world_size
    for size, rank in zip(sizes, owner):
        loads[rank] += size
    assert sum(loads) == sum(sizes)
    assert max(loads) - min(loads) <= max(sizes, default=0)
    assert partition_sizes(list(sizes), world_size) == owner  # deterministic


def test_partition_example_and_ties() -> None:
    assert partition_sizes([1, 5, 3, 3], 2) == [0, 0, 1, 1]
    assert partition_sizes([2, 2, 2, 2], 4) == [0, 1, 2, 3]
    assert partition_sizes([], 3) == []


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=500), max_size=40),
    bucket=st.integers(min_value=-1, max_value=1_000),
)
def test_buckets_keep_order_and_capacity(sizes: list[int], bucket: int) -> None:
    buckets = plan_buckets(sizes, bucket)
    assert [i for b in buckets for i in b] == list(range(len(sizes)))
    assert all(b for b in buckets)
    for b in buckets:
        if len(b) > 1:
            assert bucket > 0
            assert sum(sizes[i] for i in b) <= bucket
    assert plan_buckets([4, 4, 4, 16, 4], 8) == [[0, 1], [2], [3], [4]]
