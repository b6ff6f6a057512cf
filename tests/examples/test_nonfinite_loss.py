"""NaN loss in the main job without a loss scaler: every rank stops before the step.

The model and the checkpoints keep the last good state: the job exits with code 2 and
one line naming the step, and the newest checkpoint is the one before the NaN.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardkit.checkpoint.manifest import find_valid_checkpoint, verify_checkpoint
from tests.examples.faults import nan_loss_at
from tests.examples.test_restart import COMMON, _main_quiet


def _nan_run(out_dir: Path, strategy: str) -> tuple[int, list[str], str, int]:
    """On each pool rank: the job with a NaN loss on rank 1 at step 5 (after ckpt 3)."""
    argv = [*COMMON, "--strategy", strategy, "--out-dir", str(out_dir)]
    code, lines = _main_quiet(argv, [nan_loss_at(step=5, rank=1)])
    dist.barrier()
    latest = find_valid_checkpoint(out_dir, world_size=2)
    assert latest is not None
    return code, lines, latest.name, verify_checkpoint(latest).step


def _nan_runs(root: Path) -> list[Any]:
    return [_nan_run(root / strategy, strategy) for strategy in ("ddp", "fsdp")]


def test_nan_loss_stops_every_rank_before_the_step(rank_pool: Any, tmp_path: Path) -> None:
    per_rank = rank_pool(2).run(_nan_runs, tmp_path, timeout_s=180)
    for rank, results in enumerate(per_rank):
        for code, lines, latest, step in results:
            assert code == 2, (rank, code, lines)
            assert (latest, step) == ("ckpt-000003", 3)  # nothing written after the NaN
            if rank == 1:
                assert lines == []  # one line in all: rank 0's
                continue
            assert len(lines) == 1, lines
            assert lines[0].startswith(
                "train_gpt.py: error: step 5: the training loss is nan (mean over the 2 ranks); "
                "stopped before the optimizer step"
            ), lines
            assert "--precision fp16" in lines[0]
    for strategy in ("ddp", "fsdp"):
        assert not (tmp_path / strategy / "metrics.json").exists()
        assert sorted(p.name for p in (tmp_path / strategy).glob("ckpt-*")) == ["ckpt-000003"]
