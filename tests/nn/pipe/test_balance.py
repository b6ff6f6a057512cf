"""Balancing: the contiguous partition solver (against brute force), by size, by time."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardkit.nn.pipe import BalanceError, balance_by_size, balance_by_time, solve_balance
from shardkit.nn.pipe.balance import layer_sizes


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
    balance = solve_balance(costs, parts)
    assert len(balance) == parts and all(b >= 1 for b in balance) and sum(balance) == len(costs)
    bounds = list(itertools.accumulate([0, *balance]))
    worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
    assert worst == brute_force_best(costs, parts)


def test_solver_errors() -> None:
    with pytest.raises(BalanceError, match="cannot split 2 layers into 3 partitions"):
        solve_balance([1, 2], 3)
    with pytest.raises(BalanceError, match="costs must be >= 0"):
        solve_balance([1, -2], 1)


def test_balance_by_size_counts_bytes_and_shared_tensors_once() -> None:
    big, small = nn.Linear(100, 100), nn.Linear(10, 10)
    model = nn.Sequential(big, small, nn.ReLU(), nn.Linear(10, 10), nn.Sequential(big))
    sizes = layer_sizes(model)
    assert sizes == [(100 * 100 + 100) * 4, 110 * 4, 0, 110 * 4, 0]
    assert balance_by_size(2, model) == [1, 4]
    assert balance_by_size(3, nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])) == [2, 2, 2]


def test_balance_by_time_isolates_the_slow_layer() -> None:
    torch.manual_seed(0)
    # one matmul of 256 x 512 x 512 against three elementwise layers: ~100x apart
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Tanh(), nn.ReLU())
    assert balance_by_time(2, model, torch.randn(256, 512), timeout_s=0.2) == [1, 3]
    assert all(p.grad is None for p in model.parameters())  # timing leaves no gradients behind
