"""Fault-tolerant replicas: parity with DDP, a slow or dead replica dropped, rejoins.

Each pool rank is one replica (rank = replica id); the replicas share only a TCPStore
hosted by the test process, with its own key prefix per scenario. A replica is made
slow by sleeping before its reduction (longer than the collective timeout plus the
vote window), killed with ``os._exit``, and restarted by building a new model,
optimizer and manager in the same process (its step count starts at 0 again, its
weights from another seed), which must heal from a live peer. The references are the
plain model trained on the batches of the replicas that contributed to each step.
"""

from __future__ import annotations

import copy
import functools
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.fault_tolerance import FaultTolerantReplicas
from shardkit.testing import RankError, RankPool

_NO_FAILURE_T = 10.0  # collective timeout and vote window, seconds: never reached
_FAILURE_T = 1.5  # where a failure waits for it: short, and spurious drops are allowed


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(3, 4, generator=generator), torch.randn(3, 2, generator=generator)


def _loss(model: nn.Module, step: int, replica: int) -> torch.Tensor:
    x, y = _batch(step, replica)
    return nn.functional.mse_loss(model(x), y)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


class _Replica:
    """One incarnation of a replica: model, optimizer and manager."""

    def __init__(self, store: dist.Store, prefix: str, cfg: dict[str, Any], seed: int) -> None:
        self.model = _model(seed)
        self.optimizer = _optimizer(self.model)
        self.served: list[dict[str, Any]] = []
        self.fail_serving = cfg.get("fail_serving", False)
        self.ft = FaultTolerantReplicas(
            store,
            dist.get_rank(),
            state_dict=self.state_dict,
            load_state_dict=self.load_state_dict,
            timeout_s=cfg.get("timeout", _NO_FAILURE_T),
            quorum_timeout_s=30.0,
            initial_replicas=len(cfg["replicas"]),
            prefix=prefix,
        )

    def state_dict(self) -> dict[str, Any]:
        if self.fail_serving:  # once: the first transfer fails on the source's side
            self.fail_serving = False
            raise RuntimeError("simulated failure while serving the state")
        state = {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}
        self.served.append(copy.deepcopy({**state, "step": self.ft.step}))
        return state

    def load_state_dict(self, states: list[Any]) -> None:
        (state,) = states  # a replica of one process sends one part
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])


def _snapshot(replica: _Replica) -> dict[str, Any]:
    return copy.deepcopy(
        {
            "model": replica.model.state_dict(),
            "optim": replica.optimizer.state_dict(),
            "step": replica.ft.step,
        }
    )


def _train(port: int, prefix: str, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Train until ``cfg["steps"]`` steps are committed by a quorum of
    ``cfg["final_members"]`` replicas (a dropped replica rejoins first).
    ``slow`` / ``die``: {replica: step}. With ``report``, also saved to a file."""
    me = dist.get_rank()
    if me not in cfg["replicas"]:
        return None
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    rep = _Replica(store, prefix, {**cfg, "fail_serving": me == 0 and cfg.get("fail_serving")}, 0)
    history: list[tuple[int, tuple[int, ...]]] = []  # this incarnation's committed steps
    commits: list[tuple[int, tuple[int, ...]]] = []  # every incarnation's
    healed: list[dict[str, Any]] = []
    served: list[dict[str, Any]] = []
    wrote: list[int] = []  # the committed steps this replica checkpointed
    slow = dict(cfg.get("slow", {}))
    final_members = cfg.get("final_members", len(cfg["replicas"]))
    deadline = time.monotonic() + 60.0
    while rep.ft.step < cfg["steps"] or rep.ft.num_members < final_members:
        if time.monotonic() > deadline:
            raise RuntimeError(f"replica {me}: the others never rejoined: {history}")
        if rep.ft.step >= cfg["steps"]:  # waiting for a rejoin: do not run far ahead
            time.sleep(0.3)
        healed_before = rep.ft.stats.healed
        rep.ft.start_step()
        if rep.ft.stats.healed > healed_before:
            healed.append(_snapshot(rep))
        rep.optimizer.zero_grad()
        _loss(rep.model, rep.ft.step, me).backward()
        if cfg.get("die", {}).get(me) == rep.ft.step:
            os._exit(9)
        if slow.get(me) == rep.ft.step:  # slow but alive: wake after the others gave up
            del slow[me]
            assert rep.ft.quorum is not None
            store.wait([f"{prefix}/round/{rep.ft.quorum.round}/verdict"])
        step = rep.ft.step
        if rep.ft.average_gradients(rep.model.parameters()):
            rep.optimizer.step()
            assert rep.ft.quorum is not None
            history.append((step, rep.ft.quorum.members))
            commits.append(history[-1])
            count = len(wrote)
            assert rep.ft.checkpoint(functools.partial(wrote.append, step)) == (len(wrote) > count)
        else:  # dropped: restart this replica from scratch, another initialisation
            served += rep.served
            rep = _Replica(store, prefix, {**cfg, "fail_serving": False}, seed=100 + step)
            history = []
    result = {
        "history": history,
        "commits": commits,
        "final": _snapshot(rep),
        "healed": healed,
        "served": served + rep.served,
        "wrote": wrote,
    }
    if cfg.get("report"):
        torch.save(result, Path(cfg["report"], f"replica{me}.pt"))
    return result


def _reference(history: list[tuple[int, tuple[int, ...]]]) -> dict[str, Any]:
    """The plain model trained on the contributors' batches of each step (each
    gradient divided by the count, then summed in replica order, as the reduction)."""
    model = _model(0)
    optimizer = _optimizer(model)
    for step, members in history:
        grads = []
        for replica in members:
            model.zero_grad()
            _loss(model, step, replica).backward()
            grads.append([p.grad.clone() / len(members) for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum((g[i] for g in grads[1:]), grads[0][i])
        optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def _ddp_run(steps: int) -> dict[str, Any] | None:
    """The normal run: torch DDP on ranks 0 and 1 with the same batches."""
    group = dist.new_group([0, 1])
    if dist.get_rank() > 1:
        return None
    model = nn.parallel.DistributedDataParallel(_model(0), process_group=group)
    optimizer = _optimizer(model)
    for step in range(steps):
        optimizer.zero_grad()
        _loss(model, step, dist.get_rank()).backward()
        optimizer.step()
    return {"model": model.module.state_dict(), "optim": optimizer.state_dict()}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)


def test_no_failure_equals_ddp_then_two_drops_rejoin(rank_pool: Any, store: dist.TCPStore) -> None:
    pool = rank_pool(3)
    # 1. No failure, two replicas: bit for bit the torch DDP run and the reference.
    ft = pool.run(_train, store.port, "none", {"replicas": [0, 1], "steps": 4})
    ddp = pool.run(_ddp_run, 4)
    expected = [(s, (0, 1)) for s in range(4)]
    reference = _reference(expected)
    for replica in (0, 1):
        assert ft[replica]["history"] == expected
        assert _equal(ft[replica]["final"]["model"], ddp[0]["model"])
        assert _equal(ft[replica]["final"]["optim"], ddp[0]["optim"])
        assert _equal(ft[replica]["final"]["model"], reference["model"])
    assert (ft[0]["wrote"], ft[1]["wrote"]) == ([0, 1, 2, 3], [])  # the lowest member writes
    # 2. Two failures in a row: replica 1 slow in step 1, replica 2 slow in step 2;
    # each is dropped, restarts from scratch and heals; replica 0's first transfer fails.
    # (Under load a replica may also be dropped spuriously by the short timeout: the
    # checks below hold whoever is dropped.)
    cfg = {"replicas": [0, 1, 2], "steps": 5, "slow": {1: 1, 2: 2}, "fail_serving": True}
    results = pool.run(_train, store.port, "two-in-a-row", {**cfg, "timeout": _FAILURE_T})
    # the job's history: every step committed by any incarnation of any replica (a
    # replica dropped spuriously under load restarts, so no single one need hold it all)
    job = {step: members for r in results for step, members in r["commits"]}
    for r in results:
        assert all(job[step] == members for step, members in r["commits"]), r["commits"]
    history = sorted(job.items())
    assert [s for s, _ in history] == list(range(len(history))), history
    writers = {s: r for r, result in enumerate(results) for s in result["wrote"]}
    assert writers == {s: min(members) for s, members in history}, writers  # once a step
    assert 1 not in history[1][1] and 2 not in history[2][1], history
    assert history[-1][1] == (0, 1, 2), history
    for replica in (1, 2):  # lockstep after healing: the same steps from then on
        tail = results[replica]["history"]
        assert tail and tail == history[len(history) - len(tail) :], (replica, tail, history)
        assert _equal(results[replica]["final"], results[0]["final"]), replica
    # a joiner's state right after healing is what its source sent, exactly
    served = [s for r in results for s in r["served"]]
    for replica in (1, 2):
        assert results[replica]["healed"], replica
        for got in results[replica]["healed"]:
            assert any(_equal(got, sent) for sent in served), replica
    _close(results[0]["final"]["model"], _reference(history)["model"])


def test_a_killed_replica_is_dropped_and_the_survivors_continue(
    tmp_path: Path, store: dist.TCPStore
) -> None:
    """Replica 2 exits (as a SIGKILL) after its backward in step 1: the survivors'
    reduction fails, they redo it between themselves and train on."""
    cfg = {"replicas": [0, 1, 2], "steps": 4, "die": {2: 1}, "final_members": 2, "timeout": 3.0}
    with RankPool(3, timeout_s=60.0, grace_s=30.0) as pool, pytest.raises(RankError) as info:
        pool.run(_train, store.port, "kill", {**cfg, "report": str(tmp_path)})
    assert info.value.rank == 2 and "exited with code 9" in info.value.remote_traceback
    survivors = [torch.load(tmp_path / f"replica{r}.pt", weights_only=False) for r in (0, 1)]
    expected = [(0, (0, 1, 2))] + [(s, (0, 1)) for s in range(1, 4)]
    for got in survivors:
        assert got["history"] == expected
        assert _equal(got["final"], survivors[0]["final"])
    _close(survivors[0]["final"]["model"], _reference(expected)["model"])
