"""A collective a peer never joins ends in an error naming the wrapper and the operation.

Each case runs on its own 2-rank group with a 3 s timeout (the shared pool's world
group keeps its long one), all cases at once in threads: rank 1 skips a step, a forward or a backward, or leaves the
group, and rank 0's error must say which wrapper, which operation, its rank and the
group size, with the backend's error chained.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.failures import CollectiveError, collective_context
from shardkit.nn import FullyShardedDataParallel, ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import RankError, run_distributed

_TIMEOUT = timedelta(seconds=3)  # margin for a rank slowed by load while building


Action = Callable[[], None] | None


def _oss_step(group: dist.ProcessGroup, skip: bool) -> Action:
    model = nn.Linear(4, 4)
    optimizer = OSS(model.parameters(), lr=0.1, group=group)

    def step() -> None:
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()

    return None if skip else step


def _no_grad_forward(model: nn.Module) -> Action:
    """A forward whose first collective is the all-gather (with grad enabled it is the
    agreement on the trainable parameters)."""

    def forward() -> None:
        with torch.no_grad():
            model(torch.ones(2, 4))

    return forward


def _fsdp_forward(group: dist.ProcessGroup, skip: bool) -> Action:
    model = FullyShardedDataParallel(nn.Linear(4, 4), process_group=group)
    return None if skip else _no_grad_forward(model)


def _fsdp_train_forward(group: dist.ProcessGroup, skip: bool) -> Action:
    model = FullyShardedDataParallel(nn.Linear(4, 4), process_group=group)
    return None if skip else lambda: model(torch.ones(2, 4))


def _sdp_backward(group: dist.ProcessGroup, skip: bool) -> Action:
    model = nn.Linear(4, 4)
    wrapped = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1, group=group), group)
    return None if skip else lambda: wrapped(torch.ones(2, 4)).sum().backward()


def _fsdp_peer_gone(group: dist.ProcessGroup, skip: bool) -> Action:
    model = FullyShardedDataParallel(nn.Linear(4, 4), process_group=group)
    if skip:  # its connections close, as when a rank dies
        return lambda: dist.destroy_process_group(group)
    return _no_grad_forward(model)


def _pipe_step(group: dist.ProcessGroup, skip: bool) -> Action:
    from shardkit.nn.pipe import PipelineStage, Schedule1F1B

    stage = PipelineStage(nn.Linear(4, 4), process_group=group)
    schedule = Schedule1F1B(stage, 2, loss_fn=nn.functional.mse_loss)
    # stage 0 sends its activations, then waits for gradients
    return None if skip else lambda: schedule.step(torch.ones(4, 4))


def _build(case: Callable[[dist.ProcessGroup, bool], Action]) -> Action:
    """Build on a fresh group with a short timeout (gloo's send/recv take it from the
    group's creation); rank 1 gets the action it skips (None or its leaving)."""
    group = dist.new_group([0, 1], timeout=_TIMEOUT)
    return case(group, dist.get_rank() == 1)


def _outcome(action: Action) -> str:
    try:
        if action is not None:
            action()
    except CollectiveError as err:
        return f"{err} | chained {type(err.__cause__).__name__}"
    return "ok"


def _cases() -> dict[str, str]:
    """Every case's group and wrapper built first (same order on both ranks), then the
    actions run at once, one thread each: each group has its own connections and
    timeout, so the six 3 s timeouts overlap instead of adding up."""
    builders = {
        "oss": _oss_step,
        "fsdp": _fsdp_forward,
        "fsdp-train": _fsdp_train_forward,
        "sdp": _sdp_backward,
        "fsdp-gone": _fsdp_peer_gone,
        "pipe": _pipe_step,
    }
    actions = {name: _build(build) for name, build in builders.items()}
    dist.barrier()  # the world group: both ranks start the actions together
    with ThreadPoolExecutor(len(actions)) as pool:
        outcomes = {name: pool.submit(_outcome, action) for name, action in actions.items()}
        done = {name: future.result() for name, future in outcomes.items()}
    dist.barrier()  # the world group: rank 1 waits here for rank 0's timeouts
    return done


def test_skipped_collective_names_wrapper_and_operation(rank_pool: Any) -> None:
    results = rank_pool(2).run(_cases)
    assert all(outcome == "ok" for outcome in results[1].values()), results[1]
    got = results[0]
    expected = {
        "oss": "OSS: step: broadcast of updated parameters failed on rank 0 of a group of 2",
        "fsdp": "FullyShardedDataParallel: all-gather of parameters failed on rank 0 of a group of 2",
        "fsdp-train": "FullyShardedDataParallel: agreement on the trainable parameters failed on "
        "rank 0 of a group of 2",
        "sdp": "ShardedDataParallel: backward: reduce of gradients failed on rank 0 of a group of 2",
        "fsdp-gone": "FullyShardedDataParallel: all-gather of parameters failed on rank 0",
        "pipe": "PipelineStage: ",
    }
    for case, start in expected.items():
        assert got[case].startswith(start), (case, got[case])
        assert "a rank skipped a forward, backward or optimizer step" in got[case]
        assert "a rank died" in got[case] and "different models" in got[case]
        assert "Backend error: " in got[case] and "| chained " in got[case]
    # the stage names the receive it waited on (how precisely depends on the stage)
    assert "receive" in got["pipe"] and "failed on rank 0 of a group of 2" in got["pipe"]


_DEAD_RANK_CASES = {
    "fsdp": (_fsdp_forward, "FullyShardedDataParallel: all-gather of parameters failed"),
    "oss": (_oss_step, "OSS: step: broadcast of updated parameters failed"),
    "sdp": (_sdp_backward, "ShardedDataParallel: backward: reduce of gradients failed"),
}


def _die_after_wrapping(report_dir: str) -> None:
    """The last rank wraps with each survivor in a group of 2 (rank i: case i), then
    exits as if killed; each survivor's next collective (FSDP's forward, OSS's step,
    ShardedDataParallel's backward) must raise, not hang. One spawn for all cases."""
    dying, rank = dist.get_world_size() - 1, dist.get_rank()
    groups = [dist.new_group([i, dying]) for i in range(dying)]  # every rank, same order
    actions = {
        i: build(groups[i], False)
        for i, (build, _) in enumerate(_DEAD_RANK_CASES.values())
        if rank in (i, dying)
    }
    dist.barrier()  # every wrapper built: the survivors act once the last rank is gone
    if rank == dying:
        os._exit(9)
    action = actions[rank]
    assert action is not None
    try:
        action()
    except CollectiveError as err:
        report = Path(report_dir) / f"{list(_DEAD_RANK_CASES)[rank]}.txt"
        report.write_text(f"{err} | chained {type(err.__cause__).__name__}")
        raise


def test_dead_rank_ends_the_survivors_collective(tmp_path: Path) -> None:
    """A rank process that dies: each survivor's collective raises a CollectiveError
    (their own spawned ranks: the dead rank ends the pool). Not by a timeout: the
    harness gives the survivors 5 s after the death to report, and the groups' 30 s
    timeout only leaves room for 4 ranks building on a loaded 2-core machine."""
    world_size = len(_DEAD_RANK_CASES) + 1
    with pytest.raises(RankError) as info:
        run_distributed(_die_after_wrapping, world_size, str(tmp_path), timeout_s=30.0)
    assert info.value.rank == world_size - 1, info.value
    assert "exited with code 9" in info.value.remote_traceback
    for case, (_, start) in _DEAD_RANK_CASES.items():
        text = (tmp_path / f"{case}.txt").read_text()
        assert text.startswith(f"{start} on rank 0 of a group of 2"), (case, text)
        assert "a rank died" in text and "| chained " in text, (case, text)
        assert "Connection" in text and "Timed out" not in text, (case, text)  # the death


def test_other_errors_pass_unchanged() -> None:
    with pytest.raises(ValueError, match="not a collective"), collective_context("X", "op"):
        raise ValueError("not a collective")
    with pytest.raises(RuntimeError, match="shape mismatch") as info, collective_context("X", "op"):
        raise RuntimeError("shape mismatch")
    assert not isinstance(info.value, CollectiveError)
    with pytest.raises(CollectiveError) as failed, collective_context("OSS", "broadcast"):
        raise RuntimeError("[gloo] Timed out waiting 2000ms for recv operation to complete")
    assert str(failed.value).startswith("OSS: broadcast failed on rank 0 of a group of 1:")
    assert failed.value.operation == "broadcast" and failed.value.world_size == 1
