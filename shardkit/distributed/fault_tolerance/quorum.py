"""The per-step quorum of data-parallel replicas, agreed on a c10d store.

Every key lives under one prefix of a ``torch.distributed.Store`` (a ``TCPStore`` the
replicas reach over the network). Rounds are numbered 0, 1, 2, ... and decided in
order; a replica takes part in one round per step, plus one per redone reduction::

    round/<r>/arrivals   appended "replica,step,redo,layout,batch;" by each replica that arrives
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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from torch._C._distributed_c10d import Store

__all__ = [
    "Arrival",
    "Quorum",
    "QuorumTimeoutError",
    "ReplicaMismatchError",
    "Verdict",
    "admit",
    "batch_text",
    "join_round",
    "pairs_with",
    "refusal",
    "vote",
]

_POLL_S = 0.005


class QuorumTimeoutError(TimeoutError):
    """A round did not close: fewer replicas than the minimum arrived in time."""


class ReplicaMismatchError(ValueError):
    """A quorum refused this replica: it cannot train with the members (another batch
    schedule, or a layout that does not pair with the members'; see :func:`pairs_with`)."""


@dataclass(frozen=True)
class Arrival:
    """One replica's arrival at a round.

    Attributes:
        replica: the replica id (0, 1, ...; a restarted replica keeps its id).
        step: the replica's committed step count when it arrived.
        redo: True when it arrives to redo the reduction of ``step`` (it holds that
            step's local gradients); False at the start of a step.
        layout: the fingerprint of the replica's layout (a digest: no ``,`` or ``;``):
            ``L<hash>`` for a published layout, ``n<ranks>`` for a replica of that many
            ranks that gave none; default ``""``: not given (treated as ``n1``).
        batch: the replica's batch schedule (:func:`batch_text`, e.g.
            ``"global_batch=16 max_replicas=2"``); default ``""``: not given. Replicas
            of different schedules never train together.
    """

    replica: int
    step: int
    redo: bool
    layout: str = ""
    batch: str = ""


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
        batch: the members' batch schedule (:attr:`Arrival.batch`); default ``""``.
        refused: the replicas that arrived but cannot train with the members (see
            :func:`admit`), sorted; each raises :class:`ReplicaMismatchError`.
            Default ``()``.
    """

    round: int
    step: int
    members: tuple[int, ...]
    heal: tuple[tuple[int, int], ...]
    group_round: int
    layouts: tuple[str, ...] = ()
    batch: str = ""
    refused: tuple[int, ...] = ()

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
        replica, step, redo, *rest = item.split(",")
        found[int(replica)] = Arrival(int(replica), int(step), bool(int(redo)), *rest)
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
        data.get("batch", ""),
        tuple(data.get("refused", ())),
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
            "batch": quorum.batch,
            "refused": list(quorum.refused),
        }
    )


def batch_text(batch: Mapping[str, int] | None) -> str:
    """A batch schedule as the arrivals carry it: ``"key=value"`` items in key order,
    space-separated (``""`` for None).

    Raises:
        ValueError: a key is not an identifier, or a value not an integer.
    """
    if batch is None:
        return ""
    bad = {k: v for k, v in batch.items() if not k.isidentifier() or type(v) is not int}
    if bad:
        raise ValueError(
            f"batch schedule {dict(batch)}: {bad} are not identifier=integer items; "
            "give e.g. {'global_batch': 64, 'max_replicas': 2}"
        )
    return " ".join(f"{k}={batch[k]}" for k in sorted(batch))


def pairs_with(a: Arrival, b: Arrival) -> bool:
    """Whether replicas ``a`` and ``b`` may train in one quorum.

    They need the same batch schedule (else their gradients average different batch
    semantics, and they consume the data differently), and layouts that pair: both
    published (``L...``: the same pieces at rank ``j``, or a reduction in the plain
    model's index space), or both replicas of one process without a layout (``n1``:
    each holds the whole model and passes its parameters in the same order). A
    replica of several ranks without a layout (``n<ranks>``) pairs with no other: what
    its rank ``j`` holds is unknown (a DDP and an FSDP replica of as many ranks would
    pair different pieces at rank ``j``).
    """
    if a.batch != b.batch:
        return False
    if a.layout.startswith("L") and b.layout.startswith("L"):
        return True
    return (a.layout or "n1") == (b.layout or "n1") == "n1"


def _admissible(
    arrivals: dict[int, Arrival], last: Quorum | None
) -> tuple[dict[int, Arrival], tuple[int, ...]]:
    """The arrivals that may train together, and the refused ones (sorted).

    After round 0, a member of ``last`` (the previous round's decision) arriving as it
    was is admitted, and any other arrival must pair with every member of ``last``
    (their batch schedule and layouts); in arrival order, each arrival must also pair
    with those admitted before it: of two that do not pair, the later is refused.
    """
    references: dict[int, Arrival] = {}
    if last is not None:
        layouts = last.layouts or ("",) * len(last.members)
        for replica, layout in zip(last.members, layouts, strict=True):
            references[replica] = Arrival(replica, last.step, False, layout, last.batch)
    admitted: dict[int, Arrival] = {}
    for replica, arrival in arrivals.items():  # in arrival order
        known = references.get(replica)
        if known is not None and (known.layout, known.batch) == (arrival.layout, arrival.batch):
            admitted[replica] = arrival
            continue
        others = [a for a in (*references.values(), *admitted.values()) if a.replica != replica]
        if all(pairs_with(arrival, other) for other in others):
            admitted[replica] = arrival
    return admitted, tuple(sorted(set(arrivals) - set(admitted)))


def admit(
    round_: int,
    arrivals: dict[int, Arrival],
    previous: Quorum | None,
    last: Quorum | None = None,
) -> Quorum:
    """The quorum of the replicas that arrived (a pure function of the arrivals).

    Arrivals that cannot train with the others are refused first (:func:`pairs_with`:
    one that does not pair with ``last``, the previous round's decision, or with a
    replica that arrived before it). A round with any redo arrival redoes a step's
    reduction: only the replicas holding that step's gradients (redo arrivals at the
    highest step) take part, and joiners wait for the next round. Otherwise every
    admitted arrival is a member; those behind the highest step heal, each from a
    member at that step (round-robin over them, in id order). The group is reused when
    the members are the previous round's and that round committed (``previous`` is
    then given with its verdict applied: None when a new group is needed).
    """
    arrivals, refused = _admissible(arrivals, last)
    if not arrivals:  # only refused ones: no quorum yet
        return Quorum(round_, 0, (), (), round_, refused=refused)
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
    batch = arrivals[members[0]].batch
    return Quorum(round_, step, members, heal, group_round, layouts, batch, refused)


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
        last: the previous round's decision (its members set the batch schedule and
            layouts an arrival must pair with); None for round 0.
    """

    members: set[int] | None
    reusable: Quorum | None
    step: int
    last: Quorum | None = None


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
    reusable = previous if verdict.commit else None
    return _Expectation(set(verdict.voters), reusable, step, previous)


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
    only); arrivals that cannot train with the others are refused (:func:`admit`,
    listed in :attr:`Quorum.refused`). The first replica to see it closed writes the
    decision, every other one reads it. The first round (0) waits for
    ``initial_replicas`` arrivals, when given, up to ``quorum_timeout_s``.

    Raises:
        QuorumTimeoutError: no decision within ``quorum_timeout_s`` (fewer than
            ``min_replicas`` replicas arrived).
    """
    start = time.monotonic()
    arrival = f"{me.replica},{me.step},{int(me.redo)},{me.layout},{me.batch};"
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
        candidate = admit(round_, arrivals, expectation.reusable, expectation.last)
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


def refusal(quorum: Quorum, me: Arrival) -> str:
    """Why ``quorum`` refused ``me`` (listed in :attr:`Quorum.refused`): both values
    and the fix."""
    head = (
        f"replica {me.replica} was refused by round {quorum.round} (members {list(quorum.members)})"
    )
    if me.batch != quorum.batch:
        return (
            f"{head}: its batch schedule is {me.batch or '(not given)'!r}, the members train "
            f"with {quorum.batch or '(not given)'!r}; their gradients would average different "
            "batches and the replicas would consume the data differently: give every replica "
            "the same batch schedule"
        )
    return (
        f"{head}: its layout {me.layout or 'n1'!r} does not pair with the members' "
        f"{list(quorum.layouts) or ['n1']}: a replica without layout= is known by its number "
        "of ranks only (n<ranks>); it pairs only with replicas of one process that gave none "
        "either (n1), never when it has several ranks (rank j of another wrapper holds other "
        "pieces); pass layout= (shardkit.checkpoint.universal.gradient_pieces) on every replica"
    )
