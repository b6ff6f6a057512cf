"""FullyShardedDataParallel: the public wrapper (ZeRO stage 3), built from the parts.

Parameter -> group -> module state -> API, as in torch's FSDP2: ``flat_param`` (one
unit's flat parameter and its views), ``collectives`` (all-gather, reduce-scatter),
``unit`` (the runtime that owns a unit's state and runs its phase hooks), ``root``
(what the units under one root share), ``state_dict`` and ``optim_state``
(checkpoints), and this class: the thin ``nn.Module`` front.

Why this module is long: FullyShardedDataParallel is FairScale's public class, and each
of its many public methods (state dicts, summon_full_params, no_sync, clip_grad_norm_,
...) keeps its FairScale docstring and forwards to the unit runtime in a few lines; the
logic lives in the modules below.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

from shardkit.checkpoint.agreement import gather_failures
from shardkit.distributed.collectives import check_group, group_rank, group_ranks, group_size
from shardkit.distributed.compression import GradCompressor, get_compressor
from shardkit.distributed.consistency import (
    describe_parameters,
    local_checks,
    verify_consistent,
)
from shardkit.distributed.grad_norm import clip_grad_norm_sharded
from shardkit.distributed.hybrid import hybrid_groups
from shardkit.distributed.validation import check_parameters, parameter_problem
from shardkit.nn.data_parallel.fully_sharded import state_dict as sd
from shardkit.nn.data_parallel.fully_sharded.collectives import broadcast_data_parallel
from shardkit.nn.data_parallel.fully_sharded.config import (
    FSDPConfig,
    ShardingStrategy,
    fairscale_config,
    resolve_sharding_strategy,
)
from shardkit.nn.data_parallel.fully_sharded.consolidate import (
    consolidate_shard_weights,
    local_metadata,
)
from shardkit.nn.data_parallel.fully_sharded.disk_tier import (
    DiskOffload,
    check_one_tier,
    refuse_on_disk,
)
from shardkit.nn.data_parallel.fully_sharded.flat_param import FlatParamHandle, ParamInfo
from shardkit.nn.data_parallel.fully_sharded.materialize import (
    ParamInitFn,
    has_meta,
    materialize_unit,
)
from shardkit.nn.data_parallel.fully_sharded.norm_shards import (
    NormScope,
    counted_shards,
    norm_scope,
)
from shardkit.nn.data_parallel.fully_sharded.optim_state import gather_full, shard_full
from shardkit.nn.data_parallel.fully_sharded.placement import (
    Placement,
    default_compute_device,
    meta_init_device,
)
from shardkit.nn.data_parallel.fully_sharded.precision import (
    MixedPrecision,
    cast_buffers,
    cast_floating,
)
from shardkit.nn.data_parallel.fully_sharded.reduction import pick_reducer
from shardkit.nn.data_parallel.fully_sharded.root import in_backward_pass
from shardkit.nn.data_parallel.fully_sharded.sharing import (
    check_same_device_and_dtype,
    collect_params,
    mark_taken,
    walk_unit,
)
from shardkit.nn.data_parallel.fully_sharded.state import TrainingState
from shardkit.nn.data_parallel.fully_sharded.store import MemoryStore, ShardStore
from shardkit.nn.data_parallel.fully_sharded.unit import (
    WRAPPED,
    UnitRuntime,
    as_sharded,
    clean_name,
    is_unit,
    named_units,
    runtime_of,
    summon,
    units_in,
)
from shardkit.nn.forwarding import ForwardingMixin
from shardkit.nn.prefix_hooks import hide_child_prefix

__all__ = ["FSDP", "FullyShardedDataParallel"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _never_traced(fn: _F) -> _F:
    """``fn`` run eagerly, with all it calls, under ``torch.compile`` (a typed
    ``torch.compiler.disable``)."""
    return cast(_F, torch.compiler.disable(fn))


def _exclude_forward_from_tracing() -> None:
    """Apply :func:`_never_traced` to ``FullyShardedDataParallel.forward``, once, at the
    first construction (see [Note: FSDP and torch.compile]).

    Not at import: ``torch.compiler.disable`` imports ``torch._dynamo`` (about 2 s per
    fresh process on the 2-core CI machine, paid by every process that imports
    ``shardkit.nn`` and by every torchrun rank). A forward can only be traced once a
    model was built, so wrapping at the first construction excludes every traced call.
    """
    cls = FullyShardedDataParallel
    if not getattr(cls.forward, "_shardkit_never_traced", False):
        forward = _never_traced(cls.forward)
        forward._shardkit_never_traced = True  # type: ignore[attr-defined]
        cls.forward = forward  # type: ignore[method-assign]


class FullyShardedDataParallel(ForwardingMixin, nn.Module):
    """Shard a module's parameters, gradients and optimizer state across ranks (ZeRO-3).

    Usage: ``model = FSDP(model)`` (nest with :func:`shardkit.nn.wrap.auto_wrap`), then
    build the optimizer from ``model.parameters()`` and train as usual.

    Each unit's parameters are flattened into one buffer padded to a multiple of the
    world size N; rank r keeps slice r. Before the unit's forward the buffer is
    all-gathered, after it freed (``reshard_after_forward``); before its backward it is
    all-gathered again, and after it the gradient is reduce-scattered (averaged over
    ranks, DDP semantics) so each rank keeps the gradient of its slice. The next unit's
    all-gather is issued early (prefetch) in forward and backward. ``named_parameters()``
    returns the original names (no wrapper prefixes) with 1-D sharded parameters (see
    [Note: flat layout, original parameters] in ``flat_param``).

    Memory per rank (fp32 Adam, psi parameters): ``16 psi / N`` plus the largest unit's
    full parameters (two with prefetch) plus the root's, plus padding (< N per unit).
    With mixed precision the full parameters take 2 bytes per element instead of 4;
    with ``move_params_to_cpu`` the ``16 psi / N`` live in CPU memory.

    Source: Rajbhandari et al. 2020, "ZeRO", section 5.3 (P_os+g+p); FairScale's
    ``FullyShardedDataParallel`` (argument names and defaults) and torch's FSDP2.

    Args:
        module: the module to wrap; nested units inside it must already be wrapped.
        process_group: the ranks sharing this unit; default None: the world group. With
            a hybrid ``sharding_strategy``: a ``(shard group, replica group)`` pair (e.g.
            from ``shardkit.distributed.hybrid.hybrid_groups`` or a process mesh), or
            None for shard groups of torchrun's ``LOCAL_WORLD_SIZE`` ranks.
        reshard_after_forward: free full parameters after forward, all-gather again in
            backward. Default True. An int M (1 < M < N, dividing N, over the world
            group): keep 1/M of them for backward in groups of M consecutive ranks (a
            node), so backward's all-gather stays inside the node (ZeRO++'s hpZ; torch
            FSDP2's int). 1 is False, N is True.
        disable_reshard_on_root: keep the root's full parameters after forward. Default True.
        mixed_precision: True (FairScale: compute in ``compute_dtype``) or a
            :class:`~.precision.MixedPrecision` policy; False/None: no casts. Master
            shards, their gradients and the optimizer state stay in the parameters' dtype.
            Default False.
        fp32_reduce_scatter: with ``mixed_precision=True``, reduce-scatter gradients in
            fp32 instead of the compute dtype. Default False.
        flatten_parameters: accepted for FairScale compatibility, True or False: a unit
            always communicates one flat buffer and exposes the original parameters.
        move_params_to_cpu: keep master shards, gradients and optimizer state in CPU
            memory (pinned when computing on CUDA); the optimizer steps on CPU. Default False.
        compute_dtype: with ``mixed_precision=True``, the dtype of forward and backward
            (``torch.float16`` or ``torch.bfloat16``). Default None: fp16 (FairScale's).
        buffer_dtype: with ``mixed_precision=True``, the dtype floating buffers are cast
            to. Default None: ``compute_dtype``.
        move_grads_to_cpu: must equal ``move_params_to_cpu`` (its default).
        bucket_cap_mb: megabytes of gradient reduce-scatters in flight before waiting.
            Default 25.
        compute_device: device for the full parameters; default None: the parameters',
            or the current CUDA device when offloading (the CPU when there is none).
        state_dict_device: device of ``state_dict()`` tensors; default None: compute device.
        cpu_offload: FairScale's older name of ``move_params_to_cpu``. Default False.
        state_dict_on_rank_0_only: full ``state_dict()`` on the group's first rank only,
            ``{}`` elsewhere. Default False.
        gradient_predivide_factor: divide gradients by this before the reduce-scatter and
            by ``N / factor`` after. Default None (1).
        param_init_fn: for a module built on the meta device (deferred initialisation:
            each unit materialises only its own modules, so no rank holds the whole
            model), called on each module owning meta tensors; it must materialise and
            initialise that module's own tensors (e.g. ``to_empty(device=...,
            recurse=False)`` then an init). Default None: ``to_empty`` and the module's
            ``reset_parameters()``. The tensors go to ``compute_device`` (default: the
            current CUDA device, else the CPU). See [Note: deferred initialisation].
        sharding_strategy: ``ShardingStrategy`` or its name: ``FULL_SHARD`` (default),
            ``SHARD_GRAD_OP`` (keep full parameters from forward to backward),
            ``HYBRID_SHARD`` (full shard inside a shard group, replicas across groups:
            gradients reduce-scattered inside, then each 1/S shard all-reduced across
            the R replicas), ``HYBRID_SHARD_ZERO2``.
        grad_compression: a :class:`~shardkit.distributed.compression.GradCompressor`
            or its name (``"bf16"``, ``"fp16"``, ``"powersgd"``, ``"int8"``) for the
            gradient reduction over the slowest link: the cross-replica all-reduce of a
            hybrid strategy (inside a node stays exact), else the reduce-scatter.
            Default None: exact. Share one compressor across the units of a model (its
            error-feedback state is kept per unit).
        broadcast_buffers: as torch DDP's ``broadcast_buffers`` (``forward_sync_buffers``):
            the root broadcasts the group's first rank's buffers before the first forward
            and before each forward that follows a forward run with grad enabled outside
            ``no_sync`` (in train or eval mode, inside ``summon_full_params`` too): once
            per step with ``no_sync`` accumulation, before its first micro-batch. Each
            rank's buffers then equal torch DDP's on that rank after every forward,
            backward, step and ``state_dict()``. Either way each unit broadcasts its own
            buffers at construction, as its parameters; False: only then (DDP's
            ``forward_sync_buffers=False``), so they may drift apart across ranks.
            Default True.
        disk_offload: a :class:`~.disk_tier.DiskOffload` (the same object for every unit
            of the model): each unit's shard and optimizer state live in files and the
            optimizer steps unit by unit inside backward (ZeRO-Infinity's NVMe offload;
            see :mod:`.disk_tier`). Not with hybrid strategies. Default None: in memory.

    Raises:
        TypeError: a parameter has an integer, bool or complex dtype.
        ValueError: part of ``module`` is sharded already (a submodule of an FSDP unit
            wrapped again), its parameters mix devices or dtypes, an option is invalid, or a meta module has
            no ``reset_parameters()`` and no ``param_init_fn`` was given.
        SharedParameterError: a tied parameter would be split across two units.
        PeerRejectedError: (a ``ConsistencyError``) another rank of the group raised
            one of the errors above, or its ``param_init_fn`` failed, while preparing the
            same unit: every rank stops at once instead of waiting for it.

    Note:
        ``module`` may itself be an FSDP unit (FairScale's ``auto_wrap`` wraps the root
        when the policy says so, and scripts then wrap the result again): the new unit
        holds no parameters of its own and becomes the root.

        The trainable set follows ``requires_grad`` after wrapping: freezing or
        unfreezing parameters (from ``named_parameters()``) takes effect at the next
        forward with grad enabled, on every rank (checked: ranks that disagree raise
        ``TrainableMismatchError`` naming the parameters).

    Warning:
        Build the optimizer after wrapping: one built before holds the replaced
        parameters; its ``step()`` raises ``ValueError``. Loading or stepping between a
        forward and its backward raises ``ParametersChangedError`` in the backward.
    """

    _shardkit_wrapper_unit = True  # shardkit.nn.wrap: already a wrapper unit

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup
        | tuple[dist.ProcessGroup, dist.ProcessGroup]
        | None = None,
        reshard_after_forward: bool | int = True,
        disable_reshard_on_root: bool = True,
        mixed_precision: bool | MixedPrecision | None = False,
        fp32_reduce_scatter: bool = False,
        flatten_parameters: bool = True,
        move_params_to_cpu: bool = False,
        compute_dtype: torch.dtype | None = None,
        buffer_dtype: torch.dtype | None = None,
        move_grads_to_cpu: bool | None = None,
        bucket_cap_mb: float = 25.0,
        compute_device: torch.device | str | None = None,
        state_dict_device: torch.device | str | None = None,
        cpu_offload: bool = False,
        state_dict_on_rank_0_only: bool = False,
        gradient_predivide_factor: float | None = None,
        param_init_fn: ParamInitFn | None = None,
        broadcast_buffers: bool = True,
        sharding_strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
        grad_compression: GradCompressor | str | None = None,
        disk_offload: DiskOffload | None = None,
    ) -> None:
        strategy = resolve_sharding_strategy(sharding_strategy)
        if disk_offload is not None and strategy.hybrid:
            raise ValueError(
                f"disk_offload works with FULL_SHARD and SHARD_GRAD_OP, not {strategy.name} "
                "(its cross-replica all-reduce would finish after the unit's step)"
            )
        shard_group, replicate_group = _resolve_groups(process_group, strategy)
        reshard_after_forward, secondary = _resolve_reshard(reshard_after_forward, shard_group)
        with local_checks(_what(module), shard_group):  # an error here stops every rank
            config = fairscale_config(
                mixed_precision,
                fp32_reduce_scatter,
                compute_dtype,
                buffer_dtype,
                move_params_to_cpu,
                cpu_offload,
                move_grads_to_cpu,
                compute_device,
                state_dict_device,
                reshard_after_forward=reshard_after_forward
                and not strategy.keeps_params_after_forward,
                disable_reshard_on_root=disable_reshard_on_root,
                flatten_parameters=flatten_parameters,
                bucket_cap_mb=bucket_cap_mb,
                state_dict_on_rank_0_only=state_dict_on_rank_0_only,
                gradient_predivide_factor=gradient_predivide_factor,
                broadcast_buffers=broadcast_buffers,
                sharding_strategy=strategy,
                grad_compression=get_compressor(grad_compression),
            )
        _exclude_forward_from_tracing()
        super().__init__()
        self._config = config
        self._process_group = shard_group
        self._replicate_group = replicate_group
        self._secondary_group = secondary
        self._param_init_fn = param_init_fn
        self._disk_offload = disk_offload
        self._norm_scope: NormScope | None = None  # clip_grad_norm_'s, found at its first call
        self._fsdp_wrapped_module = module
        self._unit = self._build_unit(module)
        self._register_state_dict_hooks(module)

    # construction --------------------------------------------------------------
    def _build_unit(self, module: nn.Module) -> UnitRuntime:
        rank, world_size = (
            group_rank(self._process_group),
            group_size(self._process_group),
        )
        label, what = _label(module), _what(module)
        options = {  # not devices: cuda:0 on rank 0 and cuda:1 on rank 1 is normal
            "reshard_after_forward": self._config.reshard_after_forward,
            "reshard_group": 0
            if self._secondary_group is None
            else group_size(self._secondary_group),
            "mixed_precision": self._config.mixed_precision,
            "broadcast_buffers": self._config.broadcast_buffers,
            "sharding_strategy": self._config.sharding_strategy.name,
            "grad_compression": repr(self._config.grad_compression),
        }
        group = self._process_group
        with local_checks(what, group, catch=(Exception,)):  # incl. a failing param_init_fn
            infos, originals = self._prepare_unit(module, label)
        verify_consistent(  # one collective: a mismatch is an error, not a hang
            describe_parameters((info.name, p) for info, p in zip(infos, originals)),
            what=what,
            group=group,
            options=options,
        )
        placement = _placement(self._config, originals, module, self._disk_offload is not None)
        _move_buffers(module, placement.compute_device)
        mp = self._config.mixed_precision
        buffers = [(m, a) for _, m in _own_modules(module) for a in m._buffers]
        casts = cast_buffers(buffers, mp.buffer_dtype) if mp and mp.buffer_dtype else []
        flat = _flatten(originals, module).to(placement.compute_device)
        own_buffers = [b for m, a in buffers if (b := m._buffers[a]) is not None]
        with torch.no_grad():  # rank 0's init wins, for parameters and buffers (DDP's)
            broadcast_data_parallel([flat, *own_buffers], group, self._replicate_group)
        handle = FlatParamHandle(infos, flat, rank, world_size, placement)
        mark_taken(originals, infos, label, handle.sharded_params)
        for param in originals:  # release the replaced parameters' memory
            param.data = param.data.new_empty(0)
        return UnitRuntime(
            self,
            handle,
            self._config,
            self._shard_store(handle, label),
            pick_reducer(
                self._config.grad_compression,
                group,
                self._replicate_group,
                label,
                handle.sharded_params,
            ),
            group,
            casts,
            label,
            self._replicate_group,
            self._secondary_group,
        )

    def _shard_store(self, handle: FlatParamHandle, label: str) -> ShardStore:
        """The unit's shard store, picked once from the options: the disk tier's files
        (``disk_offload``, a unit holding parameters) or memory."""
        if self._disk_offload is not None and handle.infos:
            return self._disk_offload.attach(handle, label, self._process_group)
        return MemoryStore(handle)

    def _prepare_unit(
        self, module: nn.Module, label: str
    ) -> tuple[list[ParamInfo], list[nn.Parameter]]:
        """This rank's own checks and deferred initialisation (no collective)."""
        if is_unit(module):  # FairScale's auto_wrap-then-FSDP: an outer unit, no parameters
            return [], []
        check_parameters("FullyShardedDataParallel", module.named_parameters(), allow_meta=True)
        if has_meta(module, is_unit):  # deferred init: see the note in .materialize
            device = self._config.compute_device or meta_init_device()
            materialize_unit(module, is_unit, device, self._param_init_fn)
        infos = collect_params(module, is_unit, label)
        check_same_device_and_dtype(infos, module)
        originals = [_original(info) for info in infos]
        problem = parameter_problem(  # no two parts of a split tensor (MoE experts, tp)
            "FullyShardedDataParallel",
            ((info.name, p) for info, p in zip(infos, originals, strict=True)),
            allow_meta=True,
            reduce_ranks=self._reduce_ranks(),
        )
        if problem is not None:
            raise problem
        return infos, originals

    def _reduce_ranks(self) -> set[int] | None:
        """The global ranks this rank's gradients are averaged with: its shard group and,
        under hybrid sharding, its replica group (None: one process, no group)."""
        if not dist.is_available() or not dist.is_initialized():
            return None
        ranks = set(group_ranks(self._process_group))  # None: the world
        if self._replicate_group is not None:
            ranks.update(group_ranks(self._replicate_group))
        return ranks

    def _register_state_dict_hooks(self, module: nn.Module) -> None:
        hide_child_prefix(self, WRAPPED, on_save=False)  # state_dict() is full_state_dict
        for _, mod in _own_modules(module):
            mod.register_state_dict_pre_hook(
                functools.partial(sd.refuse_direct_state_dict, self._unit)
            )

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    @property
    def flatten_parameters(self) -> bool:
        """FairScale's flag, as given (every unit communicates one flat buffer anyway)."""
        return self._config.flatten_parameters

    # attributes the wrapper lacks (e.g. ``model.config``) are the wrapped module's
    _forward_to = WRAPPED

    def _lazy_init(self) -> None:
        """First call on a unit with no root: it becomes the root of its subtree."""
        if self._unit.root is None:
            for name, module in self.named_modules():  # names in the root's model
                runtime = runtime_of(module)
                if runtime is not None:
                    runtime.path = clean_name(name + ".").rstrip(".")
            self._unit.become_root(units_in(self), self._config.broadcast_buffers)
            check_one_tier(units_in(self))

    # forward -------------------------------------------------------------------
    # [Note: FSDP and torch.compile]
    # The forward runs the unit's hooks: all-gathers, state transitions, tensor hooks
    # registered on the outputs. Traced by dynamo (the wrapped model compiled as a
    # whole), these Python side effects recompile at every state change and end in a
    # wrong ParametersChangedError. So the forward is excluded from tracing, with all it
    # calls: compiling an FSDP model as a whole compiles nothing around the units, while
    # blocks compiled before wrapping (``block.compile()``, the documented order, as
    # torch's FSDP2 per-block compile) still run compiled inside it. The exclusion is
    # applied at the first construction (_exclude_forward_from_tracing), not at import.
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module with its full parameters (see the class docstring).

        Never traced by ``torch.compile`` (compile the blocks before wrapping them).
        """
        unit = self._unit
        if unit.training_state is TrainingState.SUMMON_FULL_PARAMS:
            # Inside summon_full_params (e.g. generate()): the parameters are already
            # full; the forward hooks would reshard them under the context's feet. The
            # buffers still follow DDP's rule ([Note: buffers follow torch DDP] in .root).
            self._lazy_init()
            root = unit.root if unit.is_root else None
            if root is not None:
                root.buffers_before_forward()
            output = self.module(*args, **kwargs)
            if root is not None:
                root.buffers_after_forward(unit.sync_gradients)
            return output
        self._lazy_init()
        unit.pre_forward()
        mp = self._config.mixed_precision
        if mp is not None and mp.cast_forward_inputs:
            args, kwargs = cast_floating((args, kwargs), unit.handle.placement.compute_dtype)
        try:
            output = self.module(*args, **kwargs)
        except BaseException:
            # not inside a backward: activation checkpointing's recomputation there
            # stops early by raising through the forward, and the unit is in its backward
            if not in_backward_pass():
                unit.abort_forward()
            raise
        unit.post_forward(output)
        return output

    # names ---------------------------------------------------------------------
    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters under their original names (no wrapper prefixes).

        Between steps these are the sharded parameters (1-D pieces), also while a unit
        still holds its full parameters after a forward whose backward has not run:
        an optimizer built then steps the shards, the one current copy. Inside
        ``summon_full_params`` (and during forward and backward) they are the full ones.
        """
        units = units_in(self) if recurse else [self._unit]
        runtimes = [unit for unit in units if unit.has_leftover_full]
        seen: set[int] = set()
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate=False):
            param = as_sharded(runtimes, param)
            if remove_duplicate:
                if id(param) in seen:
                    continue
                seen.add(id(param))
            yield clean_name(name), param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The buffers under their original names (no wrapper prefixes)."""
        for name, buf in super().named_buffers(prefix, recurse, remove_duplicate):
            yield clean_name(name), buf

    def units(self) -> list[FullyShardedDataParallel]:
        """This unit and every unit nested in it, in module order."""
        return [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)]

    # user-facing contexts ------------------------------------------------------
    @contextlib.contextmanager
    def summon_full_params(self, recurse: bool = True, writeback: bool = True) -> Iterator[None]:
        """A context in which the module holds its full parameters (original shapes).

        The full parameters are gathered afresh from the shards (the one current copy),
        in the master dtype.

        Args:
            recurse: also unshard every nested unit. Default True.
            writeback: copy changes of this rank's slice back into its shard on exit
                (change parameters under ``torch.no_grad()``). Default True.

        Raises:
            RuntimeError: called during forward or backward, or nested in another
                ``summon_full_params()`` (``state_dict()`` inside one, too).
        """
        with summon(units_in(self) if recurse else [self._unit], writeback):
            yield

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without communication (each rank keeps full gradients).

        Inside, backward keeps every unit's full gradient (psi elements per rank); the
        first backward outside reduce-scatters the accumulated sum. Without ``no_sync``
        accumulation is also correct and keeps only sharded gradients. As DDP's
        ``no_sync``, the forward after one inside does not broadcast buffers (see
        ``broadcast_buffers``).
        """
        units = units_in(self)
        for unit in units:
            unit.sync_gradients = False
        try:
            yield
        finally:
            for unit in units:
                unit.sync_gradients = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad`` (the sharded parameters' ``.grad``), the full
        gradients accumulated inside :meth:`no_sync` since the last synchronised
        backward, and the gradient shards hybrid sharding deferred inside
        :meth:`no_replica_sync`: as ``zero_grad`` of the plain or DDP model, a micro-batch dropped this
        way does not reach the next step. The optimizer's ``zero_grad()`` clears only the
        sharded gradients it holds (as with torch FSDP2), so after a ``no_sync``
        micro-batch that is to be dropped call this one.

        Raises:
            RuntimeError: called during a forward or backward of a unit.
        """
        units = units_in(self)
        if self._unit.root is not None:
            self._unit.root.end_aborted_backward()
        busy = [u.label for u in units if u.busy()]
        if busy:
            raise RuntimeError(
                f"zero_grad() during the forward or backward of {busy[0]}: call it between "
                "steps (a backward's gradients are still being reduced)"
            )
        super().zero_grad(set_to_none)
        for unit in units:
            unit.handle.drop_flat_grad()
            unit.reducer.drop_deferred()

    def set_requires_all_reduce(self, requires_all_reduce: bool) -> None:
        """Hybrid sharding: all-reduce gradient shards across replicas at the end of each
        backward (True, the default) or defer them (False), for every unit.

        With False, each backward still reduce-scatters inside the shard group and the
        shards accumulate locally; the first backward after ``True`` is set again sends
        the accumulated sum across replicas once (gradient accumulation of k micro-batches
        crosses the slow link once, not k times). Set True before the last micro-batch's
        backward: deferred shards are not in ``.grad`` until then. torch FSDP2's name;
        :meth:`no_replica_sync` is the context-manager form. No effect without replicas.
        """
        for unit in units_in(self):
            unit.reducer.requires_all_reduce = requires_all_reduce

    @contextlib.contextmanager
    def no_replica_sync(self) -> Iterator[None]:
        """Inside, backward defers the cross-replica all-reduce (see
        :meth:`set_requires_all_reduce`); intra-node reduce-scatters still run."""
        self.set_requires_all_reduce(False)
        try:
            yield
        finally:
            self.set_requires_all_reduce(True)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their global norm; same result as torch's on the unwrapped model.

        Args:
            max_norm: largest allowed norm.
            norm_type: p of the p-norm (``float('inf')`` for the max norm). Default 2.

        Returns:
            The total norm before clipping (a scalar tensor, equal on every rank).

        Each element is counted once over the root's ranks (its shard group and, under
        hybrid sharding, its replica group): hybrid units on replica rank 0 only, nested
        units over another group (an MoE's experts over the expert-data-parallel group)
        by their shard descriptors (see :mod:`.norm_shards`). A tensor-parallel model
        wrapped over the data-parallel group is summed over its tensor-parallel group
        too (the group its layers hold), its replicated parameters (LayerNorms,
        row-parallel biases) counted on tensor-parallel rank 0 only: the norm of the
        whole model, the same on every rank. Where to sum is found at the first call
        (under hybrid sharding, one all-gather of the shard group's ranks) and kept on
        this module; every call then costs one all-reduce of one element per group.

        Raises:
            RuntimeError: the model is on a disk tier (its units step inside backward).
            ValueError: a nested unit's shards have copies the norm cannot tell apart
                (a unit over a subgroup, neither expert parts nor hybrid); parameters
                split over ranks outside the root's in more than one way, or over ranks
                no module holds a process group of.
        """
        units = units_in(self)
        refuse_on_disk(units, "clip_grad_norm_")
        if self._norm_scope is None:  # groups and units are fixed: found once
            self._norm_scope = norm_scope(
                units, self._process_group, self._replicate_group, self.modules()
            )
        counted, copies = counted_shards(units, self._norm_scope)
        groups = list(self._norm_scope.groups)
        return clip_grad_norm_sharded(counted, max_norm, norm_type, groups, copies=copies)

    # state dicts ---------------------------------------------------------------
    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The full, unsharded state dict with the unwrapped module's keys.

        Every rank gathers; with ``state_dict_on_rank_0_only`` other ranks get ``{}``.
        Tensors are copies on ``state_dict_device``.
        """
        return sd.full_state_dict(self, self._unit, destination, prefix, keep_vars)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a full state dict (the unwrapped module's keys) on every rank.

        A load that raises (a missing or unexpected key with ``strict``, another
        shape: torch's ``load_state_dict`` copies every tensor it can before raising)
        leaves the shards and buffers as they were (a copy of them is kept meanwhile;
        units on the disk tier excepted: their shards are files). The ranks agree
        first: when the state dict fails to load on any rank, every rank of the group
        (and its replicas under hybrid sharding) keeps its values and raises.

        Raises:
            RuntimeError: torch's "Error(s) in loading state_dict" (keys, shapes),
                naming the unwrapped keys; on the other ranks, the same error naming
                the rank it failed on.
        """
        units = units_in(self)
        kept = [u.handle.local_shard for u in units if u.store.in_memory]
        kept += [buf for _, buf in self.named_buffers()]
        before = [t.detach().clone() for t in kept]

        def restore() -> None:
            with torch.no_grad():
                for tensor, value in zip(kept, before):
                    tensor.copy_(value)

        error: Exception | None = None
        result: Any = None
        try:
            with self.summon_full_params(recurse=True, writeback=True), torch.no_grad():
                result = super().load_state_dict(state_dict, strict=strict)
        except Exception as err:  # told to every rank below: all load, or none
            error = err
        except BaseException:
            restore()
            raise
        # A rank whose state dict does not fit must not leave the others loaded: each
        # rank holds 1/N of every parameter, so some ranks loading and others not gives
        # parameters that are neither the old values nor the new ones.
        groups = [self._process_group]
        if self._replicate_group is not None:
            groups.append(self._replicate_group)
        me = dist.get_rank() if dist.is_initialized() else 0
        failed = gather_failures(me, error, groups)
        if not failed:
            return result
        restore()
        if error is None:
            raise RuntimeError(
                "Error(s) in loading state_dict for FullyShardedDataParallel: the load "
                f"failed on another rank ({failed}); this rank's shards and buffers are "
                "kept as they were, as on every rank"
            )
        if isinstance(error, RuntimeError) and f"{WRAPPED}." in str(error):
            # torch names the keys as it reached them (size mismatches): unwrapped
            raise RuntimeError(clean_name(str(error))) from error
        raise error

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards: ``"<unit>flat_param"`` per unit, and the buffers.

        Raises:
            RuntimeError: the model is on a disk tier (the shards are in its files).
        """
        refuse_on_disk(units_in(self), "local_state_dict")
        return sd.local_state_dict(self)

    def load_local_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load what :meth:`local_state_dict` returned (same world size and wrapping).

        Raises:
            RuntimeError: the model is on a disk tier (the shards are in its files).
        """
        refuse_on_disk(units_in(self), "load_local_state_dict")
        sd.load_local_state_dict(self, state)

    def local_metadata_dict(self) -> dict[str, Any]:
        """What :meth:`consolidate_shard_weights` needs to merge this rank's
        :meth:`local_state_dict` offline (FairScale's layout; plain JSON-able data)."""
        units = {key: (u.handle.infos, u.handle.layout) for key, u in named_units(self).items()}
        return local_metadata(units, [n for n, _ in self.named_buffers()], self._unit.rank)

    @staticmethod
    def consolidate_shard_weights(
        shard_weights: Sequence[Mapping[str, torch.Tensor]],
        shard_metadata: Sequence[Mapping[str, Any]],
        with_module_buffers: bool = True,
        strict: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Merge every rank's :meth:`local_state_dict` (with its
        :meth:`local_metadata_dict`) into the unwrapped model's full state dict, offline
        (fairseq's workflow; no process group). See
        :func:`~.consolidate.consolidate_shard_weights`."""
        return consolidate_shard_weights(
            shard_weights, shard_metadata, with_module_buffers=with_module_buffers, strict=strict
        )

    # optimizer state -----------------------------------------------------------
    def gather_full_optim_state_dict(
        self, optim: torch.optim.Optimizer, recipient_rank: int = 0
    ) -> dict[str, Any] | None:
        """The optimizer state of the unwrapped model, on group rank ``recipient_rank``.

        A collective (every rank calls it); other ranks get None.

        Raises:
            RuntimeError: the model is on a disk tier (the state is in its files).
        """
        refuse_on_disk(units_in(self), "gather_full_optim_state_dict")
        return gather_full(self, optim, recipient_rank)

    def get_shard_from_optim_state_dict(
        self, full: Mapping[str, Any], optim: torch.optim.Optimizer | None = None
    ) -> dict[str, Any]:
        """This rank's share of a full optimizer state dict, for ``optim.load_state_dict``.

        Pass ``optim`` (or build it from ``named_parameters()``) when its parameter order
        differs from ``parameters()`` (e.g. groups chosen by name).

        Raises:
            RuntimeError: the model is on a disk tier (the state is in its files).
        """
        refuse_on_disk(units_in(self), "get_shard_from_optim_state_dict")
        return shard_full(self, full, optim)


FSDP = FullyShardedDataParallel


def _label(module: nn.Module) -> str:
    return f"the FSDP unit wrapping {type(module).__name__}"


def _what(module: nn.Module) -> str:
    """The wrapper named in the wrap-time exchange's errors."""
    return f"FullyShardedDataParallel ({_label(module)})"


Groups = tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]


def _resolve_reshard(
    reshard_after_forward: bool | int, shard_group: dist.ProcessGroup | None
) -> tuple[bool, dist.ProcessGroup | None]:
    """(reshard after forward, secondary group or None) from the argument.

    An int M keeps 1/M of the full parameters for backward; M = 1 keeps them whole
    (as False), M = the group size keeps this rank's shard only (as True).

    Raises:
        TypeError: neither a bool nor an int (a float such as 1.5 was truncated before).
        ValueError: an int below 1, one that does not divide the group size, or an int
            with a subgroup (hybrid sharding already keeps all-gathers inside a node).
    """
    if isinstance(reshard_after_forward, bool):
        return reshard_after_forward, None
    try:
        size = operator.index(reshard_after_forward)  # int, numpy integers; not 1.5
    except TypeError:
        raise TypeError(
            f"reshard_after_forward must be a bool or an int (ranks per group); got "
            f"{reshard_after_forward!r} ({type(reshard_after_forward).__name__})"
        ) from None
    world = group_size(shard_group)
    if size < 1:
        raise ValueError(
            f"reshard_after_forward={size}: an int must be >= 1 (the ranks of a group that "
            "keeps a unit's parameters for backward); use True or False otherwise"
        )
    if world % size:
        raise ValueError(
            f"reshard_after_forward={size} must divide the group's {world} ranks (groups "
            f"of {size} consecutive ranks keep 1/{size} of a unit's parameters for backward)"
        )
    if size in (1, world):
        return size == world, None
    if group_size(shard_group) != dist.get_world_size():
        raise ValueError(
            f"reshard_after_forward={size} (an int) works over the world group; with a "
            "subgroup or hybrid sharding the all-gathers are inside the group already: "
            "pass True or False"
        )
    return True, hybrid_groups(size).shard


def _resolve_groups(
    process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None,
    strategy: ShardingStrategy,
) -> Groups:
    """(shard group, replica group or None) from FSDP's ``process_group`` argument.

    Raises:
        ValueError: a pair of groups without a hybrid strategy, or a single group with
            one (a hybrid unit needs both; None builds them from ``LOCAL_WORLD_SIZE``).
    """
    if isinstance(process_group, tuple):
        if not strategy.hybrid:
            raise ValueError(
                f"process_group is a (shard, replicate) pair but sharding_strategy is "
                f"{strategy.name}; pass sharding_strategy='HYBRID_SHARD' or one group"
            )
        shard, replicate = process_group
        return shard, replicate
    if not strategy.hybrid:
        check_group(process_group, "FullyShardedDataParallel")
        return process_group, None
    if process_group is not None:
        raise ValueError(
            f"sharding_strategy={strategy.name} needs a (shard group, replica group) pair "
            "as process_group, or None (shard groups of LOCAL_WORLD_SIZE ranks); got one group"
        )
    groups = hybrid_groups()
    return groups.shard, groups.replicate


def _own_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules whose parameters and buffers the unit wrapping ``module`` takes
    (none when ``module`` is itself a unit)."""
    return [] if is_unit(module) else list(walk_unit(module, is_unit))


def _original(info: ParamInfo) -> nn.Parameter:
    loc = info.locations[0]
    param = loc.module._parameters[loc.attr]
    assert isinstance(param, nn.Parameter)
    return param


def _placement(
    config: FSDPConfig, originals: list[nn.Parameter], module: nn.Module, on_disk: bool
) -> Placement:
    """Devices and dtypes of a unit from its options and its (checked) parameters."""
    first = originals[0] if originals else next(iter(module.buffers()), torch.empty(0))
    master = first.dtype if first.is_floating_point() else torch.get_default_dtype()
    offload = config.move_params_to_cpu
    compute = config.compute_device or default_compute_device(first.device, offload)
    mp = config.mixed_precision or MixedPrecision()
    return Placement(
        compute_device=compute,
        shard_device=torch.device("cpu") if offload or on_disk else compute,
        master_dtype=master,
        compute_dtype=mp.compute_dtype(master),
        reduce_dtype=mp.gradient_dtype(master),
        on_disk=on_disk,
    )


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    """The unit's own buffers (not nested units') to ``device``; the parameters move
    as one flat buffer (nested units' shards stay where their unit put them)."""
    for _, mod in _own_modules(module):
        for attr, buf in mod._buffers.items():
            if buf is not None:
                mod._buffers[attr] = buf.to(device)


def _flatten(params: list[nn.Parameter], module: nn.Module) -> torch.Tensor:
    if not params:
        return torch.empty(0, device=next(iter(module.buffers()), torch.empty(0)).device)
    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1) for p in params])
