"""benchmarks.tensor_parallel at the tiniest size: shardkit's and torch's tensor parallel
against the plain GPT (counted bytes against Megatron-LM's count, loss, per-rank bytes)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.compare import model_config
from benchmarks.tensor_parallel import main, megatron_bytes, render_markdown

ARGS = [
    "--model-sizes",
    "tiny",
    "--seq-len",
    "16",
    "--batch",
    "2",
    "--steps",
    "2",
    "--rounds",
    "1",
    "--warmup",
    "0",
]


def test_tiny_run_counts_megatrons_bytes_and_matches_the_plain_loss(tmp_path: Path) -> None:
    doc = main([*ARGS, "--out", str(tmp_path)])
    rows = {row["strategy"]: row for row in doc["rows"]}
    assert set(rows) == {"plain", "shardkit tp", "torch tp"}
    assert all("error" not in row for row in rows.values()), rows

    config = model_config("tiny", 16)
    formula = megatron_bytes(config, 2, 16, 2)
    bsh = 2 * 16 * config.n_embd * 4
    assert formula["core"] == 4 * config.n_layer * bsh

    sk, torch_tp, plain = rows["shardkit tp"], rows["torch tp"], rows["plain"]
    # shardkit: exactly Megatron's count (+ embedding, LM head input, logits gather),
    # in both counters (dispatch-level and benchmarks.comm's Python wrappers)
    assert sk["counted_bytes"] == formula["shardkit tp"]
    assert sk["comm_py_bytes"] == formula["shardkit tp"]
    assert sk["counted"]["calls"]["forward all_reduce"] == 2 * config.n_layer + 1
    assert sk["counted"]["calls"]["backward all_reduce"] == 2 * config.n_layer + 1
    assert sk["counted"]["calls"]["forward all_gather"] == 1
    assert "step all_reduce" not in sk["counted"]["calls"]  # replicas need no reduction
    # torch: DTensor's functional collectives are counted; embedding and head are
    # replicated, so exactly the 4 L core (benchmarks.comm's wrappers see none of it)
    assert torch_tp["counted_bytes"] == formula["torch tp"] == formula["core"]
    assert torch_tp["counted"]["calls"] == {
        "forward all_reduce": 2 * config.n_layer,
        "backward all_reduce": 2 * config.n_layer,
    }
    assert plain["counted_bytes"] == 0

    for row in (sk, torch_tp):
        assert row["world_size"] == 2
        assert row["loss_first_diff"] < 1e-5, row
        assert row["loss_max_diff"] < 1e-5, row
        assert len(row["param_bytes"]) == 2
        # each rank holds less than the whole model, more than half of it (replicas)
        assert plain["param_bytes"][0] / 2 < row["param_bytes"][0] < plain["param_bytes"][0]
        assert row["median_s"] > 0 and row["ratio_vs_plain"] > 0
    assert sk["ratio_vs_torch"] > 0

    written = sorted(tmp_path.glob("tensor_parallel-*"))
    assert [p.suffix for p in written] == [".json", ".md"]
    saved = json.loads(written[0].read_text())
    assert saved["rows"] == json.loads(json.dumps(doc["rows"]))
    page = render_markdown(doc)
    assert "| tiny | shardkit tp | 2 |" in page and "| tiny | torch tp | 2 |" in page
