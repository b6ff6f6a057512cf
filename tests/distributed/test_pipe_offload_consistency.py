"""Data-parallel OffloadModel and cross-rank pipeline schedules check that ranks agree."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn

from shardkit.distributed.consistency import ConsistencyError
from shardkit.nn import OffloadModel


def _outcome(build: Callable[[], Any]) -> str:
    try:
        build()
    except ConsistencyError as err:
        return str(err)
    return "ok"


def _offload(width: int, num_slices: int) -> OffloadModel:
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
    return OffloadModel(model, "cpu", num_slices=num_slices, process_group=dist.group.WORLD)


def _cases() -> dict[str, str]:
    rank = dist.get_rank()
    return {
        "offload-same": _outcome(lambda: _offload(4, 2)),
        "offload-width": _outcome(lambda: _offload(4 + rank, 2)),
        "offload-slices": _outcome(lambda: _offload(4, 2 + rank)),
        "offload-single": _outcome(  # no process group: single process, nothing checked
            lambda: OffloadModel(nn.Sequential(nn.Linear(4, 4 + rank)), "cpu", num_slices=1)
        ),
    }


def test_ranks_that_disagree_are_named(rank_pool: Any) -> None:
    per_rank = rank_pool(2).run(_cases)
    assert per_rank[0] == per_rank[1]  # every rank raises the same error
    got = per_rank[0]
    assert got["offload-same"] == got["offload-single"] == "ok"
    assert got["offload-width"].startswith("OffloadModel: ranks disagree at entry 3 of 7: ")
    assert "ranks [1] have '0.weight shape=(5, 4)" in got["offload-width"]
    assert "ranks [0] have 'option num_slices=2'" in got["offload-slices"]


def _schedule(kind: str, chunks: int) -> Any:
    from shardkit.nn.pipe import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(nn.Linear(4, 4))
    schedule = Schedule1F1B if kind == "1f1b" else ScheduleGPipe
    return schedule(stage, chunks, loss_fn=nn.functional.mse_loss)


def _pipe_cases() -> dict[str, str]:
    rank = dist.get_rank()
    return {
        "same": _outcome(lambda: _schedule("1f1b", 4)),
        "chunks": _outcome(lambda: _schedule("1f1b", 4 + rank)),
        "schedule": _outcome(lambda: _schedule("1f1b" if rank == 0 else "gpipe", 4)),
    }


def test_pipeline_stages_that_disagree_are_named(rank_pool: Any) -> None:
    per_rank = rank_pool(2).run(_pipe_cases)
    for rank, got in enumerate(per_rank):
        assert got["same"] == "ok"
        assert got["chunks"].startswith(f"Schedule1F1B (stage {rank} of 2): ranks disagree at")
        assert "ranks [0] have 'option chunks=4'; ranks [1] have 'option chunks=5'" in got["chunks"]
        assert "ranks [0] have \"option schedule='Schedule1F1B'\"" in got["schedule"]
        assert "ranks [1] have \"option schedule='ScheduleGPipe'\"" in got["schedule"]
