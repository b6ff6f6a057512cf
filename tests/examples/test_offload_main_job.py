"""The main job's ``offload`` strategy on the disk tier checkpoints and resumes through
the universal format, and the banner of ``--strategy pipe``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import train_gpt

from tests.examples.test_train_gpt_outputs import _run_main  # (exit code, stdout) per run

TINY = ["--model-size", "tiny", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1"]
TINY += ["--sample-bytes", "0"]  # the sample is checked in test_train_gpt_outputs
JOB = [*TINY, "--steps", "4", "--eval-every", "0", "--save-every", "2"]


def _metrics(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / "metrics.json").read_text())


def _generation(directory: Path) -> int:
    return int(json.loads((directory / "manifest.json").read_text())["generation"])


def test_disk_tier_saves_and_resumes(rank_pool: Any, tmp_path: Path) -> None:
    """On 2 ranks: 4 steps of ``offload --offload-dir`` straight (the reference); 2
    steps, a checkpoint, then ``--resume`` to 4: the same losses, bitwise (the
    directory is rebuilt from the checkpoint); a run that stopped before any
    checkpoint resumes from step 0, not from what its directory holds. On 1 rank (this
    process): the disk tier's step-2 checkpoint resumes under ddp, and a ddp checkpoint
    of 2 ranks under the disk tier, both ending on the reference's losses to float
    rounding (another world size: other reductions)."""
    offload = ["--strategy", "offload"]
    full, split, early, ddp = (tmp_path / n for n in ("full", "split", "early", "ddp"))

    def disk(name: str) -> list[str]:
        return [*offload, "--offload-dir", str(tmp_path / f"offload-{name}")]

    first = rank_pool(2).run(
        _run_main,
        [
            [*JOB, *disk("full"), "--out-dir", str(full)],
            [*JOB, *disk("split"), "--stop-after", "2", "--out-dir", str(split)],
            [*TINY, *disk("early"), "--steps", "1", "--save-every", "0", "--out-dir", str(early)],
            [*JOB, "--strategy", "ddp", "--stop-after", "2", "--out-dir", str(ddp)],
        ],
        timeout_s=240,
    )
    assert [code for code, _ in first[0]] == [0] * 4, first[0]
    assert not list(early.glob("ckpt-*"))
    split_at_2 = tmp_path / "split-at-2"
    shutil.copytree(split, split_at_2)
    second = rank_pool(2).run(
        _run_main,
        [
            [*JOB, *disk("split"), "--resume", "--out-dir", str(split)],
            [*JOB, *disk("early"), "--resume", "--out-dir", str(early)],
        ],
        timeout_s=240,
    )
    assert [code for code, _ in second[0]] == [0, 0], second[0]
    assert "resumed from" in second[0][0][1]
    want = _metrics(full)
    for out_dir, start in ((split, 2), (early, 0)):
        got = _metrics(out_dir)
        assert (got["start_step"], got["step"]) == (start, 4)
        assert got["train_loss"] == want["train_loss"], out_dir.name  # steps 1-4
        assert got["val_loss"] == want["val_loss"], out_dir.name
    # the resumed directory started afresh: generation 0, the checkpoint's (1), 2 steps
    assert _generation(tmp_path / "offload-split" / "rank0") == 3
    one_rank = [
        [*JOB, "--strategy", "ddp", "--resume", "--out-dir", str(split_at_2)],
        [*JOB, *disk("ddp"), "--resume", "--out-dir", str(ddp)],
    ]
    for argv, out_dir in zip(one_rank, (split_at_2, ddp), strict=True):
        assert train_gpt.main(argv) == 0, argv
        got = _metrics(out_dir)
        assert (got["start_step"], got["world_size"], got["grad_accum"]) == (2, 1, 2)
        for name in ("train_loss", "val_loss"):
            for (step, loss), (_, ref) in zip(got[name], want[name], strict=True):
                assert abs(loss - ref) <= 1e-4 * ref, (out_dir.name, name, step, loss, ref)


def test_pipe_banner_names_stages_not_data_parallel_ranks(rank_pool: Any, tmp_path: Path) -> None:
    """2 ranks under ``--strategy pipe`` are 2 pipeline stages: data-parallel size 1."""
    argv = [*TINY, "--strategy", "pipe", "--steps", "1", "--save-every", "0", "--eval-every", "0"]
    code, printed = rank_pool(2).run(_run_main, [[*argv, "--out-dir", str(tmp_path)]])[0][0]
    banner = next(line for line in printed.splitlines() if "strategy pipe" in line)
    assert code == 0
    assert (
        "global batch 4 = 2 x 1 micro-batch(es) x 2 rank(s) sampling rows, all of them "
        "through 2 pipeline stage(s) (data-parallel size 1)"
    ) in banner, banner
    assert "data-parallel rank(s)" not in banner
