"""benchmarks.context_parallel at the tiniest size on 2 shared ranks: the bytes counted
on the wire equal the formulas (Ulysses: 4 all-to-alls per layer and direction; ring:
cp - 1 K/V blocks forward, and cp - 1 K/V plus cp dK/dV blocks backward), and the
activations per rank shrink from cp = 1 to cp = 2."""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.context_parallel import longest, render_markdown, run_sweep


def _sweeps(args: argparse.Namespace) -> list[dict[str, Any]]:
    return run_sweep("plain", 1, args) + run_sweep("ulysses", 2, args) + run_sweep("ring", 2, args)


def test_counted_bytes_match_the_formulas(rank_pool: Any) -> None:
    args = argparse.Namespace(
        seq_lens=[32, 64],
        model_size="tiny",
        batch=1,
        steps=1,
        act_budget_mib=1.0,
        rss_budget_mib=1e6,
    )
    rows = rank_pool(2).run(_sweeps, args)[0]
    by = {(r["method"], r["seq_len"]): r for r in rows}
    assert set(by) == {(m, s) for m in ("plain", "ulysses", "ring") for s in (32, 64)}
    for (method, seq), r in by.items():
        assert r["sent_bytes"] == r["formula_bytes"], (method, seq, r)
        assert r["us_per_token"] > 0
    # 4 layers x 4 all-to-alls x (1/2 of 32/2 tokens x 128 x 4 bytes), each direction
    assert by[("ulysses", 32)]["sent_bytes"]["forward"] == 4 * 4 * 16 * 128 * 4 // 2
    # 4 layers x 1 K/V block (2 x 32/2 tokens x 128 x 4 bytes) forward
    assert by[("ring", 32)]["sent_bytes"]["forward"] == 4 * 2 * 16 * 128 * 4
    assert by[("plain", 64)]["sent_bytes"] == {"forward": 0, "backward": 0}
    for method in ("ulysses", "ring"):
        assert by[(method, 64)]["activation_mib"] < 0.75 * by[("plain", 64)]["activation_mib"]
    fits = {(f["cp"], f["method"]): f["longest_seq_len"] for f in longest(rows, args)}
    assert set(fits) == {(1, "plain"), (2, "ulysses"), (2, "ring")}
    assert "| 2 | ring | 64 |" in render_markdown(rows, longest(rows, args))
