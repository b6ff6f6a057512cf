"""The main job with ``--async-checkpoint``: its checkpoints resume bit for bit.

One 2-rank run of 8 steps saves at steps 3, 6 and 8 in the background (``--keep 0``).
A copy of its directory as it would be had the step-8 save never committed (``latest``
on ``ckpt-000006``, as a kill during that background write leaves it) resumes with
``--async-checkpoint`` and must end exactly as the uninterrupted run: the same loss
at every step and bitwise-equal final parameters (``model.pt``).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import train_gpt

from shardkit.checkpoint.manifest import LATEST_NAME, verify_checkpoint

ARGS = ["--model-size", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1"]
ARGS += ["--steps", "8", "--eval-every", "4", "--save-every", "3", "--keep", "0"]
ARGS += ["--sample-bytes", "0"]  # the sample is checked in test_train_gpt_outputs


def _main(argv: list[str]) -> int:
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        return train_gpt.main(argv)


def _async_runs(root: Path) -> list[Any]:
    full, resumed = root / "full", root / "resumed"
    codes = [_main([*ARGS, "--async-checkpoint", "--out-dir", str(full)])]
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.copytree(full, resumed)
        shutil.rmtree(resumed / "ckpt-000008")
        (resumed / "model.pt").unlink()
        (resumed / LATEST_NAME).write_text("ckpt-000006\n")
    dist.barrier()
    codes.append(_main([*ARGS, "--async-checkpoint", "--resume", "--out-dir", str(resumed)]))
    return codes


def test_async_checkpoints_resume_bit_for_bit(rank_pool: Any, tmp_path: Path) -> None:
    codes = rank_pool(2).run(_async_runs, tmp_path, timeout_s=180)
    assert codes == [[0, 0], [0, 0]]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert [verify_checkpoint(full / f"ckpt-00000{s}").step for s in (3, 6, 8)] == [3, 6, 8]
    m_full = json.loads((full / "metrics.json").read_text())
    m_resumed = json.loads((resumed / "metrics.json").read_text())
    assert (m_full["args"]["async_checkpoint"], m_resumed["start_step"]) == (True, 6)
    assert [s for s, _ in m_resumed["train_loss"]] == list(range(1, 9))
    assert m_resumed["train_loss"] == m_full["train_loss"]
    a, b = torch.load(full / "model.pt"), torch.load(resumed / "model.pt")
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_async_checkpoint_needs_save_every() -> None:
    with pytest.raises(train_gpt.InputError, match="--save-every is 0; give --save-every N > 0"):
        train_gpt.parse_args(["--async-checkpoint", "--save-every", "0"])
