"""The main job with ``--precision`` and ``--activation-checkpointing`` on 2 ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import train_gpt

from shardkit.models import GPT, gpt_config

TINY = ["--model-size", "tiny", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1"]
TINY += ["--sample-bytes", "0"]  # the sample is checked in test_train_gpt_outputs
COMMON = [*TINY, "--steps", "2", "--eval-every", "0", "--save-every", "0"]
RUNS = {
    "ddp_fp16": ["--strategy", "ddp", "--precision", "fp16"],
    "oss_bf16_ckpt": ["--strategy", "oss", "--precision", "bf16", "--activation-checkpointing"],
    "sdp_fp16_ckpt": ["--strategy", "sdp", "--precision", "fp16", "--activation-checkpointing"],
    "fsdp_bf16_ckpt": ["--strategy", "fsdp", "--precision", "bf16", "--activation-checkpointing"],
    "pipe_ckpt": ["--strategy", "pipe", "--activation-checkpointing"],
}


def _run_main(argvs: list[list[str]]) -> list[int]:
    return [train_gpt.main(argv) for argv in argvs]


def _metrics(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / "metrics.json").read_text())


def test_precision_and_checkpointing_run_and_resume(rank_pool: Any, tmp_path: Path) -> None:
    argvs = [[*COMMON, *flags, "--out-dir", str(tmp_path / name)] for name, flags in RUNS.items()]
    fp16 = [*TINY, "--strategy", "fsdp", "--precision", "fp16", "--steps", "2"]
    fp16 += ["--eval-every", "0", "--save-every", "1"]
    full, split = tmp_path / "fsdp_fp16_full", tmp_path / "fsdp_fp16_split"
    argvs += [
        [*fp16, "--out-dir", str(full)],
        [*fp16, "--out-dir", str(split), "--stop-after", "1"],
        [*fp16, "--out-dir", str(split), "--resume"],
    ]
    codes = rank_pool(2).run(_run_main, argvs, timeout_s=240)
    assert codes == [[0] * len(argvs)] * 2
    plain_keys = GPT(gpt_config("tiny", block_size=16)).state_dict().keys()
    for name in RUNS:
        m = _metrics(tmp_path / name)
        assert m["args"]["precision"] == name.split("_")[1].replace("ckpt", "fp32")
        assert all(math.isfinite(v) for _, v in m["train_loss"]), (name, m["train_loss"])
        # checkpoint wrappers leave the final model's keys those of the plain GPT
        assert torch.load(tmp_path / name / "model.pt").keys() == plain_keys, name
    # fp16 with a loss scaler resumes onto the same losses; the scaler state is saved
    assert _metrics(split)["train_loss"] == _metrics(full)["train_loss"]
    extra = torch.load(split / "ckpt-000001" / "extra-0.pt", weights_only=True)
    assert extra["strategy"]["scaler"]["scale"] == 2.0**14


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategy", "pipe", "--precision", "bf16"], "--precision bf16 applies to strategies"),
        (["--strategy", "offload", "--activation-checkpointing"], "offload checkpoints every"),
        (
            ["--strategy", "fsdp", "--offload-dir", "d"],
            "--offload-dir applies to --strategy "
            "offload only (its disk tier), not 'fsdp'; drop --offload-dir d or use --strategy",
        ),
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
        # regression: "" became the path "/rank0", at the filesystem root
        (["--strategy", "offload", "--offload-dir", ""], "--offload-dir needs a directory"),
    ],
)
def test_options_that_do_not_apply_exit_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert train_gpt.main([*argv, "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train_gpt.py: error: ") and message in err, err
