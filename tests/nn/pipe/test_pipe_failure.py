"""A stage that raises mid-step: every other stage raises at once, naming the stage that
failed first (an abort marker instead of the next message), not after the timeout."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardkit.nn.pipe import PipelineStage, Schedule1F1B, ScheduleGPipe
from shardkit.nn.pipe.failure import (
    StageFailedError,
    abort_header,
    abort_tensors,
    header_abort_reason,
    read_abort,
)
from shardkit.nn.pipe.p2p import TensorMeta

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
STAGES = 4


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad backward")


class Explode(nn.Module):
    """Identity until its ``at``-th call (0-based), which raises in ``phase``."""

    def __init__(self, phase: str, at: int) -> None:
        super().__init__()
        self.phase, self.at, self.calls = phase, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls - 1 != self.at:
            return x
        if self.phase == "forward":
            raise ValueError("bad layer")
        return _FailInBackward.apply(x)  # type: ignore[no-any-return]


def run_failures(configs: list[tuple[str, int, str, int, int]]) -> list[str]:
    """Per config (schedule, chunks, phase, failing stage, micro-batch): one step on a
    fresh 4-stage group; what this rank raised (``Type: message``). Phase ``loss``: the
    last stage's targets have the wrong shape; ``absent``: the stage skips the step (its
    neighbours time out after 3 s). Activations of 2 x 32 float32 (256 bytes) carry
    the error text in a gradient marker."""
    rank, got = dist.get_rank(), []
    for schedule, chunks, phase, failing, microbatch in configs:
        timeout = datetime.timedelta(seconds=3 if phase == "absent" else 120)
        group = dist.new_group(list(range(STAGES)), timeout=timeout)
        torch.manual_seed(rank)
        layers: list[nn.Module] = [nn.Linear(32, 32), nn.Tanh()]
        if rank == failing and phase in ("forward", "backward"):
            layers.append(Explode(phase, microbatch))
        stage = PipelineStage(nn.Sequential(*layers), process_group=group)
        runner = SCHEDULES[schedule](stage, chunks, loss_fn=F.mse_loss)
        target = torch.zeros(8, 32 if phase != "loss" else 3)
        try:
            if not (rank == failing and phase == "absent"):
                runner.step(torch.randn(8, 32) if rank == 0 else None, target=target)
            got.append("ok")
        except Exception as error:
            got.append(f"{type(error).__name__}: {error}")
    return got


def test_every_stage_names_the_stage_that_failed(rank_pool: Any) -> None:
    configs = [
        ("1f1b", 4, "forward", 1, 2),  # stage 0 hears it by a gradient, 2 and 3 by headers
        ("gpipe", 3, "backward", 2, 1),  # in a backward: stages 1 and 0 hear it by gradients
        ("1f1b", 4, "loss", 3, 0),  # the loss on the last stage
        ("gpipe", 2, "absent", 1, 0),  # no marker: the neighbours' timeouts, named
    ]
    got = rank_pool(STAGES).run(run_failures, configs, timeout_s=120)
    by_config = list(zip(*got))
    forward, backward, loss, absent = by_config
    assert forward[1] == "ValueError: bad layer"
    for r in (0, 2, 3):
        assert forward[r].startswith(f"StageFailedError: stage {r}: receive of the "), forward
        assert forward[r].endswith("stage 1 (rank 1) failed: ValueError: bad layer"), forward
    assert backward[2] == "ValueError: bad backward"
    for r in (0, 1):  # the last stage finished its step before stage 2's backward failed
        assert backward[r].endswith("stage 2 (rank 2) failed: ValueError: bad backward"), backward
    assert backward[3] == "ok"
    assert loss[3].startswith("RuntimeError") or loss[3].startswith("ValueError"), loss
    assert all("stage 3 (rank 3) failed: " in loss[r] for r in (0, 1, 2)), loss
    assert absent[1] == "ok"
    assert absent[0].startswith("CollectiveError: PipelineStage: stage 0: receive of the output ")
    assert "micro-batch 0 from stage 1 (rank 1)" in absent[0]
    assert "stage 2: receive of the input of micro-batch 0 from stage 1 (rank 1)" in absent[2]
    assert "from stage 2 (rank 2)" in absent[3] or "stage 2 (rank 2) failed" in absent[3]


@pytest.mark.parametrize("text", ["", "stage 1 (rank 1) failed: ValueError: bad", "é" * 400])
def test_abort_markers_round_trip(text: str) -> None:
    header = abort_header(text)
    assert header_abort_reason(header) == text.encode()[:304].decode(errors="replace")
    grads = abort_tensors(text, [TensorMeta((4, 100), torch.float32, False)])
    assert read_abort(grads) == text
    tiny = abort_tensors(text, [TensorMeta((1,), torch.float32, False)])
    assert read_abort(tiny) is not None  # the marker fits, the text does not
    assert read_abort([torch.randn(4, 100), torch.ones(2)]) is None
    assert read_abort([torch.full((3,), float("nan"))]) is None  # an ordinary NaN gradient
    assert header_abort_reason(torch.zeros(40, dtype=torch.int64)) is None
    assert str(StageFailedError(text, "stage 0: receive")).endswith(text)
