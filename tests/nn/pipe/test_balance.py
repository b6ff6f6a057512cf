"""Balancing: the solver's checks (its optimality is tested in tests/distributed), by size, by time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.distributed import linear_partition
from shardkit.nn.pipe import BalanceError, balance_by_size, balance_by_time, solve_balance
from shardkit.nn.pipe.balance import layer_sizes


def test_solver_uses_the_shared_optimal_partition() -> None:
    assert solve_balance([1, 1, 1, 9], 2) == [3, 1]  # optimality: tests/distributed


def test_solver_errors() -> None:
    with pytest.raises(BalanceError, match="cannot split 2 layers into 3 partitions"):
        solve_balance([1, 2], 3)
    with pytest.raises(BalanceError, match="costs must be >= 0"):
        solve_balance([1, -2], 1)


def test_one_solver_and_one_error_class_for_pipe_and_offload() -> None:
    assert solve_balance is linear_partition.solve_balance
    assert BalanceError is linear_partition.BalanceError and issubclass(BalanceError, ValueError)


def test_balance_by_size_counts_bytes_and_shared_tensors_once() -> None:
    big, small = nn.Linear(100, 100), nn.Linear(10, 10)
    model = nn.Sequential(big, small, nn.ReLU(), nn.Linear(10, 10), nn.Sequential(big))
    sizes = layer_sizes(model)
    assert sizes == [(100 * 100 + 100) * 4, 110 * 4, 0, 110 * 4, 0]
    assert balance_by_size(2, model) == [1, 4]
    assert balance_by_size(3, nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])) == [2, 2, 2]


def test_balance_by_size_on_the_meta_device_matches_real_tensors() -> None:
    # regression: every meta tensor's storage data_ptr is 0, so all counted as one shared
    def build() -> nn.Sequential:
        big, small = nn.Linear(100, 100), nn.Linear(10, 10)
        return nn.Sequential(big, small, nn.Linear(100, 100), nn.Sequential(big, small))

    with torch.device("meta"):
        meta = build()
    assert layer_sizes(meta) == layer_sizes(build()) == [40400, 440, 40400, 0]
    assert balance_by_size(3, meta) == balance_by_size(3, build()) == [1, 1, 2]


def test_balance_by_time_isolates_the_slow_layer() -> None:
    torch.manual_seed(0)
    # one matmul of 256 x 512 x 512 against three elementwise layers: ~100x apart
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Tanh(), nn.ReLU())
    assert balance_by_time(2, model, torch.randn(256, 512), timeout_s=0.2) == [1, 3]
    assert all(p.grad is None for p in model.parameters())  # timing leaves no gradients behind
