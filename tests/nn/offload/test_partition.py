"""Balanced contiguous partition of layers into slices."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.nn.offload import balance_by_size


def _brute_force_best(sizes: list[int], k: int) -> int:
    best = None
    for cuts in itertools.combinations(range(1, len(sizes)), k - 1):
        bounds = (0, *cuts, len(sizes))
        worst = max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.data())
def test_balance_is_valid_and_optimal(sizes: list[int], data: st.DataObject) -> None:
    k = data.draw(st.integers(1, len(sizes)))
    balance = balance_by_size(sizes, k)
    assert len(balance) == k and all(b >= 1 for b in balance) and sum(balance) == len(sizes)
    starts = list(itertools.accumulate([0, *balance]))
    worst = max(sum(sizes[a:b]) for a, b in itertools.pairwise(starts))
    assert worst == _brute_force_best(sizes, k)


def test_balance_example_and_determinism() -> None:
    assert balance_by_size([1, 1, 1, 9], 2) == [3, 1]
    assert balance_by_size([4, 4, 4, 4], 4) == [1, 1, 1, 1]
    assert balance_by_size([0, 0, 0], 2) == [2, 1]


@pytest.mark.parametrize("num_slices", [0, 5])
def test_balance_rejects_bad_num_slices(num_slices: int) -> None:
    with pytest.raises(ValueError, match="num_slices"):
        balance_by_size([1, 2, 3, 4], num_slices)
