"""bench_fsdp_disk's join of the ranks' I/O periods (the disk's busy time in a step)."""

from __future__ import annotations

import pytest

from benchmarks.bench_fsdp_disk import disk_busy_s


def test_busy_time_is_the_union_of_the_ranks_periods_inside_the_step() -> None:
    steps = [
        {"wall": [10.0, 20.0], "io_busy": [[9.0, 11.0], [12.0, 15.0], [19.5, 25.0]]},
        {"wall": [10.5, 20.5], "io_busy": [[14.0, 16.0], [16.5, 17.0], [30.0, 31.0]]},
    ]
    # span 10.0-20.5; periods clipped: 10-11, 12-15 + 14-16 -> 12-16, 16.5-17, 19.5-20.5
    assert disk_busy_s(steps) == pytest.approx(1.0 + 4.0 + 0.5 + 1.0)


def test_nested_and_outside_periods_add_nothing() -> None:
    steps = [{"wall": [0.0, 10.0], "io_busy": [[1.0, 9.0], [2.0, 3.0], [-5.0, -1.0], [11.0, 12.0]]}]
    assert disk_busy_s(steps) == pytest.approx(8.0)


def test_records_without_periods_give_none() -> None:
    assert disk_busy_s([{"wall": [0.0, 1.0]}]) is None
