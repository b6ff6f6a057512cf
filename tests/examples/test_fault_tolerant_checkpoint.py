"""``--fault-tolerant`` with checkpoints: a resumed job ends bit for bit as the uninterrupted one.

One replica of two ranks (the shared 2-rank pool, ``--strategy hsdp``, ``--max-replicas
1``) trains 4 steps against a quorum store hosted by the test, with a checkpoint every
2 steps into ``--checkpoint-dir`` (steps 2 and 4: the replica is the lowest member of
each quorum, so it writes). A copy of that directory as it was after step 2 resumes on a
fresh store (the manager starts at step 2) and must end as the uninterrupted run: the
same loss at every step and bitwise-equal final parameters (``model.pt``).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import train_gpt

from shardkit.checkpoint.manifest import LATEST_NAME, verify_checkpoint
from shardkit.distributed.fault_tolerance import host_store

ARGS = ["--model-size", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1"]
ARGS += ["--steps", "4", "--eval-every", "0", "--save-every", "2", "--keep", "0"]
ARGS += ["--strategy", "hsdp", "--max-replicas", "1"]


def _main(argv: list[str]) -> int:
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        return train_gpt.main(argv)


def _runs(root: Path, ports: list[int]) -> list[int]:
    def job(port: int, name: str, *extra: str) -> int:
        store = ["--fault-tolerant", f"127.0.0.1:{port}", "--out-dir", str(root / name)]
        return _main([*ARGS, *store, "--checkpoint-dir", str(root / f"ckpt-{name}"), *extra])

    codes = [job(ports[0], "full")]
    dist.barrier()
    if dist.get_rank() == 0:  # the directory as it was after the step-2 checkpoint
        shutil.copytree(root / "ckpt-full", root / "ckpt-resumed")
        shutil.rmtree(root / "ckpt-resumed" / "ckpt-000004")
        (root / "ckpt-resumed" / LATEST_NAME).write_text("ckpt-000002\n")
    dist.barrier()
    codes.append(job(ports[1], "resumed", "--resume"))
    return codes


def test_fault_tolerant_checkpoints_resume_bit_for_bit(rank_pool: Any, tmp_path: Path) -> None:
    stores = [host_store(0), host_store(0)]  # a resumed job needs a fresh store
    codes = rank_pool(2).run(_runs, tmp_path, [s.port for s in stores], timeout_s=180)
    assert codes == [[0, 0], [0, 0]]
    ckpts = tmp_path / "ckpt-full"
    assert [verify_checkpoint(ckpts / f"ckpt-00000{s}").step for s in (2, 4)] == [2, 4]
    assert not (tmp_path / "full" / LATEST_NAME).exists()  # not into --out-dir
    full, resumed = (
        json.loads((tmp_path / n / "metrics.json").read_text()) for n in ("full", "resumed")
    )
    assert resumed["start_step"] == 2
    assert [s for s, _ in resumed["train_loss"]] == list(range(1, 5))
    assert resumed["train_loss"] == full["train_loss"]
    lines = (tmp_path / "resumed" / "ft_steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(3, 5))
    a, b = (torch.load(tmp_path / n / "model.pt") for n in ("full", "resumed"))
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
