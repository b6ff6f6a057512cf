"""The shared contiguous-partition solver: optimal (against brute force), valid, deterministic."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.distributed.linear_partition import (
    BalanceError,
    balance_bounds,
    linear_partition,
    solve_balance,
)


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


@pytest.mark.parametrize(
    ("costs", "parts", "error", "message"),
    [
        ([1, 2], 3, BalanceError, "cannot split 2 layers into 3 partitions: partitions (3) is"),
        ([1, 2], 0, BalanceError, "cannot split 2 layers into 0 partitions: partitions must be"),
        ([], 1, BalanceError, "cannot split 0 layers into 1 partitions"),
        (
            [1, -2],
            1,
            BalanceError,
            "layer costs must be >= 0 and finite; got [1, -2] (layer 1: -2)",
        ),
        ([1, math.nan], 1, BalanceError, "got [1, nan] (layer 1: nan)"),
        ([math.inf, 1], 2, BalanceError, "(layer 0: inf)"),
        ([1, 2], 1.5, TypeError, "partitions must be an integer; got 1.5 (float)"),
        ([1, 2], True, TypeError, "partitions must be an integer; got True"),
    ],
)
def test_solver_validates_with_the_offending_values(
    costs: list[float], parts: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        solve_balance(costs, parts)
    assert message in str(info.value)


def test_errors_name_the_callers_argument() -> None:
    with pytest.raises(BalanceError, match=r"num_slices \(7\) is larger than .* num_slices <= 6"):
        solve_balance([1] * 6, 7, name="num_slices")
    with pytest.raises(BalanceError, match=r"parts \(3\) is larger"):
        linear_partition([1, 2], 3)
    assert solve_balance([2, 2, 1, 1, 1, 1], 3) == linear_partition([2, 2, 1, 1, 1, 1], 3)
    assert solve_balance([2, 2, 1, 1, 1, 1], 3) == [1, 2, 3]  # largest run 3
