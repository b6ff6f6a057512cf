"""Recovery of the main job: a rank killed mid-step under torchrun; a damaged checkpoint.

Both end where an uninterrupted run ends: the same per-step losses and the same final
parameters (``model.pt``), bit for bit.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import train_gpt

from shardkit.checkpoint.manifest import verify_checkpoint
from tests.checkpoint.payload import plant_payload
from tests.examples import faults

TINY = ["--model-size", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1"]
TINY += ["--sample-bytes", "0"]  # the sample is checked in test_train_gpt_outputs
COMMON = [*TINY, "--steps", "8", "--eval-every", "4", "--save-every", "3"]
FAULTS = Path(faults.__file__)  # train_gpt.py with a fault hook, as a torchrun script
SHARD0, SHARD1 = "shard-0-of-2.safetensors", "shard-1-of-2.safetensors"  # universal format


def _metrics(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / "metrics.json").read_text())


def _assert_same_run(a: Path, b: Path) -> None:
    """Same losses at every step and bitwise-equal final parameters."""
    ma, mb = _metrics(a), _metrics(b)
    assert mb["step"] == ma["step"] == 8
    assert [s for s, _ in mb["train_loss"]] == list(range(1, 9))
    assert mb["train_loss"] == ma["train_loss"]
    assert mb["val_loss"] == ma["val_loss"]
    model_a, model_b = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    assert model_a.keys() == model_b.keys()
    differ = [k for k in model_a if not torch.equal(model_a[k], model_b[k])]
    assert not differ, differ


@pytest.fixture(scope="module")
def full_run(rank_pool: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run, on the shared 2-rank pool (the same threads per rank as
    under torchrun: ``setup_distributed`` sets usable cores // 2 in both)."""
    out_dir = tmp_path_factory.mktemp("restart") / "full"
    codes = rank_pool(2).run(_main_quiet, [*COMMON, "--out-dir", str(out_dir)], timeout_s=120)
    assert [code for code, _ in codes] == [0, 0], codes
    return out_dir


def test_sigkill_mid_step_restarts_and_matches(tmp_path: Path, full_run: Path) -> None:
    """Rank 1 SIGKILLs itself in step 5 (after the step-3 checkpoint), between its
    backward pass and its optimizer step; torchrun (``--max-restarts 1``) restarts the
    job, which resumes at step 3 and ends as the uninterrupted run does. The kill is a
    hook the test script installs (``tests/examples/faults.py``), not part of the job."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["--max-restarts", "1", str(FAULTS), *COMMON, "--resume"]
    cmd += ["--out-dir", str(tmp_path), "--fault-kill-at-step", "4", "--fault-rank", "1"]
    # CPU and gloo like the pool's reference run, also where CUDA exists
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--resume: no checkpoint" in proc.stdout  # the first attempt started afresh
    assert f"resumed from {tmp_path / 'ckpt-000003'} at step 3" in proc.stdout, proc.stdout
    assert "exitcode: -9" in proc.stderr, proc.stderr[-3000:]  # torchrun saw the SIGKILL
    assert _metrics(tmp_path)["start_step"] == 3  # metrics.json of the restarted attempt
    _assert_same_run(full_run, tmp_path)


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 3])
    else:  # flip one byte in the middle: same size, other content
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :])


def _main_quiet(
    argv: list[str], callbacks: Sequence[train_gpt.Callback] = ()
) -> tuple[int, list[str]]:
    """Run the job; its exit code and its ``train_gpt.py: ...`` lines on stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = train_gpt.main(argv, callbacks)
    lines = err.getvalue().splitlines()  # the progress bar's \r-separated updates too
    return code, [line for line in lines if line.startswith("train_gpt.py: ")]


def _damaged_resumes(root: Path) -> list[Any]:
    """On each pool rank: a run stopped after step 6, copied; ckpt-6 truncated in one
    copy and corrupted in the other; both resumed; then every checkpoint damaged."""
    rank, out = dist.get_rank(), []
    out.append(_main_quiet([*COMMON, "--out-dir", str(root / "truncate"), "--stop-after", "6"]))
    dist.barrier()
    if rank == 0:  # rank 1's file: only rank 1 hashes it, rank 0 must hear of it
        shutil.copytree(root / "truncate", root / "flip")
        for how in ("truncate", "flip"):
            _damage(root / how / "ckpt-000006" / SHARD1, how)
    dist.barrier()
    for how in ("truncate", "flip"):
        out.append(_main_quiet([*COMMON, "--out-dir", str(root / how), "--resume"]))
    dist.barrier()  # the resumed runs rewrote ckpt-6: intact again
    dirs = [root / how / f"ckpt-00000{step}" for how in ("truncate", "flip") for step in (6, 8)]
    out.append([verify_checkpoint(ckpt, world_size=2).step for ckpt in dirs])
    dist.barrier()
    if rank == 0:  # every checkpoint damaged: refuse, do not restart from step 0
        for ckpt in ("ckpt-000006", "ckpt-000008"):
            _damage(root / "flip" / ckpt / SHARD0, "truncate")
    dist.barrier()
    out.append(_main_quiet([*COMMON, "--out-dir", str(root / "flip"), "--resume"]))
    return out


def test_damaged_latest_falls_back_to_previous(
    rank_pool: Any, tmp_path: Path, full_run: Path
) -> None:
    """A truncated or corrupted newest checkpoint: one warning line, resume from the
    previous one, and the same losses and parameters as the uninterrupted run."""
    per_rank = rank_pool(2).run(_damaged_resumes, tmp_path, timeout_s=180)
    for rank, results in enumerate(per_rank):
        codes = [results[i][0] for i in (0, 1, 2, 4)]
        assert codes == [0, 0, 0, 2], (rank, results)
    r0 = per_rank[0]
    for (_, lines), how, problem in [
        (r0[1], "truncate", "truncated"),
        (r0[2], "flip", "corrupted"),
    ]:
        assert len(lines) == 1, lines  # one line, on rank 0 only
        (warning,) = lines
        assert warning.startswith("train_gpt.py: warning: checkpoint "), warning
        assert f"{how}/ckpt-000006/{SHARD1} is {problem}" in warning, warning
        assert warning.rstrip().endswith("using ckpt-000003 instead"), warning
        _assert_same_run(full_run, tmp_path / how)
        assert _metrics(tmp_path / how)["start_step"] == 3
    assert r0[3] == [6, 8, 6, 8]
    assert per_rank[1][1][1] == per_rank[1][2][1] == []  # only rank 0 warns
    lines = per_rank[0][4][1]  # every rank exits 2 (above), rank 0 says why, once
    assert len(lines) == 1, lines
    assert lines[0].startswith("train_gpt.py: error: --resume: no usable checkpoint")
    assert f"ckpt-000008/{SHARD0} is truncated" in lines[0], lines
    assert per_rank[1][4][1] == []


def _planted_resume(root: Path) -> list[Any]:
    """On each pool rank: a run stopped after step 3; rank 0 plants a pickle payload in
    ``ckpt-000003/extra-1.pt`` (rank 1's resumable state; manifest rewritten to match);
    ``--resume``."""
    out: list[Any] = [_main_quiet([*COMMON, "--out-dir", str(root), "--stop-after", "3"])]
    dist.barrier()
    if dist.get_rank() == 0:
        plant_payload(root / "ckpt-000003", "extra-1.pt", root / "marker")
    dist.barrier()
    out.append(_main_quiet([*COMMON, "--out-dir", str(root), "--resume"]))
    dist.barrier()
    out.append((root / "marker").exists())
    return out


def test_resume_refuses_pickle_payload(rank_pool: Any, tmp_path: Path) -> None:
    """``--resume`` loads tensors and plain containers only: a payload planted in one
    rank's file, with a matching manifest, ends every rank with exit code 2 and rank 0
    with one line naming the file; the payload never runs."""
    per_rank = rank_pool(2).run(_planted_resume, tmp_path, timeout_s=180)
    for first, (code, _), marker in per_rank:
        assert first == (0, []), first
        assert code == 2
        assert not marker
    assert per_rank[1][1][1] == []  # rank 1's file, but rank 0 says it, once
    lines = per_rank[0][1][1]
    assert len(lines) == 1, lines  # the error of rank 1's file, on rank 0 (its own intact)
    assert lines[0].startswith(
        f"train_gpt.py: error: --resume: {tmp_path / 'ckpt-000003' / 'extra-1.pt'} holds "
        "an object that is not a tensor or a plain container"
    ), lines
    assert "posix.system" in lines[0] and "refused: loading it could run code" in lines[0]
    assert not (tmp_path / "marker").exists()
