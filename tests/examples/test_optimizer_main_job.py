"""The main job's ``--optimizer``: Muon + AdamW under fsdp trains, and under ddp, oss
and sdp (resumed from one another) on fsdp's losses; Adafactor saved by fsdp resumes
under sdp on the uninterrupted run's losses; combinations that cannot
work are refused with one line (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import train_gpt

STEPS = 4
COMMON = [
    *("--model-size", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1"),
    *("--steps", str(STEPS), "--eval-every", "0", "--keep", "0", "--sample-bytes", "0"),
]


def _losses(out_dir: Path) -> list[float]:
    metrics = json.loads((out_dir / "metrics.json").read_text())
    return [loss for _, loss in metrics["train_loss"]]


def _run_main(argvs: list[list[str]]) -> list[int]:
    return [train_gpt.main(argv) for argv in argvs]


def test_muon_trains_and_adafactor_resumes_under_another_strategy(
    rank_pool: Any, tmp_path: Path
) -> None:
    """One spawned group: fsdp + Muon for 4 steps; fsdp + Adafactor for 4 steps; fsdp +
    Adafactor saved after 2 steps and resumed by sdp (OSS(Adafactor)) to step 4; Muon +
    AdamW under ddp (a WholeTensorOptimizer on every rank) saved after step 2, resumed
    by oss (OSS(WholeTensorOptimizer)) for step 3, then by sdp for step 4: the fsdp
    run's losses."""
    d = {name: str(tmp_path / name) for name in ("muon", "whole", "resumed", "muon-whole")}
    muon_whole = [*COMMON, "--optimizer", "muon", "--out-dir", d["muon-whole"]]
    argvs = [
        [*COMMON, "--strategy", "fsdp", "--optimizer", "muon", "--save-every", "0"],
        [*COMMON, "--strategy", "fsdp", "--optimizer", "adafactor", "--save-every", "0"],
        [*COMMON, "--strategy", "fsdp", "--optimizer", "adafactor", "--save-every", "2"],
        [*COMMON, "--strategy", "sdp", "--optimizer", "adafactor", "--save-every", "0"],
        [*muon_whole, "--strategy", "ddp", "--save-every", "2", "--stop-after", "2"],
        [*muon_whole, "--strategy", "oss", "--save-every", "1", "--stop-after", "3", "--resume"],
        [*muon_whole, "--strategy", "sdp", "--save-every", "0", "--resume"],
    ]
    argvs[0] += ["--out-dir", d["muon"]]
    argvs[1] += ["--out-dir", d["whole"]]
    argvs[2] += ["--out-dir", d["resumed"], "--stop-after", "2"]
    argvs[3] += ["--out-dir", d["resumed"], "--resume"]
    assert rank_pool(2).run(_run_main, argvs, timeout_s=300) == [[0] * len(argvs)] * 2
    muon = _losses(tmp_path / "muon")
    assert len(muon) == STEPS and muon[-1] < muon[0] - 0.3, muon
    muon_whole_losses = _losses(tmp_path / "muon-whole")
    assert len(muon_whole_losses) == STEPS
    for a, b in zip(muon, muon_whole_losses):  # owners of whole tensors: fsdp's trajectory
        assert abs(a - b) < 1e-5, (muon, muon_whole_losses)
    whole, resumed = _losses(tmp_path / "whole"), _losses(tmp_path / "resumed")
    assert len(whole) == len(resumed) == STEPS
    assert whole[-1] < whole[0], whole  # Adafactor at --lr 2e-3 falls slowly
    for a, b in zip(whole, resumed):  # factored moments restored: the same trajectory
        assert abs(a - b) < 1e-5, (whole, resumed)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategy", "pipe", "--optimizer", "muon"], "--optimizer muon applies to --strategy"),
        (["--strategy", "pipe", "--optimizer", "adafactor"], "steps AdamW on each"),
        (["--strategy", "fsdp", "--optimizer", "muon", "--tp", "2"], "with --tp 2"),
        (["--strategy", "ddp", "--optimizer", "adafactor", "--cp", "2"], "with --cp 2"),
        (
            ["--strategy", "fsdp", "--optimizer", "muon", "--precision", "fp16"],
            "not tried with --precision fp16",
        ),
        (["--optimizer", "lion"], "invalid choice: 'lion'"),
    ],
)
def test_refused_combinations_exit_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert train_gpt.main([*argv, "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train_gpt.py: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not (tmp_path / "out").exists()
