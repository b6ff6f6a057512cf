"""The shared contiguous-partition solver: optimal (against brute force), valid, deterministic."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.distributed.linear_partition import balance_bounds, linear_partition


def brute_force_best(costs: list[int], parts: int) -> int:
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = [0, *cuts, n]
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_solver_is_optimal_and_a_valid_balance(data: st.DataObject) -> None:
    costs = data.draw(st.lists(st.integers(0, 100), min_size=1, max_size=9))
    parts = data.draw(st.integers(1, len(costs)))
    balance = linear_partition(costs, parts)
    assert len(balance) == parts and all(b >= 1 for b in balance) and sum(balance) == len(costs)
    bounds = balance_bounds(balance)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(costs)
    worst = max(sum(costs[a:b]) for a, b in bounds)
    assert worst == brute_force_best(costs, parts)


def test_examples_and_tie_break_prefers_long_leading_runs() -> None:
    assert linear_partition([1, 1, 1, 9], 2) == [3, 1]
    assert linear_partition([4, 4, 4, 4], 4) == [1, 1, 1, 1]
    assert linear_partition([0, 0, 0], 2) == [2, 1]
    assert balance_bounds([2, 3]) == [(0, 2), (2, 5)]
