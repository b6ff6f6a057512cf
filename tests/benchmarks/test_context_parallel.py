"""benchmarks.context_parallel at the tiniest size on 2 shared ranks: the bytes counted
on the wire equal the formulas (Ulysses: 4 all-to-alls per layer and direction; ring:
cp - 1 K/V blocks forward, and cp - 1 K/V plus cp dK/dV blocks backward), and the
activations per rank shrink from cp = 1 to cp = 2."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from benchmarks.context_parallel import (
    failure_line,
    longest,
    main,
    render_markdown,
    run_sweep,
    seq_grid,
)


def _sweeps(args: argparse.Namespace) -> list[dict[str, Any]]:
    return run_sweep("plain", 1, args) + run_sweep("ulysses", 2, args) + run_sweep("ring", 2, args)


def test_counted_bytes_match_the_formulas(rank_pool: Any) -> None:
    args = argparse.Namespace(
        seq_lens=[64, 32],
        scale_seq_lens=False,
        model_size="tiny",
        batch=1,
        steps=0,  # one forward and backward per L
        act_budget_mib=1.0,
        rss_budget_mib=1e6,
        mmap_threshold=2**20,
    )
    rows = rank_pool(2).run(_sweeps, args)[0]
    by = {(r["method"], r["seq_len"]): r for r in rows}
    assert set(by) == {(m, s) for m in ("plain", "ulysses", "ring") for s in (32, 64)}
    for (method, seq), r in by.items():
        assert r["sent_bytes"] == r["formula_bytes"], (method, seq, r)
        assert r["us_per_token"] > 0
        assert r["mmap_threshold"] == 2**20  # glibc took the setting on every rank
        assert 0 < r["rest_rss_mib"] < r["peak_rss_mib"]
    # 4 layers x 4 all-to-alls x (1/2 of 32/2 tokens x 128 x 4 bytes), each direction
    assert by[("ulysses", 32)]["sent_bytes"]["forward"] == 4 * 4 * 16 * 128 * 4 // 2
    # 4 layers x 1 K/V block (2 x 32/2 tokens x 128 x 4 bytes) forward
    assert by[("ring", 32)]["sent_bytes"]["forward"] == 4 * 2 * 16 * 128 * 4
    assert by[("plain", 64)]["sent_bytes"] == {"forward": 0, "backward": 0}
    for method in ("ulysses", "ring"):
        assert by[(method, 64)]["activation_mib"] < 0.75 * by[("plain", 64)]["activation_mib"]
    # ring keeps one copy of the attention output (saved by it and by the projection,
    # as plain SDPA's), so its activations are half the plain model's at cp 2; Ulysses
    # keeps SDPA's output and the all-to-all's: 4 layers x 32 tokens x 128 x 4 B more
    plain, ring = by[("plain", 64)]["activation_mib"], by[("ring", 64)]["activation_mib"]
    assert abs(ring - plain / 2) < 1e-3 * plain, (ring, plain)
    assert by[("ulysses", 64)]["activation_mib"] - ring >= 4 * 32 * 128 * 4 / 2**20
    fits = {(f["cp"], f["method"]): f["longest_seq_len"] for f in longest(rows, args)}
    assert fits == {(1, "plain"): 64, (2, "ulysses"): 64, (2, "ring"): 64}  # RSS 1e6 MiB
    assert "| 2 | ring | 64 |" in render_markdown(rows, longest(rows, args))


def _row(cp: int, method: str, seq: int, rss: float, act: float) -> dict[str, Any]:
    return {"cp": cp, "method": method, "seq_len": seq, "peak_rss_mib": rss, "activation_mib": act}


def test_longest_under_the_rss_budget_and_its_ratio_to_cp1() -> None:
    """The headline: per cp the longest L whose peak RSS fits the budget, as a multiple
    of cp 1's; the activation budget beside it; None where nothing fits."""
    rows = [_row(1, "plain", 256, 300, 8), _row(1, "plain", 512, 340, 16)]
    rows += [_row(1, "plain", 768, 380, 24)]
    rows += [_row(4, "ulysses", s, 290 + s // 64, s // 128) for s in (1024, 1536, 2048, 2560)]
    rows += [_row(2, "ring", 4096, 900, 40)]
    args = argparse.Namespace(rss_budget_mib=340.0, act_budget_mib=16.0)
    got = {(f["cp"], f["method"]): f for f in longest(rows, args)}
    assert got[(1, "plain")]["longest_seq_len"] == 512 and got[(1, "plain")]["x_cp1_rss"] == 1.0
    four = got[(4, "ulysses")]  # RSS 306, 314, 322, 330: all fit; activations 8 .. 20
    assert four["longest_seq_len"] == 2560 and four["x_cp1_rss"] == 5.0
    assert four["longest_by_activations"] == 2048 and four["x_cp1_activations"] == 4.0
    assert got[(2, "ring")]["longest_seq_len"] is None and got[(2, "ring")]["x_cp1_rss"] is None
    text = render_markdown([], list(got.values()), args)  # the summary table only
    assert "| 4 | ulysses | 2560 (5.00x) | 2048 (4.00x) |" in text, text
    assert "| 2 | ring | none | none |" in text, text


def test_seq_grid_scales_with_cp_when_asked() -> None:
    args = argparse.Namespace(seq_lens=[96, 64], scale_seq_lens=True)
    assert seq_grid(args, 1) == [64, 96] and seq_grid(args, 4) == [256, 384]
    args.scale_seq_lens = False
    assert seq_grid(args, 4) == [64, 96]


@pytest.mark.parametrize("argv", [["--methods", "foo"], ["--steps", "-1"]])
def test_bad_options_are_refused_before_any_spawn(argv: list[str], tmp_path: Any) -> None:
    # --methods foo ran Ulysses under the name foo; --steps -1 failed in every spawn
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert not list(tmp_path.iterdir())


def test_a_failed_spawn_prints_the_exception_not_only_the_other_ranks() -> None:
    error = (
        "rank 1 failed:\nTraceback...\nValueError: not divisible by 6\n\n(ranks [0, 2] also failed)"
    )
    assert failure_line(error) == "ValueError: not divisible by 6 (ranks [0, 2] also failed)"
    assert failure_line("rank 0 timed out after 5 s") == "rank 0 timed out after 5 s"
