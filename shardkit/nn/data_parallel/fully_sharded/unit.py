"""The runtime of one FSDP unit: it owns the unit's state and runs its phase hooks.

One :class:`UnitRuntime` per unit (as torch FSDP2's parameter group) owns the flat
parameter handle, both state enums, the trainable set, the pending all-gather and the
gradient bookkeeping. Every state change goes through its small named methods; the
``nn.Module`` front (``api.py``) and the state-dict, optimizer-state and checkpoint
code reach a unit only through :func:`runtime_of` / :func:`named_units`.

One training step of a root unit R with nested units U1, U2 (forward order), with
``reshard_after_forward=True`` (``ag`` = all-gather, ``rs`` = reduce-scatter)::

    phase           R            U1               U2
    forward         ag, run ...  ag (prefetched   ag (prefetched in U1's pre_forward),
                                 in R's),  run,   run, free
                                 free
    backward        (kept)                        ag in pre_backward (U1 prefetched),
                                                  grads -> rs, free
                                 ag, grads -> rs,
                                 free
                    grads -> rs, free
    finalize        wait every rs; every unit sharded, IDLE

[Note: when is a unit's backward done]
Its pre-backward hook is a tensor hook on each forward output: it fires when the
gradient of an output is computed, before the unit's own backward ops run. Its
post-backward is driven by ``register_post_accumulate_grad_hook`` on every trainable
unsharded parameter: autograd accumulates a leaf's gradient once per backward, after
every use of it (several forwards, a unit used twice), so when all of a unit's
trainable parameters have reported, its gradient is complete. Parameters that receive
no gradient (unused) are handled by ``finalize_backward``, a callback queued on
autograd's engine that runs when the whole backward pass ends.

[Note: the last unit keeps its full parameters]
The last unit of the forward order (once the order is recorded, from the second
forward on) is the first whose backward runs, right after the root's tail (a loss
head, typically), so it stays unsharded after its forward instead of freeing its full
parameters and all-gathering them again at once, with nothing to overlap that
all-gather (torchtitan leaves its last block unresharded for the same reason; FSDP2
does so for the root). One all-gather less per step; the memory peak is unchanged,
since the prefetch in backward would hold the same buffer: the root's, this unit's
and one prefetched unit's full parameters. It is kept as the root's are: put away by
its backward, by the end of the backward pass, or before a forward without backward
follows (see [Note: one forward, one current copy] in ``root``).

[Note: prefetching a kept unit's step]
A unit kept unsharded after its forward (the last unit, the root) gathers nothing in
backward, yet a store whose step reads the shard and the optimizer state from a file
(the disk tier) must still bring them in ahead of the step. So ``prefetch`` tells the
store of such a unit once its backward has begun: the last unit prefetches itself in
its pre-backward (its step comes first), and the root, whose pre-backward fires first
but whose parameters' gradients (the embeddings') come last, is prefetched by the unit
before it in backward order, as a sharded unit is. A memory store has nothing to bring.

[Note: frozen parameters]
A frozen parameter has no gradient to report, yet a later backward op may read it (a
frozen ``Linear`` early in the unit needs its weight for the input's gradient after
every trainable parameter of the unit is done). A unit holding frozen parameters
therefore reduce-scatters on time but stays unsharded until ``finalize_backward``.

[Note: resharding to a smaller group]
With ``reshard_after_forward=M`` (an int, ZeRO++'s hpZ; torch FSDP2's int
``reshard_after_forward``), a unit that expects a backward keeps, instead of nothing,
this rank's 1/M slice of the full buffer (``P / M`` elements, P the padded size) for
its group of M consecutive ranks, so backward's all-gather runs inside that group (one
node: the fast link) instead of over all N ranks. The gradient reduce-scatter still
spans the N ranks. Cost: ``P / M`` extra elements per unit between its forward and its
backward. The secondary shard is used by the next all-gather only; any reshard drops
it, and the root drops every unit's at the start of a new forward (a new forward
gathers from the shards, the one current copy).

[Note: the trainable set follows requires_grad]
Which parameters train is read at every forward with grad enabled, not once at
wrapping: a user freezes or unfreezes through the parameters ``named_parameters()``
returns (the sharded ones) or, between forward and backward, the module's attributes
(the unsharded ones). :meth:`UnitRuntime.refresh_trainable` adopts a change on
either, and the root checks that every rank made the same one (see ``root``).

Why this module is long: UnitRuntime is the one object that owns a unit's state, and its
phase hooks are its methods by design (state changes only through them); this docstring
(the step table, the notes) is 70 of its lines.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from shardkit.distributed.collectives import group_size
from shardkit.memory import heap_trim_point
from shardkit.nn.data_parallel.fully_sharded.collectives import (
    Pending,
    all_gather_flat,
)
from shardkit.nn.data_parallel.fully_sharded.config import FSDPConfig
from shardkit.nn.data_parallel.fully_sharded.flat_param import FlatParamHandle
from shardkit.nn.data_parallel.fully_sharded.precision import BufferCast
from shardkit.nn.data_parallel.fully_sharded.reduction import ShardReducer
from shardkit.nn.data_parallel.fully_sharded.root import RootState
from shardkit.nn.data_parallel.fully_sharded.state import ShardedState, TrainingState
from shardkit.nn.data_parallel.fully_sharded.store import ShardStore

__all__ = [
    "WRAPPED",
    "ParametersChangedError",
    "UnitRuntime",
    "as_sharded",
    "clean_name",
    "is_unit",
    "named_units",
    "runtime_of",
    "summon",
    "units_in",
    "unwrapped_module",
]

WRAPPED = "_fsdp_wrapped_module"
_RUNTIMES: Any = WeakIdKeyDictionary()  # the FSDP nn.Module -> its UnitRuntime


class ParametersChangedError(RuntimeError):
    """A unit's parameters were written between a forward and its backward."""


def runtime_of(module: nn.Module) -> UnitRuntime | None:
    """The runtime of ``module`` if it is an FSDP unit, else None."""
    return _RUNTIMES.get(module)


def is_unit(module: nn.Module) -> bool:
    """True if ``module`` is an FSDP unit."""
    return module in _RUNTIMES


def clean_name(name: str) -> str:
    """``name`` without wrapper prefixes (``a._fsdp_wrapped_module.b`` -> ``a.b``)."""
    return name.replace(f"{WRAPPED}.", "")


def unwrapped_module(module: nn.Module) -> nn.Module:
    """The module that ``module``'s stack of directly nested units wraps
    (``FSDP(m)`` and ``FSDP(FSDP(m))``, FairScale's ``FSDP(auto_wrap(m))`` when the
    policy wrapped the root: ``m``); ``module`` itself when it is not a unit. Its
    state-dict keys are the unwrapped model's, whatever the nesting."""
    while is_unit(module):
        module = getattr(module, WRAPPED)
    return module


def units_in(module: nn.Module) -> list[UnitRuntime]:
    """Every unit in ``module``'s tree (itself included), in module order."""
    return [_RUNTIMES[m] for m in module.modules() if m in _RUNTIMES]


def named_units(module: nn.Module) -> dict[str, UnitRuntime]:
    """The units of ``module``'s tree that hold parameters, keyed ``"<path>.flat_param"``
    (``"flat_param"`` for the top), in module order: the keys of local state dicts and
    sharded checkpoints. A unit wrapping another unit directly (no parameters of its
    own) shares its path and is left out."""
    found: dict[str, UnitRuntime] = {}
    for name, mod in module.named_modules():
        runtime = runtime_of(mod)
        if runtime is not None and not is_unit(getattr(mod, WRAPPED)):
            clean = clean_name(name + ".").rstrip(".")
            found[f"{clean}.flat_param" if clean else "flat_param"] = runtime
    return found


def as_sharded(units: list[UnitRuntime], param: nn.Parameter) -> nn.Parameter:
    """The sharded parameter of ``param`` if it is an unsharded (full-shape) parameter of
    one of ``units``, else ``param``."""
    for unit in units:
        param = unit.handle.as_sharded(param)
    return param


class UnitRuntime:
    """Owns one unit's flat parameter handle, state enums, trainable set and gradients.

    Args:
        module: the unit's ``nn.Module`` (registered: :func:`runtime_of` finds this).
        handle: the unit's flat parameter (see :mod:`.flat_param`).
        config: the unit's options.
        store: where the local shard lives between the unit's runs (see :mod:`.store`;
            picked by the front from the options).
        reducer: reduces the unit's gradient into this rank's shard (see
            :mod:`.reduction`; picked by the front from the options).
        process_group: the ranks sharing the unit (None: world).
        buffer_casts: buffers cast to the mixed-precision buffer dtype (for state dicts).
        label: "the FSDP unit wrapping <class>", for messages.
        replicate_group: hybrid sharding's replica group (the ranks holding the same
            shard in other shard groups); None: no replicas.
        secondary_group: with ``reshard_after_forward`` an int M, this rank's group of M
            consecutive ranks (a node): after forward the unit keeps 1/M of the full
            parameters and backward all-gathers them inside that group. None: off.
    """

    def __init__(
        self,
        module: nn.Module,
        handle: FlatParamHandle,
        config: FSDPConfig,
        store: ShardStore,
        reducer: ShardReducer,
        process_group: dist.ProcessGroup | None,
        buffer_casts: list[BufferCast],
        label: str,
        replicate_group: dist.ProcessGroup | None = None,
        secondary_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.module = module
        self.handle = handle
        self.config = config
        self.store = store
        self.reducer = reducer
        self.process_group = process_group
        self.rank = handle.rank
        self.world_size = handle.layout.world_size
        self.replicate_group = replicate_group
        self.secondary_group = secondary_group  # reshard_after_forward as an int
        self._secondary: torch.Tensor | None = None  # kept from forward for backward
        replicas = 1 if replicate_group is None else group_size(replicate_group)
        self.data_parallel_size = self.world_size * replicas  # gradients average over these
        self.key: tuple[str, int] = ("fsdp", 0)  # names its reductions for a compressor
        self.path = ""  # the unit's module path in its root's model (set by the root)
        self.buffer_casts = buffer_casts
        self.label = label
        self.training_state = TrainingState.IDLE
        self.sharded_state = ShardedState.SHARDED
        self.pending_unshard: Pending | None = None
        self.root: RootState | None = None
        self.is_root = False
        self.sync_gradients = True
        self.gathering_state_dict = False  # the root's full state dict is being built
        self.grads_ready: set[int] = set()
        self.grads_expected: set[int] = set()
        self._hooked: set[int] = set()
        self._kept_after_forward = False
        self._full_version = 0
        self._gathered_shard_version = 0
        self._saved_shard: torch.Tensor | None = None
        self._update_trainable()
        _RUNTIMES[module] = self

    # properties the root reads ---------------------------------------------------
    @property
    def has_leftover_full(self) -> bool:
        """Full parameters kept after a forward whose backward did not run (yet)."""
        return self._kept_after_forward and self.sharded_state is not ShardedState.SHARDED

    @property
    def has_stale_full(self) -> bool:
        """A leftover full buffer whose shard was written since it was gathered."""
        return self.has_leftover_full and self.shard_version != self._gathered_shard_version

    @property
    def has_ready_grads(self) -> bool:
        """Some trainable parameter reported its gradient; the reduction is not issued."""
        return bool(self.grads_ready)

    @property
    def is_prefetching(self) -> bool:
        """An asynchronous all-gather into the full buffer is in flight."""
        return self.sharded_state is ShardedState.UNSHARDING

    @property
    def shard_version(self) -> int:
        """The local shard's version counter (bumped by every in-place write to it)."""
        return int(self.handle.local_shard._version)

    # state transitions -----------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """SHARDED -> UNSHARDING (all-gather issued) -> UNSHARDED (waited, views installed)."""
        if self.sharded_state is ShardedState.UNSHARDED:
            return
        handle = self.handle
        if self.sharded_state is ShardedState.SHARDED:
            handle.alloc_full()
            self.store.before_gather()
            self._gathered_shard_version = self.shard_version
            source, group = self._gather_source()
            self.pending_unshard = (
                all_gather_flat(handle.full_flat, source, group, async_op=async_op)
                if handle.owns_full_flat
                else Pending(done=True)
            )
            self.sharded_state = ShardedState.UNSHARDING
            if async_op:
                return
        assert self.pending_unshard is not None
        self.pending_unshard.wait()
        self.store.after_gather(in_forward=self.training_state is TrainingState.FORWARD)
        handle.use_unsharded()
        self._full_version = int(handle.full_flat._version)
        self.sharded_state = ShardedState.UNSHARDED

    def _gather_source(self) -> tuple[torch.Tensor, dist.ProcessGroup | None]:
        """What the all-gather sends: the secondary shard over its small group when one
        was kept after forward (see [Note: resharding to a smaller group]), else the
        local shard over the unit's group. The secondary shard is used once."""
        if self._secondary is not None:
            secondary, self._secondary = self._secondary, None
            return secondary, self.secondary_group
        return self.handle.gather_source(), self.process_group

    def _secondary_slice(self) -> torch.Tensor:
        """A copy of this rank's slice of the full buffer for its secondary group (call
        while UNSHARDED, before the full buffer is freed)."""
        assert self.secondary_group is not None
        size = group_size(self.secondary_group)
        index, chunk = self.rank % size, self.handle.layout.padded // size
        return self.handle.full_flat[index * chunk : (index + 1) * chunk].clone()

    def drop_secondary(self) -> None:
        """Forget a secondary shard kept for a backward (a new forward starts)."""
        if self.sharded_state is ShardedState.SHARDED:
            self._secondary = None

    def prefetch(self, steps: bool) -> None:
        """The unit runs next: issue the all-gather without waiting, unless the shard
        store is still bringing the shard in (then the all-gather waits for ``unshard``).
        ``steps``: a backward that reduces gradients follows (see ``ShardStore.prefetch``).

        A unit kept unsharded whose backward has begun needs no all-gather; with
        ``steps`` its store is still told, so that it brings in what the unit's step
        reads (see [Note: prefetching a kept unit's step])."""
        if self.sharded_state is ShardedState.SHARDED:
            if self.store.prefetch(steps):
                self.unshard(async_op=True)
        elif self.training_state is TrainingState.PRE_BACKWARD and steps:
            self.store.prefetch(steps)

    def reshard(self) -> None:
        """Any state -> SHARDED: the sharded parameters installed, the full buffer freed
        (a secondary shard kept for backward is dropped)."""
        self._kept_after_forward = False
        self._secondary = None
        if self.sharded_state is ShardedState.SHARDED:
            return
        if self.pending_unshard is not None:
            self.pending_unshard.wait()
        self.handle.use_sharded()
        self.handle.free_full()
        self.sharded_state = ShardedState.SHARDED
        if self.handle.placement.compute_device.type == "cpu":
            heap_trim_point("unit")  # only in set_heap_trim("unit"): [Note: trimming the heap]

    def become_root(self, units: list[UnitRuntime], broadcast_buffers: bool) -> None:
        """Make this unit the root of ``units`` (itself first), sharing one RootState."""
        root = RootState(
            self.module, units, self.process_group, broadcast_buffers, self.replicate_group
        )
        for index, unit in enumerate(units):
            unit.root, unit.is_root = root, unit is self
            unit.key = ("fsdp", index)  # the same on every rank: module order

    def _root(self) -> RootState:
        assert self.root is not None, "a unit runs only under a root (lazy init)"
        return self.root

    # forward ---------------------------------------------------------------------
    def pre_forward(self) -> None:
        """Before the wrapped module's forward: all-gather (or wait for the prefetch)."""
        with record_function("FSDP::pre_forward"):
            root = self._root()
            if self.is_root:
                root.begin_forward()
            self.training_state = TrainingState.FORWARD
            self.unshard()
            root.record_forward(self)
            following = root.neighbour(self, +1)
            if following is not None:
                following.prefetch(steps=torch.is_grad_enabled() and self.sync_gradients)

    def post_forward(self, output: Any) -> None:
        """After the forward: reshard (unless kept) and hook the outputs for backward."""
        with record_function("FSDP::post_forward"):
            needing_grad = _tensors_needing_grad(output) if torch.is_grad_enabled() else []
            keep = (self.is_root and self.config.disable_reshard_on_root) or (
                bool(needing_grad) and self._backward_starts_here()
            )
            if not needing_grad or (self.config.reshard_after_forward and not keep):
                keep_secondary = (
                    bool(needing_grad)
                    and self.secondary_group is not None
                    and self.sharded_state is ShardedState.UNSHARDED
                )
                secondary = self._secondary_slice() if keep_secondary else None
                self.reshard()  # drops any older secondary shard
                self._secondary = secondary
            else:
                self._kept_after_forward = True
            hook = functools.partial(_pre_backward_hook, self, self.shard_version)
            for tensor in needing_grad:
                tensor.register_hook(hook)
            self.training_state = TrainingState.IDLE
            if self.is_root:
                self._root().end_forward(bool(needing_grad), self.sync_gradients)

    def abort_forward(self) -> None:
        """The wrapped module's forward raised (a bad batch): no backward comes for it.
        FORWARD -> IDLE and resharded, as after an inference forward (the root also
        drops an unused prefetch), so ``zero_grad()``, ``state_dict()`` and the next
        forward find the unit between steps."""
        with record_function("FSDP::abort_forward"):
            self.training_state = TrainingState.IDLE
            self.reshard()
            if self.is_root:
                for unit in self._root().units:
                    if unit.is_prefetching:
                        unit.reshard()

    def _backward_starts_here(self) -> bool:
        """True for the last unit of the (recorded) forward order, not the root: its
        backward comes first, so it keeps its full parameters (see [Note: the last unit
        keeps its full parameters])."""
        root = self._root()
        return not self.is_root and root.order_frozen and root.neighbour(self, +1) is None

    # backward --------------------------------------------------------------------
    def pre_backward(self, forward_version: int) -> None:
        """An output's gradient arrived: all-gather the parameters for the unit's backward.

        Raises:
            ParametersChangedError: the local shard was written (a load, an optimizer
                step) since the forward whose backward this is.
            RuntimeError: the shard store refuses the backward (on a disk tier: a second
                backward before ``optimizer.step()``).
        """
        if self.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
            return
        if self.shard_version != forward_version:
            raise ParametersChangedError(
                f"{self.label}: its parameters were changed (loaded, stepped or written in "
                "place) between the forward and this backward, so the gradient would match "
                "neither set of weights. Run backward before loading or stepping, or run the "
                "forward again after the change"
            )
        self.store.check_backward_allowed(self.label, self.sync_gradients)  # before any change
        with record_function("FSDP::pre_backward"):
            root = self._root()
            root.queue_finalize()
            self.training_state = TrainingState.PRE_BACKWARD
            kept, self._kept_after_forward = self._kept_after_forward, False
            self.unshard()
            if kept and not self.is_root:
                self.prefetch(self.sync_gradients)  # its step comes first (see the Note)
            previous = root.neighbour(self, -1)
            if previous is not None:
                previous.prefetch(self.sync_gradients)

    def post_accumulate_grad(self, index: int) -> None:
        """Autograd accumulated parameter ``index``; the last trainable one ends the backward."""
        if index not in self.grads_expected:
            return  # frozen since the hook was registered
        self._root().queue_finalize()
        self.grads_ready.add(index)
        if self.grads_ready >= self.grads_expected:
            self.post_backward()

    def post_backward(self) -> None:
        """The unit's gradient is complete: reduce-scatter it (unless in no_sync), reshard."""
        with record_function("FSDP::post_backward"):
            self.training_state = TrainingState.POST_BACKWARD
            if self.sync_gradients and self.grads_ready:
                self._reduce_grads()
            self.grads_ready.clear()
            if not self.handle.has_frozen:  # see [Note: frozen parameters]
                self.reshard()

    def abort_backward(self) -> None:
        """From ``end_aborted_backward``: the store agrees, gradients not reduced yet
        are dropped; shard and go idle."""
        self.store.abort_backward()
        self.grads_ready.clear()
        self.handle.drop_flat_grad()
        self.reshard()
        self.training_state = TrainingState.IDLE

    def end_backward(self) -> None:
        """From ``finalize_backward``: every reduction is done; shard and go idle."""
        self.reshard()
        self.store.end_backward()
        self.training_state = TrainingState.IDLE

    def _reduce_grads(self) -> None:
        """Reduce the flat gradient in the reduce dtype with the unit's reducer (see
        [Note: the gradient reducers] in ``reduction``): reduce-scatter, then across
        replicas, then into the shard store (cast to the master dtype, moved to the
        shard device, accumulated or stepped)."""
        handle, root = self.handle, self._root()
        pre, post = self.config.divide_factors(self.data_parallel_size)
        flat = handle.take_flat_grad()
        if pre != 1.0:
            flat.div_(pre)
        shard, pending = self.reducer.reduce_scatter(
            flat, handle.layout.shard_numel, self.key, handle.flat_shapes
        )
        pending.then = functools.partial(self._finish_reduction, shard, post)
        root.add_pending(pending, self.config.bucket_cap_mb * 2**20)

    def _finish_reduction(self, shard: torch.Tensor, divide_by: float) -> None:
        """The reduced shard ``(S,)`` of this rank: across replicas, then to the store."""
        deliver = functools.partial(self.store.accept_grad_shard, divide_by=divide_by)
        later = self.reducer.across_replicas(shard, self.key, self.handle.shard_shapes, deliver)
        if later is not None:  # an all-reduce in flight: finalize_backward waits for it
            self._root().pending.append(later)

    # the trainable set -----------------------------------------------------------
    def refresh_trainable(self) -> bool:
        """Adopt ``requires_grad`` changes (see [Note: the trainable set follows
        requires_grad]); True if something changed."""
        handle, changed = self.handle, False
        for index, info in enumerate(handle.infos):
            sharded, unsharded = handle.sharded_params[index], handle.unsharded_params[index]
            wanted = (
                sharded.requires_grad
                if sharded.requires_grad != info.requires_grad
                else unsharded.requires_grad
            )
            if wanted != info.requires_grad or sharded.requires_grad != wanted:
                handle.set_requires_grad(index, wanted)
                changed = True
        if changed:
            self._update_trainable()
        return changed

    def _update_trainable(self) -> None:
        handle = self.handle
        self.grads_expected = {i for i in handle.trainable if handle.infos[i].numel}
        for index in self.grads_expected - self._hooked:
            handle.unsharded_params[index].register_post_accumulate_grad_hook(
                functools.partial(_post_accumulate_hook, self, index)
            )
            self._hooked.add(index)

    def trainable_names(self) -> list[str]:
        """Names of the unit's parameters that require a gradient, in flat order, in the
        root's model (``blocks.1.fc1.weight``, not the unit-relative ``fc1.weight``)."""
        prefix = f"{self.path}." if self.path else ""
        return [prefix + info.name for info in self.handle.infos if info.requires_grad]

    # summon_full_params ----------------------------------------------------------
    def begin_summon(self, writeback: bool) -> None:
        """Gather the full parameters in the master dtype, afresh from the shards.

        Without ``writeback``, a full buffer that is the local shard itself (one rank,
        no cast) is saved first, so that changes made in the context are undone.
        """
        self.reshard()  # a full buffer kept after forward may be stale or low-precision
        self.handle.use_full_precision(True)
        aliased = not writeback and not self.handle.owns_full_flat
        self._saved_shard = self.handle.local_shard.clone() if aliased else None
        self.unshard()
        self.training_state = TrainingState.SUMMON_FULL_PARAMS

    @torch.no_grad()
    def end_summon(self, writeback: bool) -> None:
        """Write this rank's slice back if it was changed (``writeback``), reshard."""
        handle = self.handle
        if self._saved_shard is not None:
            if not torch.equal(self._saved_shard, handle.local_shard):
                handle.local_shard.copy_(self._saved_shard)
            self._saved_shard = None
        elif writeback and handle.owns_full_flat and self._full_written():
            handle.local_shard.copy_(handle.full_shard_slice())
        self.training_state = TrainingState.IDLE
        self.reshard()
        handle.use_full_precision(False)
        self.store.end_summon()

    def _full_written(self) -> bool:
        """The full buffer was written since it was gathered (its version moved)."""
        return int(self.handle.full_flat._version) != self._full_version

    def busy(self) -> bool:
        """True unless IDLE (forward, backward or a summon is under way)."""
        return self.training_state is not TrainingState.IDLE


@contextlib.contextmanager
def summon(units: list[UnitRuntime], writeback: bool) -> Iterator[None]:
    """``summon_full_params`` over ``units``: full master-dtype parameters inside.

    Raises:
        RuntimeError: a unit is in forward, backward or another summon.
    """
    for root in {id(u.root): u.root for u in units if u.root is not None}.values():
        root.end_aborted_backward()
    busy = [u.training_state.name for u in units if u.busy()]
    if busy:
        where = (
            "inside another summon_full_params() (state_dict() summons too: call it "
            "after leaving the context)"
            if "SUMMON_FULL_PARAMS" in busy
            else "during forward or backward (call it after optimizer.step(), before "
            "the next forward)"
        )
        raise RuntimeError(
            f"summon_full_params needs idle units, found states {busy}: it was called {where}"
        )
    for unit in units:
        unit.begin_summon(writeback)
    try:
        yield
    finally:
        for unit in units:
            unit.end_summon(writeback)


def _tensors_needing_grad(output: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _pre_backward_hook(unit: UnitRuntime, version: int, grad: torch.Tensor) -> None:
    unit.pre_backward(version)


def _post_accumulate_hook(unit: UnitRuntime, index: int, _: torch.Tensor) -> None:
    unit.post_accumulate_grad(index)
