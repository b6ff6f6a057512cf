"""FaultTolerantReplicas: one data-parallel replica's side of the per-step quorum.

A replica is one model copy: one process, or the ranks of a process group that hold
the copy between them (sharded inside: OSS, ShardedDataParallel, FSDP). Each step it
arrives at a quorum (:mod:`~shardkit.distributed.fault_tolerance.quorum`), heals from
a live member if it is behind, computes its gradients, and averages them over the
quorum's members with :meth:`FaultTolerantReplicas.average_gradients`, which redoes
the reduction with the survivors when a member fails, so every survivor applies the
same average.

Why this module is long: one class, one replica's side of the per-step protocol
(arrival, healing, reduction on either path, vote, redo), whose phases share its
state; the layouts' arithmetic is in :mod:`.layouts`, the quorum's in :mod:`.quorum`.

[Note: a replica of several ranks]
When every member published the same layout fingerprint (:mod:`.layouts`; the same
wrapper over the same number of ranks), rank ``j`` of a replica holds the same piece of
the state in every replica, so the cross-replica reduction is one group per local
rank: rank ``j`` of every member, keyed ``group/<j>`` under the round's prefix (the fast
path). Otherwise the members reduce in the plain model's index space over one group of
every rank of every member, keyed ``layout-group`` (see [Note: the reduction in the
plain model's index space] in :mod:`.layouts`). A replica of several ranks without
``layout=`` pairs with no other (what its rank ``j`` holds is unknown): the quorum
refuses the later one (:func:`~.quorum.pairs_with`). The replica's rank 0 alone speaks for
it on the store (arrival, vote) and hands each decision to the other ranks with a broadcast over the replica's group; whether the replica's
reduction or healing succeeded is the minimum over its ranks (an all-reduce), so the
ranks of a replica always take the same branch. A rank of the replica that dies
breaks the replica's own collectives: the whole replica fails and restarts (its
launcher's job), the other replicas drop it like a dead process.

[Note: the groups' lifetime]
A cross-replica group is a ``ProcessGroupGloo`` (:mod:`.transport`) with worker
threads, the transport's loop thread and one connection per peer, held by this
manager alone. It is destroyed (threads joined, connections closed) by dropping that
reference, which happens at named points only: when a quorum needs a new group, when a
reduction fails, when the replica is dropped from a step, and at :meth:`close` (gloo's
``shutdown`` does nothing in torch 2.13, so the reference is the handle). Without
:meth:`close`, the last group outlived training: a manager whose ``state_dict``
closure reads ``ft.step`` (the main job's) sits in a reference cycle, so the group was
destroyed by the cycle collector at an arbitrary point, or during the interpreter's
finalization while its threads still ran, or never. A healing group lives for one
transfer.

[Note: healing across layouts]
Healing sends every rank's part of the source's state to every rank of the healer
(``heal/<healer>/<source rank>/<healer rank>``, two-member groups, in that order), and
each replica publishes its number of ranks (``size/<replica>``), so the healer may hold
its copy in another layout: with parts of a universal checkpoint
(``shardkit.checkpoint.universal.universal_state`` /
``load_universal_states``), each healer rank reads the pieces its layout needs by
their shard descriptors. Each healer rank receives the whole state (the source's parts),
as when every rank reads a whole checkpoint. With ``layout=`` given on every replica, the
healer then trains in lockstep with its source through the cross-layout reduction.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from shardkit.distributed.fault_tolerance.layouts import (
    LayoutFn,
    LayoutPiece,
    PublishedLayouts,
    fingerprint,
    trainable,
)
from shardkit.distributed.fault_tolerance.quorum import (
    Arrival,
    Quorum,
    ReplicaMismatchError,
    Verdict,
    batch_text,
    decided_rounds,
    join_round,
    refusal,
    vote,
)
from shardkit.distributed.fault_tolerance.transport import (
    GlooGroup,
    Store,
    gloo_group,
    recv_state,
    send_state,
)

__all__ = ["FaultTolerantReplicas", "ReplicaState", "ReplicaStats"]

_LOG = logging.getLogger(__name__)

StateDictFn = Callable[[], Mapping[str, Any]]
LoadStateDictFn = Callable[[list[Mapping[str, Any]]], None]


class ReplicaState(Enum):
    """Where a replica is in its step.

    - ``JOINING``: not a member of a quorum; the next :meth:`start_step` arrives at the
      next undecided round (a new or restarted replica, or one dropped from a step).
    - ``MEMBER``: in this step's quorum with the step's state; computing gradients.
    - ``FAILED``: in this step's quorum, but its healing transfer failed: it reports a
      failed reduction and becomes ``JOINING``.
    """

    JOINING = "joining"
    MEMBER = "member"
    FAILED = "failed"


@dataclass
class ReplicaStats:
    """What this replica saw, for logs and benchmarks.

    Attributes:
        redone_reductions: reductions redone with fewer members after a failure.
        dropped_steps: steps this replica was dropped from (it healed afterwards).
        healed: states received from a peer; ``healed_bytes``: their total size.
        served: states sent to joiners; ``served_bytes``: their total size.
        contributors: per committed step, the number of replicas averaged.
        heal_s: seconds spent receiving states.
    """

    redone_reductions: int = 0
    dropped_steps: int = 0
    healed: int = 0
    healed_bytes: int = 0
    served: int = 0
    served_bytes: int = 0
    heal_s: float = 0.0
    contributors: list[int] = field(default_factory=list)


class FaultTolerantReplicas:
    """Average gradients over whichever data-parallel replicas are alive, step by step.

    Example::

        store = torch.distributed.TCPStore(host, port, is_master=False)
        ft = FaultTolerantReplicas(store, replica_id, state_dict=get_state,
                                   load_state_dict=set_state, min_replicas=1)
        while ft.step < steps:
            ft.start_step()                       # quorum; a joiner heals here
            loss_fn(model(batch(ft.step, ft.replica_id))).backward()
            if ft.average_gradients(model.parameters()):
                optimizer.step()                  # every member applies the same average
            optimizer.zero_grad()

    Args:
        store: the c10d store every replica reaches (a ``TCPStore``); it must outlive
            the replicas (see the package docstring).
        replica_id: this replica's id, ``>= 0``; a restarted replica reuses its id.
        state_dict: returns this rank's part of the state a joiner needs (a picklable
            tree of tensors and plain data: the model's and optimizer's
            ``state_dict()``, or a universal checkpoint's part,
            ``shardkit.checkpoint.universal.universal_state``, for a joiner of another
            layout); the step count is added by the manager. Called on every rank of
            a replica that serves, together (it may be a collective over ``group``).
        load_state_dict: given the parts of every rank of the serving replica (a list
            in its rank order; one item for a replica of one process), loads them into
            this rank (``shardkit.checkpoint.universal.load_universal_states`` for
            universal parts). Called on every rank of the healing replica, together.
        min_replicas: replicas a quorum needs to close; default 1.
        timeout_s: a collective's timeout and the window for the members' votes, in
            seconds; default 10.
        join_timeout_s: how long a quorum waits for the previous members before closing
            without them, in seconds; default ``timeout_s``.
        quorum_timeout_s: how long :meth:`start_step` waits for ``min_replicas`` before
            raising, in seconds; default 300.
        initial_replicas: the replicas launched together: the first quorum closes as
            soon as this many arrived; default None (after ``join_timeout_s``).
        prefix: the store prefix of this job's keys; default ``"shardkit-ft"``.
        group: the process group of this replica's ranks, which hold one model copy
            between them (e.g. the world of the replica's own ``torchrun``); every rank
            of the replica builds its manager and calls its methods. Default None: a
            replica of one process (no collectives inside it). See [Note: a replica of
            several ranks].
        layout: returns this rank's pieces of the trainable parameters as the universal
            checkpoint lists them
            (``functools.partial(shardkit.checkpoint.universal.gradient_pieces, model,
            optimizer, group=group)``); called here (a collective over ``group``) and at
            each reduction between replicas of different layouts. With it, replicas of
            another strategy or number of ranks train together. Default None: the
            layout is known by its number of ranks only: a replica of one process
            trains with other such replicas (each passes the whole model's parameters,
            in the same order), a replica of several ranks with no other (the quorum
            refuses the later one, see :func:`~.quorum.pairs_with`).
        batch: the batch schedule every replica must share, as named integers, e.g.
            ``{"global_batch": 64, "max_replicas": 2}`` (sequences per step over all
            replicas, the replica ids the data is split over); sent with each arrival
            at the quorum, which refuses a replica whose schedule differs from the
            members' (the later one). Default None: none given (it then pairs only
            with replicas that gave none).
        step: the committed step count this replica starts from: the step of the
            checkpoint it resumed (:meth:`checkpoint`), ``>= 0``; default 0. A replica
            behind the others heals from them at its first quorum; one ahead serves
            them.

    Raises:
        ValueError: ``replica_id < 0``, ``min_replicas < 1``, ``step < 0``, a
            timeout ``<= 0``, or a ``batch`` item not ``identifier: int``.

    Source: the design of torchft (PyTorch, 2024: per-step quorum through a
    lighthouse, ``should_commit``, live recovery from a peer), written for gloo and a
    plain c10d store.
    """

    def __init__(
        self,
        store: Store,
        replica_id: int,
        *,
        state_dict: StateDictFn,
        load_state_dict: LoadStateDictFn,
        min_replicas: int = 1,
        timeout_s: float = 10.0,
        join_timeout_s: float | None = None,
        quorum_timeout_s: float = 300.0,
        initial_replicas: int | None = None,
        prefix: str = "shardkit-ft",
        group: dist.ProcessGroup | None = None,
        step: int = 0,
        layout: LayoutFn | None = None,
        batch: Mapping[str, int] | None = None,
    ) -> None:
        join_timeout_s = timeout_s if join_timeout_s is None else join_timeout_s
        if replica_id < 0 or min_replicas < 1 or step < 0:
            raise ValueError(
                f"FaultTolerantReplicas: replica_id={replica_id}, min_replicas={min_replicas} "
                f"and step={step}; pass replica_id >= 0, min_replicas >= 1 and step >= 0"
            )
        if min(timeout_s, join_timeout_s, quorum_timeout_s) <= 0:
            raise ValueError(
                f"FaultTolerantReplicas: timeouts must be > 0 seconds; got timeout_s={timeout_s}, "
                f"join_timeout_s={join_timeout_s}, quorum_timeout_s={quorum_timeout_s}"
            )
        self.store, self.replica_id, self.prefix = store, replica_id, prefix
        self._state_dict, self._load_state_dict = state_dict, load_state_dict
        self.min_replicas, self.timeout_s = min_replicas, timeout_s
        self.join_timeout_s, self.quorum_timeout_s = join_timeout_s, quorum_timeout_s
        self.initial_replicas = initial_replicas
        self.batch = batch_text(batch)
        self.step = step
        self.state = ReplicaState.JOINING
        self.quorum: Quorum | None = None
        self.stats = ReplicaStats()
        self._group: tuple[int, GlooGroup] | None = None
        self.replica_group = group
        self.local_rank = 0 if group is None else dist.get_rank(group)
        self._layout = layout
        self._layouts = PublishedLayouts(store, prefix)
        self.layout_digest = self._publish_layout()

    def _publish_layout(self) -> str:
        """Publish this replica's size and layout fingerprint (its rank 0 writes them);
        return the fingerprint's digest (``n<size>`` without ``layout``)."""
        size = 1 if self.replica_group is None else dist.get_world_size(self.replica_group)
        if self.local_rank == 0:
            self.store.set(self._size_key(self.replica_id), str(size))
        if self._layout is None:
            return f"n{size}"
        mine = fingerprint(trainable(self._layout()))
        ranks: list[Any] = [mine]
        if self.replica_group is not None:
            ranks = [None] * size
            dist.all_gather_object(ranks, mine, group=self.replica_group)
        return self._layouts.publish(ranks, write=self.local_rank == 0)

    # the replica's own ranks -------------------------------------------------------
    def _share(self, make: Callable[[], Any]) -> Any:
        """``make()`` on the replica's rank 0 (the one that speaks on the store), its
        result broadcast to the replica's other ranks."""
        if self.replica_group is None:
            return make()
        box = [make() if self.local_rank == 0 else None]
        dist.broadcast_object_list(box, group=self.replica_group, group_src=0)
        return box[0]

    def _all_ok(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank of the replica."""
        if self.replica_group is None:
            return ok
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.replica_group)
        return bool(flag.item())

    # the quorum ----------------------------------------------------------------
    @property
    def num_members(self) -> int:
        """The number of replicas in this step's quorum (0 before :meth:`start_step`)."""
        return 0 if self.quorum is None else len(self.quorum.members)

    def start_step(self) -> Quorum:
        """Arrive at this step's quorum; heal first if this replica is behind.

        Returns:
            The quorum (its ``members`` train this step).

        Raises:
            QuorumTimeoutError: fewer than ``min_replicas`` replicas within
                ``quorum_timeout_s``.
            ReplicaMismatchError: the quorum refused this replica (on each of its
                ranks): its ``batch`` differs from the members', or its layout cannot
                pair with theirs (:func:`~.quorum.pairs_with`); the members go on.
        """
        quorum: Quorum = self._share(self._arrive)
        if self.replica_id in quorum.refused:
            raise ReplicaMismatchError(refusal(quorum, self._arrival(redo=False)))
        self.quorum, self.state = quorum, ReplicaState.MEMBER
        self._serve_or_heal(quorum)
        return quorum

    def _arrive(self) -> Quorum:
        """Join rounds from the next one until a quorum admits or refuses this replica."""
        round_ = self._next_round()
        while True:
            quorum = self._join(round_, redo=False)
            if self.replica_id in (*quorum.members, *quorum.refused):
                return quorum
            round_ = quorum.round + 1  # a redo round: joiners wait for the next one

    def _next_round(self) -> int:
        if self.state is ReplicaState.MEMBER and self.quorum is not None:
            return self.quorum.round + 1
        return decided_rounds(self.store, self.prefix)

    def _arrival(self, redo: bool) -> Arrival:
        return Arrival(self.replica_id, self.step, redo, self.layout_digest, self.batch)

    def _join(self, round_: int, redo: bool) -> Quorum:
        return join_round(
            self.store,
            self.prefix,
            round_,
            self._arrival(redo),
            min_replicas=self.min_replicas,
            join_timeout_s=self.join_timeout_s,
            quorum_timeout_s=self.quorum_timeout_s,
            initial_replicas=self.initial_replicas,
        )

    # healing -------------------------------------------------------------------
    def _size_key(self, replica: int) -> str:
        return f"{self.prefix}/size/{replica}"

    def _replica_size(self, replica: int) -> int:
        """The number of ranks of ``replica`` (each replica's rank 0 publishes it)."""
        return int(self.store.get(self._size_key(replica)).decode())

    def _heal_group(self, quorum: Quorum, healer: int, src: int, dst: int, me: int) -> GlooGroup:
        """The two-member group from the source's rank ``src`` (group rank 0) to the
        healer's rank ``dst`` (group rank 1); ``me`` is this rank's group rank."""
        prefix = f"{self.prefix}/round/{quorum.round}/heal/{healer}/{src}/{dst}"
        return gloo_group(self.store, prefix, me, 2, self.timeout_s)

    def _served_state(self) -> dict[str, Any] | None:
        """This rank's state and step for a healer, or None when ``state_dict`` failed."""
        try:
            return {"state": self._state_dict(), "step": self.step}
        except RuntimeError as err:
            _LOG.warning("replica %d: state_dict() failed: %s", self.replica_id, err)
            return None

    def _serve_or_heal(self, quorum: Quorum) -> None:
        """Send this rank's state to every rank of each member healing from this
        replica, or receive every rank's state of the source (see [Note: healing
        across layouts]). Pairs go in (source rank, healer rank) order: no deadlock."""
        for healer in quorum.healers_of(self.replica_id):
            state = self._served_state()
            for dst in range(self._replica_size(healer)):
                try:
                    group = self._heal_group(quorum, healer, self.local_rank, dst, 0)
                    sent = send_state(group, state)  # None: the healer fails at once
                except RuntimeError as err:  # the healer died: the reduction drops it
                    _LOG.warning(
                        "replica %d: sending the state to replica %d failed: %s",
                        self.replica_id,
                        healer,
                        err,
                    )
                    break
                self.stats.served += state is not None
                self.stats.served_bytes += sent
        source = quorum.source_of(self.replica_id)
        if source is None:
            return
        start = time.monotonic()
        received: list[dict[str, Any]] = []
        size, ok = 0, True
        try:
            for src in range(self._replica_size(source)):
                group = self._heal_group(quorum, self.replica_id, src, self.local_rank, 1)
                state, nbytes = recv_state(group)
                received.append(state)
                size += nbytes
        except RuntimeError as err:
            _LOG.warning("replica %d: receiving the state failed: %s", self.replica_id, err)
            ok = False
        if not self._all_ok(ok):  # one rank failed: the replica did
            self.state = ReplicaState.FAILED
            return
        self._load_state_dict([r["state"] for r in received])
        self.step = int(received[0]["step"])
        self.stats.healed += 1
        self.stats.healed_bytes += size
        self.stats.heal_s += time.monotonic() - start

    # the reduction ---------------------------------------------------------------
    def _cross_replica_group(self, quorum: Quorum) -> GlooGroup:
        if self._group is None:
            prefix = f"{self.prefix}/round/{quorum.group_round}/group/{self.local_rank}"
            rank = quorum.rank_of(self.replica_id)
            group = gloo_group(self.store, prefix, rank, len(quorum.members), self.timeout_s)
            self._group = (quorum.group_round, group)
        return self._group[1]

    def _layout_group(self, quorum: Quorum) -> GlooGroup:
        """One group of every rank of every member (members in id order, each one's
        ranks in its rank order), for the reduction across layouts."""
        if self._group is None:
            sizes = [self._replica_size(r) for r in quorum.members]
            rank = sum(sizes[: quorum.rank_of(self.replica_id)]) + self.local_rank
            prefix = f"{self.prefix}/round/{quorum.group_round}/layout-group"
            group = gloo_group(self.store, prefix, rank, sum(sizes), self.timeout_s)
            self._group = (quorum.group_round, group)
        return self._group[1]

    def _reduce_across_layouts(
        self, quorum: Quorum, pieces: list[LayoutPiece]
    ) -> torch.Tensor | None:
        """The members' average in the plain model's index space (see [Note: the
        reduction in the plain model's index space] in :mod:`.layouts`), or None when
        the reduction failed here."""
        space = self._layouts.space(quorum.layouts[0])
        wide = any(p.param is not None and p.param.dtype == torch.float64 for p in pieces)
        flat = space.scatter(pieces, torch.float64 if wide else torch.float32)
        flat /= len(quorum.members)
        try:
            self._layout_group(quorum).allreduce([flat]).wait()
        except RuntimeError as err:
            _LOG.warning(
                "replica %d: reduction across layouts in round %d failed: %s",
                self.replica_id,
                quorum.round,
                err,
            )
            self._release_group()
            return None
        return flat

    def _reduce_round(
        self, quorum: Quorum, params: list[torch.Tensor], local: torch.Tensor | None
    ) -> tuple[bool, Callable[[], None]]:
        """One reduction over ``quorum``'s members, on the fast path or across layouts:
        (whether it succeeded here, what puts the average into the gradients).

        Raises:
            ValueError: the members cannot reduce together (see
                :meth:`average_gradients`) and this replica healed in ``quorum`` (or
                none did); the others report a failure, and the redo leaves it out.
        """
        if self._group is not None and self._group[0] != quorum.group_round:
            self._release_group()  # another quorum's: a new group, or none (one member)
        if quorum.same_layout:
            result = None if local is None else self._reduce(quorum, local)
            return local is None or result is not None, lambda: _copy_flat(params, result)
        error = self._layouts.mismatch(quorum)
        if error is not None:
            if not quorum.heal or self.replica_id in dict(quorum.heal):
                raise ValueError(f"replica {self.replica_id}: {error}")
            return False, lambda: None
        assert self._layout is not None  # its digest named a published layout
        pieces = trainable(self._layout())
        flat = self._reduce_across_layouts(quorum, pieces)
        space = self._layouts.space(quorum.layouts[0])
        return flat is not None, lambda: None if flat is None else space.gather(flat, pieces)

    def _reduce(self, quorum: Quorum, local: torch.Tensor) -> torch.Tensor | None:
        """The average of the members' ``local`` (summed after dividing each by the
        member count, as DDP does), or None when the reduction failed here."""
        averaged = local / len(quorum.members)
        if len(quorum.members) == 1:
            return averaged
        try:
            self._cross_replica_group(quorum).allreduce([averaged]).wait()
        except RuntimeError as err:
            _LOG.warning(
                "replica %d: reduction in round %d failed: %s", self.replica_id, quorum.round, err
            )
            self._release_group()
            return None
        return averaged

    def average_gradients(self, parameters: Iterable[torch.Tensor]) -> bool:
        """Average the gradients of ``parameters`` over this step's surviving members.

        Parameters without a gradient count as zeros (every replica must pass the same
        parameters in the same order). In a replica of several ranks, each rank passes
        the parameters whose gradients it holds reduced over the replica: all of them
        under DDP, its shard otherwise (``OSS.local_params()`` under OSS and
        ShardedDataParallel, FSDP's ``parameters()``). When a member fails or times out, the members
        that reported in time redo the reduction among themselves, from their own
        gradients, until one succeeds on all of them. Members of different layouts
        (``layout=``) average the pieces their layouts list instead, in the plain
        model's index space (see [Note: a replica of several ranks]).

        Returns:
            True: the parameters' ``.grad`` hold the average over
            ``len(self.quorum.members)`` replicas; apply the optimizer step (the step
            count is advanced). False: this replica was dropped from the step; skip the
            optimizer step, its state is replaced at its next :meth:`start_step`.

        Raises:
            RuntimeError: called before :meth:`start_step`.
            ValueError: the members' layouts hold different models (other keys or
                global shapes): raised on the members that healed in this step's quorum
                (the others go on without them), on every member when none healed.
        """
        if self.quorum is None or self.state is ReplicaState.JOINING:
            raise RuntimeError(
                "FaultTolerantReplicas.average_gradients: call start_step() first, once per step"
            )
        params = [p for p in parameters if p.requires_grad]
        local = torch.cat([_grad_or_zeros(p).reshape(-1) for p in params]) if params else None
        quorum = self.quorum
        while True:
            # A FAILED member takes part (its peers need not time out) but votes no.
            ok, apply = self._reduce_round(quorum, params, local)
            verdict = self._vote(quorum, self._all_ok(ok and self.state is ReplicaState.MEMBER))
            if verdict.commit:
                apply()
                self.step += 1
                self.stats.contributors.append(len(quorum.members))
                return True
            if self.state is ReplicaState.FAILED or self.replica_id not in verdict.voters:
                return self._drop()
            self.stats.redone_reductions += 1
            quorum = self._share(functools.partial(self._join, quorum.round + 1, redo=True))
            if self.replica_id not in quorum.members:
                return self._drop()
            self.quorum = quorum

    # checkpoints -----------------------------------------------------------------
    def checkpoint(self, save: Callable[[], object]) -> bool:
        """Write the state of the step just committed once, from one replica.

        Call it on every rank of every member after a committed step (after the
        optimizer step that followed :meth:`average_gradients` returning True): the
        lowest replica id of the step's quorum calls ``save()`` on each of its ranks
        (together: it may be a collective over the replica's group, e.g.
        ``shardkit.checkpoint.universal.save_universal``); the others return at once.
        Every member holds the same state after a commit, so one copy is the job's.
        To resume, every replica loads the newest checkpoint and passes its step as
        ``step=`` to a new manager on a fresh quorum store (or prefix).

        Args:
            save: writes this rank's part of the checkpoint of step :attr:`step`.

        Returns:
            True when this replica wrote; False when another member did, or this
            replica was dropped from the step (it holds no committed state to write).

        Warning:
            A writer that dies mid-save leaves the previous checkpoint the newest (the
            universal checkpoint commits atomically); the others are not told and do
            not write it again.
        """
        if self.quorum is None or self.state is not ReplicaState.MEMBER:
            return False
        if self.replica_id != min(self.quorum.members):
            return False
        save()
        return True

    def _vote(self, quorum: Quorum, ok: bool) -> Verdict:
        """The round's verdict, given this replica's outcome (its rank 0 votes)."""
        verdict: Verdict = self._share(
            lambda: vote(self.store, self.prefix, quorum, self.replica_id, ok, self.timeout_s)
        )
        return verdict

    def _drop(self) -> bool:
        self.state, self.quorum = ReplicaState.JOINING, None
        self._release_group()
        self.stats.dropped_steps += 1
        return False

    # the groups' lifetime --------------------------------------------------------
    def _release_group(self) -> None:
        """Destroy the cross-replica group, if any (see [Note: the groups' lifetime])."""
        held, self._group = self._group, None
        del held  # the only reference: the group is destroyed here, its threads joined

    def close(self) -> None:
        """Destroy the cross-replica group now, on this thread: its gloo worker threads
        and connections end here, not at the interpreter's exit.

        Call it on every rank of the replica once training ends (or use the manager as
        a context manager); the main job does, also when training raises. Idempotent;
        a :meth:`start_step` after it builds a new group. See [Note: the groups'
        lifetime].
        """
        self._release_group()

    def __enter__(self) -> FaultTolerantReplicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _copy_flat(params: list[torch.Tensor], averaged: torch.Tensor | None) -> None:
    """Copy the flat ``averaged`` back into the ``.grad`` of ``params`` (in order)."""
    offset = 0
    for p in params:
        n = p.numel()
        if averaged is not None:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(averaged[offset : offset + n].view_as(p))
        offset += n


def _grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)
