"""benchmarks.compare's compiled rows: the speedup over the eager row, paired by round,
and the compile time (first step over the eager row's first step), from known times."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.compare import parse_args
from benchmarks.report import _add_compile, compile_table
from benchmarks.runners import BY_NAME


def _row(name: str, rounds: dict[int, float], first: dict[int, float], **kw: Any) -> Any:
    return {
        "strategy": name,
        "world_size": 2,
        "model_size": "tiny",
        "round_medians": rounds,
        "median_s": sorted(rounds.values())[len(rounds) // 2],
        "first_step_s": first,
        **kw,
    }


def test_compiled_rows_pair_with_their_eager_rows() -> None:
    for name, eager in {
        "torch DDP + compile": "torch DDP",
        "torch FSDP2 + compile": "torch FSDP2 fully_shard",
        "shardkit sdp + compile": "shardkit sdp",
        "shardkit fsdp + compile": "shardkit fsdp",
    }.items():
        assert BY_NAME[name].compiled_from == eager and eager in BY_NAME
    assert not any("compile" in n for n in parse_args([]).strategies)  # opt-in only


def test_speedup_and_compile_time_from_known_times() -> None:
    eager = _row("shardkit fsdp", {0: 1.0, 1: 2.0, 2: 1.5}, {0: 1.2, 1: 2.1, 2: 1.6})
    compiled = _row(
        "shardkit fsdp + compile",
        {0: 0.5, 1: 1.6, 2: 1.0},  # speedups 2.0, 1.25, 1.5
        {0: 31.2, 1: 12.1, 2: 11.6},  # first step over the eager row's: 30, 10, 10
        compiled_from="shardkit fsdp",
    )
    other = _row("torch DDP", {0: 1.0}, {0: 1.0})  # no compiled row: untouched
    rows = [eager, compiled, other]
    _add_compile(rows)
    assert compiled["x_eager_rounds"] == pytest.approx([2.0, 1.25, 1.5])
    assert compiled["x_eager_paired"] == pytest.approx(1.5)
    assert compiled["compile_s"] == pytest.approx(10.0)
    assert "x_eager_paired" not in eager and "compile_s" not in other
    table = compile_table(rows).splitlines()
    assert len(table) == 3  # header, rule, the compiled row
    assert table[2] == "| shardkit fsdp + compile | 2 | 1.000 | 1.500 | 1.50 [1.25-2.00] | 10.0 |"
    assert compile_table([eager, other]) == ""
