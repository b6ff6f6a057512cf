"""benchmarks.moe at the tiniest size on 2 ranks: every configuration runs, the counted
all-to-all bytes equal the kept choices' bytes and at most the formula, and per-rank
expert memory halves from ep=1 to ep=2."""

from __future__ import annotations

from pathlib import Path

from benchmarks.moe import main


def test_tiny_run(tmp_path: Path) -> None:
    doc = main(
        [
            "--worlds",
            "2",
            "--tokens",
            "32",
            "--hidden",
            "8",
            "--ffn",
            "16",
            "--experts",
            "4",
            "--steps",
            "1",
            "--rounds",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    rows = {r["config"]: r for r in doc["rows"]}
    assert {
        "dense (same active parameters)",
        "shardkit MOELayer (FairScale's)",
        "shardkit MoE ep=1",
        "shardkit MoE ep=2",
    } <= set(rows)
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    ep1, ep2 = rows["shardkit MoE ep=1"], rows["shardkit MoE ep=2"]
    assert ep2["expert_bytes"] * 2 == ep1["expert_bytes"] == 4 * 2 * 8 * 16 * 4
    assert ep2["bytes"]["dispatch"] == ep2["kept_bytes"] <= ep2["formula_bytes"] == 32 * 2 * 8 * 4
    assert ep1["bytes"]["dispatch"] == 0
    assert rows["dense (same active parameters)"]["expert_bytes"] == 0
    assert len(list(tmp_path.glob("moe-*.json"))) == 1
