"""The per-step quorum of data-parallel replicas, agreed on a c10d store.

Every key lives under one prefix of a ``torch.distributed.Store`` (a ``TCPStore`` the
replicas reach over the network). Rounds are numbered 0, 1, 2, ... and decided in
order; a replica takes part in one round per step, plus one per redone reduction::

    round/<r>/arrivals   appended "replica,step,redo,layout;" by each replica that arrives
    round/<r>/decision   the Quorum (JSON), written once with compare_set
    round/<r>/votes      appended "replica,ok;" after the reduction
    round/<r>/verdict    the Verdict (JSON), written once with compare_set
    decided              the number of rounds decided so far (a counter)

Both writes that decide something go through ``compare_set`` on an empty key, so the
first writer wins and every replica reads the same decision: the store's atomic
operations are the consensus, there is no leader to lose. See the package docstring
for the protocol and its rationale.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, cast

from torch._C._distributed_c10d import Store

__all__ = ["Arrival", "Quorum", "QuorumTimeoutError", "Verdict", "join_round", "vote"]

_POLL_S = 0.005


class QuorumTimeoutError(TimeoutError):
    """A round did not close: fewer replicas than the minimum arrived in time."""


@dataclass(frozen=True)
class Arrival:
    """One replica's arrival at a round.

    Attributes:
        replica: the replica id (0, 1, ...; a restarted replica keeps its id).
        step: the replica's committed step count when it arrived.
        redo: True when it arrives to redo the reduction of ``step`` (it holds that
            step's local gradients); False at the start of a step.
        layout: the fingerprint of the replica's layout (a digest: no ``,`` or ``;``);
            default ``""``: not given.
    """

    replica: int
    step: int
    redo: bool
    layout: str = ""


@dataclass(frozen=True)
class Quorum:
    """The decision of one round: who trains this step, and who heals from whom.

    Attributes:
        round: the round number.
        step: the step the members train (the highest committed step among them).
        members: the replica ids, sorted; a replica's rank in the cross-replica
            group is its index here.
        heal: (healer, source) pairs: a member behind ``step`` receives the state of
            the source, a member at ``step``.
        group_round: the round whose store prefix names the cross-replica group: this
            round's when the members changed (or the last reduction failed), else the
            round that created the group still in use.
        layouts: the members' layout fingerprints (:attr:`Arrival.layout`), in the
            order of ``members``; default ``()``: none recorded.
    """

    round: int
    step: int
    members: tuple[int, ...]
    heal: tuple[tuple[int, int], ...]
    group_round: int
    layouts: tuple[str, ...] = ()

    @property
    def same_layout(self) -> bool:
        """Whether every member published the same layout fingerprint (then rank ``j``
        of each member holds the same pieces)."""
        return len(set(self.layouts)) <= 1

    def rank_of(self, replica: int) -> int:
        """The replica's rank in the cross-replica group (its index in ``members``)."""
        return self.members.index(replica)

    def source_of(self, replica: int) -> int | None:
        """The member this replica heals from, or None when it is up to date."""
        return next((src for healer, src in self.heal if healer == replica), None)

    def healers_of(self, replica: int) -> list[int]:
        """The members that heal from this replica."""
        return [healer for healer, src in self.heal if src == replica]


@dataclass(frozen=True)
class Verdict:
    """The outcome of a round's reduction.

    Attributes:
        commit: every member's reduction succeeded: apply the averaged gradients.
        voters: the members that reported in time; after a failed reduction they redo
            it in the next round, the others are dropped from this step.
    """

    commit: bool
    voters: tuple[int, ...]


def _key(prefix: str, round_: int, name: str) -> str:
    return f"{prefix}/round/{round_}/{name}"


def _append(store: Store, key: str, value: str) -> None:
    """``store.append`` (atomic; torch's stub does not declare it)."""
    cast(Any, store).append(key, value)


def _read(store: Store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


def _decide_once(store: Store, key: str, value: str) -> str:
    """Write ``value`` unless someone wrote first; return what the key holds."""
    return bytes(store.compare_set(key, "", value)).decode()


def _arrivals(store: Store, prefix: str, round_: int) -> dict[int, Arrival]:
    text = _read(store, _key(prefix, round_, "arrivals")) or ""
    found: dict[int, Arrival] = {}
    for item in filter(None, text.split(";")):
        replica, step, redo, *layout = item.split(",")
        found[int(replica)] = Arrival(int(replica), int(step), bool(int(redo)), *layout)
    return found


def decided_rounds(store: Store, prefix: str) -> int:
    """The number of rounds decided so far: the round a joiner should arrive at."""
    return int(store.add(f"{prefix}/decided", 0))


def read_quorum(store: Store, prefix: str, round_: int) -> Quorum | None:
    """The decision of ``round_``, or None before it is decided."""
    text = _read(store, _key(prefix, round_, "decision"))
    return None if not text else _decode_quorum(text)


def read_verdict(store: Store, prefix: str, round_: int) -> Verdict | None:
    """The verdict of ``round_``, or None before it is given."""
    text = _read(store, _key(prefix, round_, "verdict"))
    if not text:
        return None
    data = json.loads(text)
    return Verdict(bool(data["commit"]), tuple(data["voters"]))


def _decode_quorum(text: str) -> Quorum:
    data = json.loads(text)
    return Quorum(
        data["round"],
        data["step"],
        tuple(data["members"]),
        tuple((h, s) for h, s in data["heal"]),
        data["group_round"],
        tuple(data.get("layouts", ())),
    )


def _encode_quorum(quorum: Quorum, by: int) -> str:
    """JSON of the decision, with the deciding replica (so a writer knows it won)."""
    return json.dumps(
        {
            "by": by,
            "round": quorum.round,
            "step": quorum.step,
            "members": list(quorum.members),
            "heal": [list(pair) for pair in quorum.heal],
            "group_round": quorum.group_round,
            "layouts": list(quorum.layouts),
        }
    )


def admit(round_: int, arrivals: dict[int, Arrival], previous: Quorum | None) -> Quorum:
    """The quorum of the replicas that arrived (a pure function of the arrivals).

    A round with any redo arrival redoes a step's reduction: only the replicas holding
    that step's gradients (redo arrivals at the highest step) take part, and joiners
    wait for the next round. Otherwise every arrival is a member; those behind the
    highest step heal, each from a member at that step (round-robin over them, in
    id order). The group is reused when the members are the previous round's and that
    round committed (``previous`` is then given with its verdict applied: None when a
    new group is needed).
    """
    redo = [a for a in arrivals.values() if a.redo]
    if redo:
        step = max(a.step for a in redo)
        members = tuple(sorted(a.replica for a in redo if a.step == step))
        heal: tuple[tuple[int, int], ...] = ()
    else:
        step = max(a.step for a in arrivals.values())
        members = tuple(sorted(arrivals))
        sources = [r for r in members if arrivals[r].step == step]
        behind = [r for r in members if arrivals[r].step < step]
        heal = tuple((r, sources[i % len(sources)]) for i, r in enumerate(behind))
    layouts = tuple(arrivals[r].layout for r in members)
    layouts = layouts if any(layouts) else ()  # none given: none recorded
    reuse = (
        previous is not None
        and (previous.members, previous.layouts) == (members, layouts)
        and not heal
    )
    group_round = previous.group_round if reuse and previous is not None else round_
    return Quorum(round_, step, members, heal, group_round, layouts)


@dataclass(frozen=True)
class _Expectation:
    """What round ``r`` needs from round ``r - 1``.

    Attributes:
        members: the replicas it waits for (the previous members that voted); None for
            round 0.
        reusable: the previous quorum when its group may be reused (it committed).
        step: the committed step a member must hold: the previous step, plus one when
            it committed. A round without such a member never closes: replicas behind
            it alone would start a second, diverging line of training.
    """

    members: set[int] | None
    reusable: Quorum | None
    step: int


def _expected(store: Store, prefix: str, round_: int, deadline: float) -> _Expectation:
    """Round ``round_``'s expectation, once round ``round_ - 1`` has its verdict.

    Raises:
        QuorumTimeoutError: no verdict before ``deadline``: every member of the
            previous round is gone, and the state with them.
    """
    if round_ == 0:
        return _Expectation(None, None, 0)
    previous = read_quorum(store, prefix, round_ - 1)
    verdict = read_verdict(store, prefix, round_ - 1)
    while (previous is None or verdict is None) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        previous = read_quorum(store, prefix, round_ - 1)
        verdict = read_verdict(store, prefix, round_ - 1)
    if previous is None or verdict is None:
        raise QuorumTimeoutError(
            f"round {round_ - 1} of {prefix!r} has no verdict: every replica of it is gone, "
            "and the training state with them; restart the job from a checkpoint"
        )
    step = previous.step + int(verdict.commit)
    return _Expectation(set(verdict.voters), previous if verdict.commit else None, step)


def join_round(
    store: Store,
    prefix: str,
    round_: int,
    me: Arrival,
    *,
    min_replicas: int,
    join_timeout_s: float,
    quorum_timeout_s: float,
    initial_replicas: int | None = None,
) -> Quorum:
    """Arrive at ``round_`` and return its decision (which may leave ``me`` out).

    The round closes when every replica it expects has arrived, or ``join_timeout_s``
    after this replica's arrival, provided at least ``min_replicas`` are admitted and
    one of them holds the last committed step (never a quorum of replicas behind it
    only); the first replica to see it closed writes the decision, every other one
    reads it. The first round (0) waits for ``initial_replicas`` arrivals, when given,
    up to ``quorum_timeout_s``.

    Raises:
        QuorumTimeoutError: no decision within ``quorum_timeout_s`` (fewer than
            ``min_replicas`` replicas arrived).
    """
    start = time.monotonic()
    arrival = f"{me.replica},{me.step},{int(me.redo)},{me.layout};"
    _append(store, _key(prefix, round_, "arrivals"), arrival)
    expectation = _expected(store, prefix, round_, start + quorum_timeout_s)
    expected = expectation.members
    # Round 0 with a known size waits for it up to quorum_timeout_s.
    first = expected is None and initial_replicas is not None
    join_wait_s = quorum_timeout_s if first else join_timeout_s
    while True:
        decided = read_quorum(store, prefix, round_)
        if decided is not None:
            return decided
        arrivals = _arrivals(store, prefix, round_)
        candidate = admit(round_, arrivals, expectation.reusable)
        waited = time.monotonic() - start
        if expected is None:
            complete = initial_replicas is not None and len(arrivals) >= initial_replicas
        else:
            complete = expected <= set(arrivals)
        enough = len(candidate.members) >= min_replicas and candidate.step >= expectation.step
        if enough and (complete or waited > join_wait_s):
            mine = _encode_quorum(candidate, me.replica)
            text = _decide_once(store, _key(prefix, round_, "decision"), mine)
            if text == mine:
                store.add(f"{prefix}/decided", 1)
            return _decode_quorum(text)
        if waited > quorum_timeout_s:
            raise QuorumTimeoutError(
                f"round {round_} of {prefix!r}: {len(candidate.members)} replica(s) "
                f"{list(candidate.members)} at step {candidate.step} arrived within "
                f"{quorum_timeout_s:.1f} s; it needs min_replicas={min_replicas} and one "
                f"replica at step {expectation.step}; start more replicas or lower min_replicas"
            )
        time.sleep(_POLL_S)


def vote(store: Store, prefix: str, quorum: Quorum, me: int, ok: bool, timeout_s: float) -> Verdict:
    """Report this member's reduction outcome and return the round's verdict.

    The verdict is a commit when every member reported success; it is written as soon
    as every member voted, or ``timeout_s`` after this vote with the members that voted
    by then (a member that never votes is dropped from the step). The first replica to
    conclude writes it; everyone, a late voter too, reads the same one.
    """
    _append(store, _key(prefix, quorum.round, "votes"), f"{me},{int(ok)};")
    deadline = time.monotonic() + timeout_s
    key = _key(prefix, quorum.round, "verdict")
    while True:
        existing = read_verdict(store, prefix, quorum.round)
        if existing is not None:
            return existing
        text = _read(store, _key(prefix, quorum.round, "votes")) or ""
        votes = dict(
            (int(r), bool(int(v)))
            for r, v in (item.split(",") for item in filter(None, text.split(";")))
        )
        everyone = set(quorum.members) <= set(votes)
        if everyone or time.monotonic() > deadline:
            commit = everyone and all(votes[r] for r in quorum.members)
            voters = sorted(r for r in votes if r in quorum.members)
            _decide_once(store, key, json.dumps({"commit": commit, "voters": voters}))
            verdict = read_verdict(store, prefix, quorum.round)
            assert verdict is not None
            return verdict
        time.sleep(_POLL_S)
