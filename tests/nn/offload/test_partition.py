"""Offload slices: the shared solver (tested in tests/distributed) behind offload's checks."""

from __future__ import annotations

import pytest

from shardkit.nn.offload import balance_by_size


def test_balance_example_and_determinism() -> None:
    assert balance_by_size([1, 1, 1, 9], 2) == [3, 1]
    assert balance_by_size([4, 4, 4, 4], 4) == [1, 1, 1, 1]
    assert balance_by_size([0, 0, 0], 2) == [2, 1]


@pytest.mark.parametrize("num_slices", [0, 5])
def test_balance_rejects_bad_num_slices(num_slices: int) -> None:
    with pytest.raises(ValueError, match="num_slices"):
        balance_by_size([1, 2, 3, 4], num_slices)
