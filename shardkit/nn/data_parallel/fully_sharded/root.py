"""What every unit under one root shares: the units, their order, pending reductions.

The root is the outermost unit a forward pass enters; it owns the per-step work that
concerns all units at once (see :class:`RootState`): putting leftover full parameters
away, agreeing on the trainable set, broadcasting buffers, and ending the backward
pass. The per-unit work lives in :class:`~.unit.UnitRuntime`.

[Note: one forward, one current copy]
A unit's local shard is the one current copy of its parameters; a full flat buffer is
a cache made from it. The root (and a unit with ``reshard_after_forward=False``) keeps
its full parameters after forward for the backward that usually follows, but a forward
with no backward (a sanity check, an eval pass without ``no_grad``, generation) leaves
them behind. Loads and optimizer steps then write the shards, not that cache: the
shard's version counter moves. :meth:`RootState.begin_forward` therefore reuses a
leftover only while no rank's shard has moved since it was gathered (decided in the
all-reduce that agrees on the trainable set, so every rank re-gathers or none does,
and the all-gathers stay paired; micro-batch forwards of a pipeline keep their
cache), and puts leftovers away before a forward without grad and before
``summon_full_params``, which gathers afresh. A backward
still pending from the old forward re-gathers its parameters; if the shard changed
since that forward, it raises instead of mixing two sets of weights (see
``UnitRuntime.pre_backward``), as plain torch refuses a backward through a
parameter modified in place.

[Note: buffers follow torch DDP]
Buffers (BatchNorm statistics) on every rank hold what torch DDP's would hold on that
rank after every operation. DDP (torch 2.13, ``forward_sync_buffers=True``) broadcasts
its first rank's buffers at construction, and before a forward whenever the previous
forward of that DDP module ran with grad enabled outside ``no_sync`` (and before the
first forward); train or eval mode does not matter, a backward or an optimizer step
changes nothing. So with ``no_sync`` accumulation the broadcast comes before the first
micro-batch of a step (the one inside ``no_sync``), not before the synchronised one,
and an eval pass under ``torch.no_grad()`` is broadcast to only if it follows a
synchronised training forward; the forward after it is not. shardkit keeps the same
flag (``sync_buffers``), set by :meth:`RootState.buffers_after_forward` after every
root forward, a forward inside ``summon_full_params`` included (generation inside the
context is a forward too). Each unit broadcasts its own buffers at construction, with
its flat parameter. ``broadcast_buffers=False`` is DDP's ``forward_sync_buffers=False``:
the construction broadcast only.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.profiler import record_function

from shardkit.distributed.collectives import group_size
from shardkit.memory import heap_trim_point
from shardkit.nn.data_parallel.fully_sharded.collectives import (
    Pending,
    all_reduce_max,
    broadcast_data_parallel,
)

__all__ = ["PhaseUnit", "RootState", "TrainableMismatchError", "in_backward_pass"]


def in_backward_pass() -> bool:
    """True while the autograd engine runs a backward on this thread (hooks, and
    activation checkpointing's recomputed forwards, run inside one)."""
    return bool(torch._C._current_graph_task_id() != -1)


class TrainableMismatchError(ValueError):
    """Ranks disagree on which parameters of the model require a gradient."""


class PhaseUnit(Protocol):
    """What the root needs of a unit (:class:`~.unit.UnitRuntime` implements it)."""

    label: str

    @property
    def has_leftover_full(self) -> bool: ...

    @property
    def has_stale_full(self) -> bool: ...

    @property
    def has_ready_grads(self) -> bool: ...

    @property
    def is_prefetching(self) -> bool: ...

    def reshard(self) -> None: ...

    def prefetch(self, steps: bool) -> None: ...

    def refresh_trainable(self) -> bool: ...

    def drop_secondary(self) -> None: ...

    def trainable_names(self) -> list[str]: ...

    def post_backward(self) -> None: ...

    def end_backward(self) -> None: ...

    def abort_backward(self) -> None: ...


@dataclass
class RootState:
    """Shared by every unit under one root.

    Attributes:
        module: the root's ``nn.Module`` (its buffers are broadcast before forward).
        units: every unit, root first, in module order.
        process_group: the root's process group.
        broadcast_buffers: broadcast the group's first rank's buffers before a forward
            that follows a synchronised training forward (DDP's rule).
        replicate_group: hybrid sharding's replica group (agreement and buffers span
            it too); None without replicas.
        forward_order: units in the order their first forward ran (recorded once).
        order_frozen: True after the root's first forward: prefetching uses the order.
        pending: issued gradient reduce-scatters, oldest first.
        finalize_queued: a ``finalize_backward`` callback waits on the engine.
        sync_buffers: the next forward broadcasts buffers (DDP's
            ``require_forward_param_sync``: True at first, then whether the last
            forward ran with grad enabled outside ``no_sync``).
    """

    module: nn.Module
    units: Sequence[PhaseUnit]
    process_group: dist.ProcessGroup | None
    broadcast_buffers: bool = True
    replicate_group: dist.ProcessGroup | None = None
    forward_order: list[PhaseUnit] = field(default_factory=list)
    order_frozen: bool = False
    pending: deque[Pending] = field(default_factory=deque)
    finalize_queued: bool = False
    sync_buffers: bool = True

    @property
    def on_cpu(self) -> bool:
        """The root's parameters (its shards) live in CPU memory: the C heap matters."""
        first = next(self.module.parameters(), None)
        return first is not None and first.device.type == "cpu"

    def neighbour(self, unit: PhaseUnit, step: int) -> PhaseUnit | None:
        """The unit ``step`` places after ``unit`` in forward order, or None."""
        if not self.order_frozen or unit not in self.forward_order:
            return None
        index = self.forward_order.index(unit) + step
        return self.forward_order[index] if 0 <= index < len(self.forward_order) else None

    def record_forward(self, unit: PhaseUnit) -> None:
        """Note ``unit``'s first forward (the prefetch order), until the order freezes."""
        if not self.order_frozen and unit not in self.forward_order:
            self.forward_order.append(unit)

    # the root's forward ----------------------------------------------------------
    def begin_forward(self) -> None:
        """Before the root's forward: trainable set agreed, stale leftovers away (see
        [Note: one forward, one current copy]), buffers synced."""
        with record_function("FSDP::root_pre_forward"):
            self.end_aborted_backward()
            stale = True  # without the agreement round (no grad), put leftovers away
            if torch.is_grad_enabled():
                stale = self._agree(any(u.has_stale_full for u in self.units))
            for unit in self.units:
                if stale and unit.has_leftover_full:
                    unit.reshard()
                unit.drop_secondary()  # [Note: resharding to a smaller group] in .unit
            self.buffers_before_forward()

    def end_forward(self, backward_expected: bool, synchronised: bool) -> None:
        """After the root's forward: freeze the order, drop what backward will not use."""
        self.order_frozen = True
        self.buffers_after_forward(synchronised)
        for unit in self.units:
            if unit.is_prefetching or not backward_expected:
                unit.reshard()  # an unused prefetch, or inference: nothing to keep
        if self.on_cpu and backward_expected:  # [Note: trimming the heap] in memory
            heap_trim_point("step")  # the default mode: training forwards, 1 in 8

    # buffers: torch DDP's rule -----------------------------------------------------
    def buffers_before_forward(self) -> None:
        """Broadcast the group's first rank's buffers if the rule says so (see
        [Note: buffers follow torch DDP]); a collective on every rank."""
        if self.broadcast_buffers and self.sync_buffers:
            buffers = list(self.module.buffers())
            if buffers:  # version counters kept, as DDP: a graph may have saved a buffer
                with torch.no_grad(), _unsafe_preserve_version_counter(tuple(buffers)):
                    broadcast_data_parallel(buffers, self.process_group, self.replicate_group)

    def buffers_after_forward(self, synchronised: bool) -> None:
        """Whether the next forward broadcasts: this one ran with grad enabled outside
        ``no_sync`` (``synchronised``)."""
        self.sync_buffers = torch.is_grad_enabled() and synchronised

    def _agree(self, stale: bool) -> bool:
        """Adopt ``requires_grad`` changes made since the last forward (every unit) and,
        in one all-reduce of three integers, check that all ranks made the same ones and
        learn whether any rank's leftover full parameters are stale.

        Returns:
            True if some rank holds a stale leftover (every rank then puts its
            leftovers away, so the all-gathers stay paired).

        Raises:
            TrainableMismatchError: ranks differ; names the parameters and their ranks.
        """
        for unit in self.units:
            unit.refresh_trainable()
        groups = [self.process_group]
        if self.replicate_group is not None:
            groups.append(self.replicate_group)
        if not dist.is_initialized() or all(group_size(g) == 1 for g in groups):
            return stale
        names = [name for unit in self.units for name in unit.trainable_names()]
        digest = int.from_bytes(
            hashlib.blake2b("\n".join(names).encode(), digest_size=7).digest(), "little"
        )
        agreed = torch.tensor([digest, -digest, int(stale)], dtype=torch.int64)
        for group in groups:  # a maximum over the shard group, then across replicas
            all_reduce_max(agreed, group, "agreement on the trainable parameters")
        if int(agreed[0]) != digest or int(agreed[1]) != -digest:
            self._raise_mismatch(names, groups)
        return bool(agreed[2])

    def _raise_mismatch(self, names: list[str], groups: list[dist.ProcessGroup | None]) -> None:
        every: list[Any] = []
        for group in groups:  # the sets of this rank's shard group, then of its replicas
            found: list[Any] = [None] * group_size(group)
            dist.all_gather_object(found, names, group=group)
            every += [(group, r, set(n)) for r, n in enumerate(found)]
        union = set().union(*(s for _, _, s in every))
        all_differing = sorted(n for n in union if any(n not in s for _, _, s in every))
        differing = all_differing[:2] + all_differing[2:][-2:]  # the first and the last
        where = f"{len(all_differing)} parameters differ, e.g. " + "; ".join(
            f"`{n}` trainable on {sum(n in s for _, _, s in every)} of the {len(every)} "
            f"ranks asked (group ranks {[r for g, r, s in every if n in s and g is groups[0]]} "
            "of this rank's group)"
            for n in differing
        )
        raise TrainableMismatchError(
            f"ranks disagree on which parameters require a gradient: {where}. Change "
            "requires_grad the same way on every rank before the forward"
        )

    # the end of backward ---------------------------------------------------------
    def queue_finalize(self) -> None:
        """Queue :meth:`finalize_backward` on autograd's engine (once per backward)."""
        if not self.finalize_queued:
            self.finalize_queued = True
            Variable._execution_engine.queue_callback(self.finalize_backward)

    def add_pending(self, pending: Pending, cap_bytes: float) -> None:
        """Track an issued reduction; wait for the oldest while more than ``cap_bytes``
        bytes are in flight."""
        self.pending.append(pending)
        while len(self.pending) > 1 and sum(p.nbytes for p in self.pending) > cap_bytes:
            self.pending.popleft().wait()

    def end_aborted_backward(self) -> None:
        """A backward that raised: autograd dropped the queued :meth:`finalize_backward`,
        so the units would stay in it (``zero_grad()``, ``state_dict()`` refused, no later
        backward finalised). Outside any backward, with one still queued: wait for the
        reductions issued (their shards reach ``.grad``, as the plain model's partial
        gradients), drop the rest, reshard, go idle. Called before a forward,
        ``zero_grad()`` and ``summon_full_params()``.

        Raises:
            RuntimeError: a store cannot go on (the disk tier: resume its directory).
        """
        if not self.finalize_queued or in_backward_pass():
            return
        while self.pending:
            self.pending.popleft().wait()
        for unit in self.units:
            unit.abort_backward()
        self.finalize_queued = False

    def finalize_backward(self) -> None:
        """End of the backward pass: reduce what is left, wait for every reduction, reshard."""
        with record_function("FSDP::finalize_backward"):
            for unit in self.units:
                if unit.has_ready_grads:
                    unit.post_backward()  # some trainable parameters got no gradient
            while self.pending:
                self.pending.popleft().wait()
            for unit in self.units:
                unit.end_backward()
            self.finalize_queued = False
