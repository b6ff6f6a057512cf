"""The main job with ``--strategy pipe``: the same losses and final model as DDP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from shardkit.models import GPT, gpt_config
from shardkit.testing import assert_state_dicts_close
from tests.examples import EXAMPLES_DIR

assert EXAMPLES_DIR.is_dir()  # importing tests.examples puts the examples on sys.path

TINY = ["--model-size", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1"]
TINY += ["--sample-bytes", "0"]  # the sample is checked in tests/examples


def _run_main(argvs: list[list[str]]) -> list[int]:
    import train_gpt

    return [train_gpt.main(argv) for argv in argvs]


def test_pipe_strategy_trains_like_ddp(rank_pool: Any, tmp_path: Path) -> None:
    common = [*TINY, "--steps", "4", "--eval-every", "2", "--save-every", "0"]
    runs = {
        "ddp": ["--strategy", "ddp"],
        "gpipe": ["--strategy", "pipe", "--schedule", "gpipe", "--chunks", "3"],
        "1f1b": ["--strategy", "pipe", "--schedule", "1f1b", "--chunks", "8"],
    }
    argvs = [[*common, *extra, "--out-dir", str(tmp_path / name)] for name, extra in runs.items()]
    assert rank_pool(2).run(_run_main, argvs, timeout_s=180) == [[0, 0, 0]] * 2
    metrics = {n: json.loads((tmp_path / n / "metrics.json").read_text()) for n in runs}
    ddp_model = torch.load(tmp_path / "ddp" / "model.pt")
    for name in ("gpipe", "1f1b"):
        for key in ("train_loss", "val_loss"):
            got, want = metrics[name][key], metrics["ddp"][key]
            assert [s for s, _ in got] == [s for s, _ in want]
            assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 1e-4, (
                name,
                key,
                got,
                want,
            )
        model = torch.load(tmp_path / name / "model.pt")
        assert_state_dicts_close(model, ddp_model, atol=1e-4)
        n = GPT(gpt_config("tiny", block_size=32)).num_parameters()
        params = [b["parameters"] for b in metrics[name]["model_state_bytes"]]
        assert all(p < 4 * n for p in params) and sum(params) >= 4 * n  # each stage holds a part
