"""The quorum's decisions, in one process on a HashStore (the store's atomic operations
decide; the replicas' arrival order does not change what is decided), and managers of
one-process replicas in threads of this process (refusals, the groups' lifetime)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.fault_tolerance import FaultTolerantReplicas
from shardkit.distributed.fault_tolerance.quorum import (
    Arrival,
    Quorum,
    QuorumTimeoutError,
    ReplicaMismatchError,
    admit,
    join_round,
    read_quorum,
    vote,
)


def _arrivals(*items: tuple[int, int, bool]) -> dict[int, Arrival]:
    return {r: Arrival(r, s, redo) for r, s, redo in items}


def test_admit_heals_the_replicas_behind_and_reuses_the_group() -> None:
    previous = Quorum(4, 7, (0, 2), (), group_round=3)
    same = admit(5, _arrivals((0, 8, False), (2, 8, False)), previous)
    assert same == Quorum(5, 8, (0, 2), (), group_round=3)
    # two joiners (a restart at step 0, a dropped one at 7) heal round-robin from 0 and 2
    grown = admit(
        5, _arrivals((2, 8, False), (0, 8, False), (3, 0, False), (1, 7, False)), previous
    )
    assert grown == Quorum(5, 8, (0, 1, 2, 3), ((1, 0), (3, 2)), group_round=5)
    assert grown.source_of(3) == 2 and grown.source_of(0) is None and grown.healers_of(0) == [1]
    # after a failed reduction nothing is reused (previous is None)
    assert admit(6, _arrivals((0, 8, False), (2, 8, False)), None).group_round == 6


def test_a_redo_round_admits_only_the_replicas_holding_that_steps_gradients() -> None:
    quorum = admit(9, _arrivals((1, 4, False), (0, 5, True), (2, 5, True), (3, 4, True)), None)
    assert quorum == Quorum(9, 5, (0, 2), (), group_round=9)


def _join(store: dist.Store, round_: int, me: Arrival, out: dict[int, Quorum], **kw: float) -> None:
    out[me.replica] = join_round(
        store,
        "p",
        round_,
        me,
        min_replicas=1,
        join_timeout_s=kw.get("join", 5.0),
        quorum_timeout_s=10.0,
        initial_replicas=int(kw.get("initial", 3)),
    )


def test_rounds_close_on_the_expected_members_and_verdicts_agree() -> None:
    store = dist.HashStore()
    out: dict[int, Quorum] = {}
    threads = [
        threading.Thread(target=_join, args=(store, 0, Arrival(r, 0, False), out)) for r in range(3)
    ]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert {r: q.members for r, q in out.items()} == {r: (0, 1, 2) for r in range(3)}
    first = out[0]
    # replica 1 fails its reduction, replica 2 never votes: redo with 0 and 1
    verdicts: dict[int, object] = {}
    voters = [
        threading.Thread(
            target=lambda r=r, ok=ok: verdicts.update({r: vote(store, "p", first, r, ok, 0.3)})
        )
        for r, ok in ((0, True), (1, False))
    ]
    [t.start() for t in voters]
    [t.join() for t in voters]
    assert verdicts[0] == verdicts[1] and not verdicts[0].commit and verdicts[0].voters == (0, 1)
    assert vote(store, "p", first, 2, True, 0.3) == verdicts[0]  # a late voter reads it
    # round 1 expects the voters only: it closes at once with the redo arrivals
    out.clear()
    threads = [
        threading.Thread(
            target=_join, args=(store, 1, Arrival(r, 0, True), out), kwargs={"join": 60.0}
        )
        for r in (0, 1)
    ]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert out[0] == out[1] == Quorum(1, 0, (0, 1), (), group_round=1)


def test_too_few_replicas_time_out_with_the_numbers() -> None:
    store = dist.HashStore()
    with pytest.raises(
        QuorumTimeoutError, match=r"1 replica\(s\) \[0\] at step 0 .* min_replicas=2"
    ):
        join_round(
            store,
            "p",
            0,
            Arrival(0, 0, False),
            min_replicas=2,
            join_timeout_s=0.05,
            quorum_timeout_s=0.2,
        )


def test_replicas_behind_never_form_a_quorum_of_their_own() -> None:
    """Regression: replica 1 alone committed step 1 in round 0; replica 0 (a late
    starter, step 0) arrived at round 1 and, after the join timeout, closed it alone at
    step 0 while replica 1 was still between steps: two lines of training, merged
    later at equal step counts with different weights. Now round 1 waits for a replica
    at step 1, and replica 0 heals from it."""
    store = dist.HashStore()
    out: dict[int, Quorum] = {}
    _join(store, 0, Arrival(1, 0, False), out, initial=1)
    assert vote(store, "p", out[1], 1, True, 1.0).commit
    late = threading.Thread(
        target=_join, args=(store, 1, Arrival(0, 0, False), out), kwargs={"join": 0.05}
    )
    late.start()
    late.join(timeout=0.5)
    assert late.is_alive() and read_quorum(store, "p", 1) is None  # still waiting
    _join(store, 1, Arrival(1, 1, False), out, join=0.05)
    late.join()
    assert out[0] == out[1] == Quorum(1, 1, (0, 1), ((0, 1),), group_round=1)


_SMALL, _LARGE = {"global_batch": 8, "max_replicas": 2}, {"global_batch": 16, "max_replicas": 2}


def test_admit_refuses_the_later_replica_of_another_batch_schedule() -> None:
    small, large = "global_batch=8 max_replicas=2", "global_batch=16 max_replicas=2"
    first = admit(
        0, {0: Arrival(0, 0, False, "n1", small), 1: Arrival(1, 0, False, "n1", large)}, None
    )
    assert first == Quorum(0, 0, (0,), (), 0, ("n1",), small, refused=(1,))
    # after round 0 the members' schedule holds, whoever arrives first
    later = {1: Arrival(1, 0, False, "n1", large), 0: Arrival(0, 1, False, "n1", small)}
    assert admit(1, later, first, first) == Quorum(1, 1, (0,), (), 0, ("n1",), small, (1,))
    assert admit(1, {1: later[1]}, first, first).members == ()  # no quorum of refused ones


def test_replicas_without_a_layout_pair_only_as_single_processes() -> None:
    """Regression: a replica without layout= was known by its number of ranks only, so a
    DDP and an FSDP replica of two ranks each (both "n2") paired different pieces at
    rank j. Now a replica of several ranks without a layout pairs with no other (the
    later is refused); replicas of one process without one pair with each other; a
    replica with a layout pairs only with replicas with one."""

    def members(*layouts: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        quorum = admit(0, {r: Arrival(r, 0, False, x) for r, x in enumerate(layouts)}, None)
        return quorum.members, quorum.refused

    assert members("n2", "n2") == ((0,), (1,))
    assert members("n1", "n2", "n1") == ((0, 2), (1,))
    assert members("La", "Lb", "n1") == ((0, 1), (2,))
    assert members("n1", "La") == ((0,), (1,))
    # after round 0: a lone replica of two ranks keeps its place, any other is refused
    alone = admit(0, {0: Arrival(0, 0, False, "n2")}, None)
    later = {1: Arrival(1, 0, False, "n2"), 0: Arrival(0, 1, False, "n2")}
    assert admit(1, later, alone, alone) == Quorum(1, 1, (0,), (), 0, ("n2",), refused=(1,))


def _manager(
    store: dist.Store, replica: int, batch: dict[str, int] | None = None, prefix: str = "b"
) -> FaultTolerantReplicas:
    return FaultTolerantReplicas(
        store,
        replica,
        state_dict=dict,
        load_state_dict=lambda parts: None,
        timeout_s=5.0,
        join_timeout_s=0.2,
        quorum_timeout_s=10.0,
        initial_replicas=2,
        prefix=prefix,
        batch=batch,
    )


def _arrived(store: dist.Store, round_: int, replica: int) -> None:
    key = f"b/round/{round_}/arrivals"
    while not (store.check([key]) and f"{replica}," in store.get(key).decode()):
        time.sleep(0.005)


def _train_step(ft: FaultTolerantReplicas, model: nn.Linear, value: float) -> bool:
    """One step of replica ``ft`` with gradient ``value`` everywhere; the average
    must be exactly it (the replica trains alone)."""
    ft.start_step()
    model.weight.grad = torch.full_like(model.weight, value)
    ok = ft.average_gradients(model.parameters())
    assert torch.equal(model.weight.grad, torch.full_like(model.weight, value))
    return ok


def test_a_replica_of_another_batch_schedule_is_refused_and_the_member_goes_on() -> None:
    """Regression: replicas launched with different global batches averaged gradients of
    different batch semantics (and split the data differently) unchecked; a joiner's was
    checked only at the heal, by the main job. Now the quorum refuses the later replica
    (at round 0) or the joiner, naming both schedules; the member trains on alone."""
    store = dist.HashStore()
    model = nn.Linear(3, 1, bias=False)
    member = _manager(store, 0, _SMALL)
    first = threading.Thread(target=lambda: _train_step(member, model, 1.0))
    first.start()
    _arrived(store, 0, 0)  # replica 0 arrived first: replica 1 is the later one
    with pytest.raises(ReplicaMismatchError) as info:
        _manager(store, 1, _LARGE).start_step()
    first.join()
    message = str(info.value)
    assert "'global_batch=16 max_replicas=2'" in message, message
    assert "'global_batch=8 max_replicas=2'" in message, message
    assert member.step == 1 and member.stats.contributors == [1]
    # a joiner split over 4 replica ids is refused at a later round; the member goes on
    stop = threading.Event()

    def train_on() -> None:
        while not stop.is_set() or member.step < 3:
            assert _train_step(member, model, 2.0)
            time.sleep(0.02)

    trainer = threading.Thread(target=train_on)
    trainer.start()
    joiner = _manager(store, 1, {"global_batch": 8, "max_replicas": 4})
    with pytest.raises(ReplicaMismatchError, match="'global_batch=8 max_replicas=4'"):
        joiner.start_step()
    stop.set()
    trainer.join()
    assert member.step >= 3 and set(member.stats.contributors) == {1}


def _threads() -> int:
    """This process's threads (Python's and C++'s, gloo's included)."""
    return len(os.listdir("/proc/self/task"))


def test_groups_are_destroyed_when_replaced_and_at_close() -> None:
    """Regression: the last cross-replica group outlived training (destroyed by the
    cycle collector at any point, or during the interpreter's exit with its gloo
    threads running; a survivor aborted at exit once in five runs), and a member left
    alone kept its old group. Now the group's threads end when a quorum no longer uses
    it and at close()."""
    store = dist.HashStore()
    replicas = [_manager(store, r, prefix="g") for r in (0, 1)]
    models = [nn.Linear(3, 1, bias=False) for _ in replicas]
    baseline = _threads()
    together = [
        threading.Thread(target=_train_step, args=(ft, model, 0.5))
        for ft, model in zip(replicas, models, strict=True)
    ]
    [t.start() for t in together]
    [t.join() for t in together]
    assert _threads() > baseline  # the two members' gloo group, threads running
    assert replicas[0].stats.contributors == [2]
    replicas[1].close()
    replicas[1].close()  # idempotent
    assert _train_step(replicas[0], models[0], 1.5)  # alone after the join timeout
    assert replicas[0].stats.contributors == [2, 1]
    assert _threads() == baseline  # its old group is gone too
    with replicas[0]:  # a context manager closes
        assert _train_step(replicas[0], models[0], 2.5)
    assert _threads() == baseline
