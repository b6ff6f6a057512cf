"""What the main job leaves besides metrics.json: loss.png, the generated sample, and
``--profile-steps`` traces (examples/gpt_report.py), on 2 ranks."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import gpt_report
import pytest
import torch
import train_gpt
from gpt_data import VOCAB_SIZE

TINY = ["--model-size", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run_main(argvs: list[list[str]]) -> list[tuple[int, str]]:
    """On each pool rank: each command line's exit code and what it printed."""
    out = []
    for argv in argvs:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            code = train_gpt.main(argv)
        out.append((code, buffer.getvalue()))
    return out


def test_loss_plot_sample_and_profile_trace(rank_pool: Any, tmp_path: Path) -> None:
    """fsdp (sharded: the sample comes from the consolidated state) with a trace of
    steps 2-3; pipe (the consolidated state exists on rank 0 only); a bad
    ``--profile-steps`` ends with exit code 2."""
    fsdp, pipe = tmp_path / "fsdp", tmp_path / "pipe"
    common = [*TINY, "--eval-every", "4", "--save-every", "0"]
    runs = rank_pool(2).run(
        _run_main,
        [
            [
                *common,
                "--strategy",
                "fsdp",
                "--steps",
                "8",
                "--profile-steps",
                "2:3",
                "--out-dir",
                str(fsdp),
            ],
            [*common, "--strategy", "pipe", "--steps", "4", "--out-dir", str(pipe)],
            [*common, "--profile-steps", "3:2", "--out-dir", str(tmp_path / "bad")],
        ],
        timeout_s=180,
    )
    assert [[code for code, _ in rank] for rank in runs] == [[0, 0, 2], [0, 0, 2]]
    printed = runs[0][0][1]
    for out_dir, steps in ((fsdp, 8), (pipe, 4)):
        metrics = json.loads((out_dir / "metrics.json").read_text())
        assert metrics["step"] == steps
        png = (out_dir / "loss.png").read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 10_000
        sample = (out_dir / "sample.txt").read_text(encoding="utf-8")
        assert sample.startswith(gpt_report.SAMPLE_PROMPT) and len(sample) > 60
        # the sample is the saved model's: same text from model.pt in this process
        state = torch.load(out_dir / "model.pt")
        assert gpt_report.sample_text(state, "tiny", VOCAB_SIZE, 32) == sample
    assert f"sample (prompt {gpt_report.SAMPLE_PROMPT!r}):\n" in printed
    assert (fsdp / "sample.txt").read_text(encoding="utf-8") in printed
    assert "loss.png" in printed
    assert not list(pipe.glob("trace-*"))  # no --profile-steps: no trace
    for rank in (0, 1):
        events = json.loads((fsdp / f"trace-rank{rank}.json").read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        assert {"train_step 2", "train_step 3"} <= names
        assert "train_step 1" not in names and "train_step 4" not in names
        assert "FSDP::pre_forward" in names and "FSDP::post_backward" in names


@pytest.mark.parametrize("text", ["3:2", "0:4", "5", "a:b", ":"])
def test_bad_profile_steps(text: str) -> None:
    with pytest.raises(ValueError, match="--profile-steps wants FIRST:LAST"):
        gpt_report.parse_steps(text)
    assert gpt_report.parse_steps("2:5") == (2, 5)
