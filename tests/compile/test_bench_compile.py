"""benchmarks.compare's compiled rows: the speedup over the eager row, paired by round,
and the compile time (first step over the eager row's first step), from known times."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from benchmarks.compare import parse_args
from benchmarks.compile_shapes import ceiling, paired_ratio
from benchmarks.interleaved import compile_ceilings, paired_x_eager
from benchmarks.profile_step import _strategy
from benchmarks.report import _add_compile, compile_table
from benchmarks.runners import BY_NAME
from shardkit.models import GPTConfig


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


def test_compile_ceiling_from_known_times() -> None:
    """benchmarks.interleaved: each compiled row's speedup and the speedup its blocks
    allow (the eager step with the blocks' eager time swapped for their compiled time)."""
    rows = {
        "shardkit fsdp": {"median_ms": 2000.0},
        "shardkit fsdp + compile": {"median_ms": 1800.0},
        "torch DDP + compile": {"median_ms": 900.0},  # its eager row not run: skipped
        "blocks": {"median_ms": 1000.0},
        "blocks + compile": {"median_ms": 600.0},
    }
    ceilings = compile_ceilings(rows)
    assert list(ceilings) == ["shardkit fsdp + compile"]
    c = ceilings["shardkit fsdp + compile"]
    assert c["x_eager"] == pytest.approx(2000 / 1800)
    assert c["ceiling"] == pytest.approx(2000 / (2000 - 400))  # 1.25
    assert c["blocks_share"] == pytest.approx(0.5)
    del rows["blocks + compile"]
    assert compile_ceilings(rows) == {}


def test_paired_speedups_from_known_times() -> None:
    """benchmarks.interleaved and compile_shapes: the median over rounds of the eager
    round median over the compiled one (rounds 2.0, 1.25, 1.5 -> 1.5)."""
    eager = [[1.0, 1.0, 9.0], [2.0], [1.5, 1.4, 1.6]]
    compiled = [[0.5, 0.4, 0.6], [1.6], [1.0]]
    assert paired_ratio(eager, compiled) == pytest.approx(1.5)
    times = {
        "shardkit fsdp": eager,
        "shardkit fsdp + compile": compiled,
        "torch DDP + compile": [[1.0]],
    }
    assert paired_x_eager(times) == pytest.approx({"shardkit fsdp + compile": 1.5})


def test_compile_ceiling_from_a_known_profile() -> None:
    """compile_shapes: GEMM 80 + attention 14 of 100 self CPU units: compiling (the
    other 6 removed at best) gives at most 100 / 94 = 1.064x."""
    self_cpu = {
        "aten::mm": 50.0,
        "aten::addmm": 30.0,
        "aten::_scaled_dot_product_flash_attention_for_cpu": 4.0,
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward": 10.0,
        "aten::gelu": 4.0,
        "aten::native_layer_norm": 2.0,
    }
    out = ceiling(self_cpu)
    assert out["gemm_share"] == pytest.approx(0.80)
    assert out["attention_share"] == pytest.approx(0.14)
    assert out["ceiling"] == pytest.approx(100 / 94)
    with pytest.raises(ValueError, match="no GEMM or attention operator"):
        ceiling({"aten::gelu": 1.0})


def test_blocks_row_runs_the_blocks_alone() -> None:
    """The ``blocks`` row of profile_step / interleaved: forward and backward of the
    transformer blocks only (no embedding gradient, no optimizer step); ``+ compile``
    compiles each block in place, as the main job's ``--compile``."""
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    eager = _strategy("blocks", config, {})
    compiled = _strategy("blocks + compile", config, {})
    assert all(b._compiled_call_impl is None for b in eager.module.blocks)
    assert all(b._compiled_call_impl is not None for b in compiled.module.blocks)
    x = torch.randint(0, 32, (2, 8))
    before = [p.detach().clone() for p in eager.module.parameters()]
    _, loss = eager.module(x, targets=x)
    h = eager.module.wte(x)
    for block in eager.module.blocks:
        h = block(h)
    assert float(loss.detach()) == float(h.detach().square().mean())
    eager.backward(loss)
    assert eager.module.wte.weight.grad is None
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0 for p in eager.module.blocks.parameters()
    )
    eager.before_step()
    eager.step()  # no optimizer step: the parameters are unchanged
    assert all(torch.equal(a, b) for a, b in zip(before, eager.module.parameters()))
