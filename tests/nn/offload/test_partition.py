"""Offload slices: the shared solver (tested in tests/distributed) behind offload's checks."""

from __future__ import annotations

import pytest

from shardkit.distributed.linear_partition import BalanceError, solve_balance
from shardkit.nn.offload import balance_by_size


def test_balance_example_and_determinism() -> None:
    assert balance_by_size([1, 1, 1, 9], 2) == [3, 1]
    assert balance_by_size([4, 4, 4, 4], 4) == [1, 1, 1, 1]
    assert balance_by_size([0, 0, 0], 2) == [2, 1]


@pytest.mark.parametrize("num_slices", [0, 5])
def test_balance_rejects_bad_num_slices(num_slices: int) -> None:
    with pytest.raises(ValueError, match="num_slices"):
        balance_by_size([1, 2, 3, 4], num_slices)


def test_balance_by_size_is_a_deprecated_alias_of_the_one_solver() -> None:
    with pytest.warns(DeprecationWarning, match=r"use shardkit.distributed.linear_partition"):
        assert balance_by_size([5, 1, 1, 1, 5], 3) == solve_balance([5, 1, 1, 1, 5], 3)
    with pytest.warns(DeprecationWarning), pytest.raises(BalanceError) as info:
        balance_by_size([1, 2, 3], 4)
    assert str(info.value).startswith(
        "cannot split 3 layers into 4 partitions: num_slices (4) is larger than the number "
        "of layers (3)"
    )
