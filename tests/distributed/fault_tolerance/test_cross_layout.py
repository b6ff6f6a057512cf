"""Fault-tolerant replicas of different layouts train together (``layout=``).

Pool ranks {0, 1} form replica 0 and ranks {2, 3} (or rank 2 alone) replica 1; each
replica holds its model copy with its own wrapper (DDP, FSDP over its ranks, or the
plain model on one rank) and passes its pieces (``gradient_pieces``) to its manager,
which reduces in the plain model's index space when the members' layouts differ.
Data: four slots of 3 rows per step; rank ``r`` of a replica of two ranks takes slot
``2 i + r`` (replica ``i``), a replica of one rank takes both of its slots (6 rows),
so every replica averages 6 rows and the average over the replicas is the plain model
on the union batch of every member's slots. The reference: that plain model, 1e-6.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.checkpoint.universal import gradient_pieces, load_universal_states, universal_state
from shardkit.distributed.fault_tolerance import FaultTolerantReplicas
from shardkit.nn import FullyShardedDataParallel
from tests.distributed.fault_tolerance.test_replica_groups import (
    _meet_joiner,
    _model,
    _momentum,
    _sgd,
)
from tests.distributed.fault_tolerance.test_replicas import _equal

_NO_FAILURE_T = 10.0  # never reached
_FAILURE_T = 1.5  # a slow replica waits past it


def _rows(step: int, slots: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for slot in slots:
        generator = torch.Generator().manual_seed(1000 * step + slot)
        xs.append(torch.randn(3, 4, generator=generator))
        ys.append(torch.randn(3, 2, generator=generator))
    return torch.cat(xs), torch.cat(ys)


def _loss(model: nn.Module, step: int, slots: tuple[int, ...]) -> torch.Tensor:
    x, y = _rows(step, slots)
    return nn.functional.mse_loss(model(x), y)


def _reference(steps: list[tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The plain model trained on step ``s``'s rows of ``steps[s]``'s slots."""
    model = _model(0)
    optimizer = _sgd(model.parameters())
    for step, slots in enumerate(steps):
        optimizer.zero_grad()
        _loss(model, step, slots).backward()
        optimizer.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


class _Copy:
    """This rank's copy in replica ``replica`` of ``kind`` "ddp", "fsdp" or "plain"."""

    def __init__(self, kind: str, group: dist.ProcessGroup, replica: int, seed: int) -> None:
        plain = _model(seed)
        self.kind, self.group = kind, group
        if kind == "ddp":
            self.model: nn.Module = nn.parallel.DistributedDataParallel(plain, process_group=group)
        elif kind == "fsdp":
            self.model = FullyShardedDataParallel(plain, process_group=group)
        else:
            self.model = plain
        self.optimizer = _sgd(self.model.parameters())
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.slots = (2 * replica + rank,) if size == 2 else (2 * replica, 2 * replica + 1)

    def manager(self, store: dist.Store, replica: int, **kwargs: Any) -> FaultTolerantReplicas:
        """This copy's manager, its layout given (``gradient_pieces``)."""
        plain = self.kind == "plain"

        def state() -> dict[str, Any]:
            return universal_state(self.model, self.optimizer, step=ft.step, group=self.group)

        def load(parts: list[Any]) -> None:
            load_universal_states(parts, self.model, self.optimizer, group=self.group)

        ft = FaultTolerantReplicas(
            store,
            replica,
            state_dict=state,
            load_state_dict=load,
            quorum_timeout_s=30.0,
            group=None if plain else self.group,
            layout=functools.partial(gradient_pieces, self.model, self.optimizer, group=self.group),
            **kwargs,
        )
        return ft

    def train_step(self, ft: FaultTolerantReplicas) -> bool:
        self.optimizer.zero_grad()
        _loss(self.model, ft.step, self.slots).backward()
        if not ft.average_gradients(self.model.parameters()):
            return False
        self.optimizer.step()
        return True

    def full_model(self) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        return {k.removeprefix("module."): v.clone() for k, v in state.items()}


def _groups(second: str) -> tuple[int, dist.ProcessGroup] | None:
    """This rank's replica and group: {0, 1} and {2, 3} (``second`` of two ranks), or
    {0, 1} and {2} (``second`` "plain"; rank 3 idle: None)."""
    me = dist.get_rank()
    pair, other, singles = (
        dist.new_group([0, 1]),
        dist.new_group([2, 3]),
        [dist.new_group([r]) for r in range(4)],
    )
    if me < 2:
        return 0, pair
    if second != "plain":
        return 1, other
    return (1, singles[2]) if me == 2 else None


def _together(port: int, prefix: str, kinds: tuple[str, str], steps: int) -> dict[str, Any]:
    """Replicas of ``kinds`` launched together train ``steps`` steps without a failure."""
    placed = _groups(kinds[1])
    if placed is None:
        return {}
    replica, group = placed
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    rep = _Copy(kinds[replica], group, replica, 0)
    ft = rep.manager(store, replica, timeout_s=_NO_FAILURE_T, initial_replicas=2, prefix=prefix)
    same: list[bool] = []
    while ft.step < steps:
        quorum = ft.start_step()
        same.append(quorum.same_layout)
        assert rep.train_step(ft)
    return {"model": rep.full_model(), "same": same, "digest": ft.layout_digest}


def _joiner(port: int, prefix: str, fsdp_serves: bool) -> dict[str, Any]:
    """FSDP over {0, 1} and the plain model on rank 2: the one that serves trains 2
    steps alone, the other joins, heals through universal-checkpoint parts, and both
    train 2 steps together."""
    placed = _groups("plain")
    if placed is None:
        return {}
    replica_of_rank, group = placed
    fsdp = replica_of_rank == 0
    serves = fsdp == fsdp_serves
    replica = 0 if serves else 1
    rep = _Copy("fsdp" if fsdp else "plain", group, replica_of_rank, 0 if serves else 7)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    ft = rep.manager(store, replica, timeout_s=_NO_FAILURE_T, initial_replicas=1, prefix=prefix)
    if serves:
        for _ in range(2):
            ft.start_step()
            assert rep.train_step(ft)
    _meet_joiner(store, prefix, serves)
    quorum = ft.start_step()
    assert quorum.members == (0, 1) and quorum.heal == ((1, 0),), quorum
    assert not quorum.same_layout
    healed = {
        "model": rep.full_model(),
        "momentum": _momentum(rep.model, rep.optimizer, group),
        "step": ft.step,
    }
    assert rep.train_step(ft)
    ft.start_step()
    assert rep.train_step(ft)
    return {"healed": healed, "serves": serves, "model": rep.full_model(), "step": ft.step}


def _slots(replica: int) -> tuple[int, ...]:
    return (2 * replica, 2 * replica + 1)


def _slow(port: int, prefix: str, slow: int, steps: int) -> dict[str, Any]:
    """FSDP over {0, 1} (replica 0) and the plain model on rank 2 and on rank 3
    (replicas 1, 2); replica ``slow`` misses step 1's reduction: the others redo it
    (across layouts, or on the fast path when the survivors share a layout), it is
    dropped, rebuilt with other weights, heals and rejoins."""
    me = dist.get_rank()
    pair, singles = dist.new_group([0, 1]), [dist.new_group([r]) for r in range(4)]
    replica, group, kind = (0, pair, "fsdp") if me < 2 else (me - 1, singles[me], "plain")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))

    def build(seed: int) -> tuple[_Copy, FaultTolerantReplicas]:
        rep = _Copy(kind, group, replica, seed)
        return rep, rep.manager(
            store, replica, timeout_s=_FAILURE_T, initial_replicas=3, prefix=prefix
        )

    rep, ft = build(0)
    commits: list[tuple[int, tuple[int, ...]]] = []
    slow_at = 1 if replica == slow else None
    while ft.step < steps or ft.num_members < 3:
        ft.start_step()
        rep.optimizer.zero_grad()
        _loss(rep.model, ft.step, rep.slots).backward()
        if slow_at == ft.step:  # the whole replica wakes after the others gave up
            slow_at = None
            assert ft.quorum is not None
            store.wait([f"{prefix}/round/{ft.quorum.round}/verdict"])
        step = ft.step
        if ft.average_gradients(rep.model.parameters()):
            rep.optimizer.step()
            assert ft.quorum is not None
            commits.append((step, ft.quorum.members))
        else:
            rep, ft = build(100 + step)
    return {"commits": commits, "model": rep.full_model(), "step": ft.step}


def _scenarios(port: int) -> dict[str, Any]:
    """Every scenario in one spawned group (the same on every rank)."""
    out = {
        "fsdp-plain": _together(port, "fsdp-plain", ("fsdp", "plain"), 3),
        "ddp-fsdp": _together(port, "ddp-fsdp", ("ddp", "fsdp"), 3),
        "fsdp-fsdp": _together(port, "fsdp-fsdp", ("fsdp", "fsdp"), 1),
        "join-fsdp-serves": _joiner(port, "join-a", fsdp_serves=True),
        "join-plain-serves": _joiner(port, "join-b", fsdp_serves=False),
        "slow-fsdp": _slow(port, "slow-fsdp", 0, 3),
        "slow-plain": _slow(port, "slow-plain", 2, 3),
    }
    return out


def test_replicas_of_different_layouts_train_together_and_a_joiner_heals_into_lockstep(
    rank_pool: Any, store: dist.TCPStore
) -> None:
    results = rank_pool(4).run(_scenarios, store.port, timeout_s=120)
    union = _reference([(0, 1, 2, 3)] * 3)
    # (a) FSDP over 2 ranks + the plain model on 1 rank; and the regression: DDP and
    # FSDP over 2 ranks each (as many ranks, other pieces at rank j) never pair rank j
    for name, ranks in (("fsdp-plain", (0, 1, 2)), ("ddp-fsdp", (0, 1, 2, 3))):
        for rank in ranks:
            got = results[rank][name]
            assert got["same"] == [False] * 3, (name, rank)
            assert _close(got["model"], union), (name, rank)
    # equal layouts take the fast path
    assert results[0]["fsdp-fsdp"]["digest"] == results[2]["fsdp-fsdp"]["digest"]
    assert all(results[r]["fsdp-fsdp"]["same"] == [True] for r in range(4))
    # (b) a joiner of another layout holds its peer's state exactly after healing, then
    # trains in lockstep: the plain model on the server's slots, then on the union
    for name in ("join-fsdp-serves", "join-plain-serves"):
        got = [results[rank][name] for rank in range(3)]
        source = next(g for g in got if g["serves"])
        server_slots = (0, 1) if name == "join-fsdp-serves" else (2, 3)
        reference = _reference([server_slots] * 2 + [(0, 1, 2, 3)] * 2)
        for g in got:
            assert g["healed"]["step"] == 2 and g["step"] == 4, name
            assert _equal(g["healed"]["model"], source["healed"]["model"]), name
            assert torch.equal(g["healed"]["momentum"], source["healed"]["momentum"]), name
            assert _close(g["model"], reference), name
    # a member failing during the reduction: the survivors redo it without it (across
    # layouts; on the fast path when FSDP is the one missing), it heals and rejoins
    for name, slow in (("slow-fsdp", 0), ("slow-plain", 2)):
        runs = [results[rank][name] for rank in range(4)]
        job = {step: members for r in runs for step, members in r["commits"]}
        assert all(job[s] == m for r in runs for s, m in r["commits"]), name
        history = sorted(job.items())
        assert [s for s, _ in history] == list(range(len(history))), (name, history)
        assert slow not in history[1][1] and history[-1][1] == (0, 1, 2), (name, history)
        slots = [tuple(x for r in members for x in _slots(r)) for _, members in history]
        reference = _reference(slots)
        for rank in range(4):
            assert runs[rank]["step"] == len(history), (name, rank)
            assert _close(runs[rank]["model"], reference), (name, rank)
