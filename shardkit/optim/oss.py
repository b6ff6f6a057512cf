"""OSS: optimizer state sharding (ZeRO stage 1) around any ``torch.optim.Optimizer``.

[Note: the two views of the param groups]
``OSS.param_groups`` is the *full view*: every parameter the user passed, in the user's
groups, with every hyperparameter (what an LR scheduler or the user reads and writes).
``OSS.optim`` is the *local optimizer*: an instance of the wrapped class over the same
groups, each filtered to the parameters this rank owns (a group may be empty on a
rank). Group ``i`` of one view is group ``i`` of the other; hyperparameters flow from
the full view to the local optimizer before each step and back after it, so a change
made by a scheduler between steps reaches the step.

[Note: the step]
1. If some ``requires_grad`` changed since the partition was made, re-partition
   (:meth:`OSS.refresh_trainable`, a collective that moves the affected state).
2. The local optimizer steps its shard (only there is optimizer state created).
3. Each owner broadcasts its updated parameters, packed into buckets of
   ``broadcast_buffer_size`` bytes (:func:`shardkit.distributed.broadcast_from_owners`):
   the number of broadcasts per step is about ``total bytes / bucket bytes + N``,
   independent of the number of parameters.

Source: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", section 5.1 (P_os); the public surface follows FairScale's
``fairscale.optim.OSS``.

Why this module is long: the OSS class is FairScale's public surface on one Optimizer
subclass (step, the two views of the param groups, full and sharded state dicts,
consolidation, refresh_trainable, clip_grad_norm, the broadcast of updated parameters);
the partition (partition.py) and the reduce-to-owner hook (oss_comm_hook.py) are already
apart.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.profiler import record_function

from shardkit.checkpoint.sharded_optim import merge_optimizer_shards
from shardkit.checkpoint.universal import load_universal, save_universal
from shardkit.checkpoint.universal.shardfile import shard_file_name
from shardkit.distributed import (
    DEFAULT_BUCKET_BYTES,
    BufferPool,
    broadcast_from_owners,
    check_group,
    global_rank,
    group_rank,
    group_ranks,
    group_size,
    plan_owner_broadcast,
)
from shardkit.distributed.consistency import (
    describe_parameters,
    local_checks,
    verify_consistent,
)
from shardkit.distributed.failures import collective_context
from shardkit.distributed.grad_norm import clip_grad_norm_sharded, held_outside
from shardkit.distributed.shard_descriptor import view_of
from shardkit.distributed.validation import parameter_problem
from shardkit.optim.partition import partition_sizes

__all__ = ["OSS"]

StateDict = dict[str, Any]

# A parameter of at least 1 MiB is broadcast in place: the copy in and out of a bucket
# costs more than the latency of one more broadcast (measured on gloo, CPU).
_DIRECT_BYTES = 2**20


def _check_optim_class(optim: Any) -> type[Optimizer]:
    if isinstance(optim, type) and issubclass(optim, OSS):
        raise TypeError(
            "OSS(optim=OSS) would shard an already sharded optimizer: pass the inner "
            "optimizer class, e.g. OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)"
        )
    if isinstance(optim, type) and issubclass(optim, Optimizer):
        return optim
    raise TypeError(
        f"OSS(optim=...) takes an optimizer class such as torch.optim.AdamW; got {optim!r} "
        f"of type {type(optim).__name__}. Pass the class and its arguments, not an "
        "instance: OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)"
    )


def _one_group(
    process_group: dist.ProcessGroup | None, group: dist.ProcessGroup | None
) -> dist.ProcessGroup | None:
    """The process group given as ``process_group`` or by its alias ``group``.

    Raises:
        ValueError: both are given and are not the same group object.
    """
    if process_group is not None and group is not None and process_group is not group:
        raise ValueError(
            f"OSS got process_group={process_group!r} and group={group!r}: group is "
            "FairScale's name for process_group; pass one of them"
        )
    return group if process_group is None else process_group


def _no_parameters() -> ValueError:
    return ValueError(
        "OSS got an empty parameter list: pass model.parameters() (a generator "
        "can be consumed only once; pass it to one optimizer only)"
    )


def _param_list(params: Iterable[Any]) -> list[Any]:
    """``params`` as a list; refuses an optimizer (wrapping twice) and an empty list."""
    if isinstance(params, Optimizer):
        raise TypeError(
            f"OSS got an instance of {type(params).__name__} as its parameters (wrapping an "
            "optimizer twice); pass the parameters and the optimizer class instead: "
            "OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)"
        )
    param_list = list(params)
    if not param_list:
        raise _no_parameters()
    return param_list


def _full_defaults(optim: type[Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    """Every hyperparameter of ``optim`` with the user's values (as a plain one would have)."""
    try:
        return dict(optim([{"params": []}], **defaults).defaults)
    except (ValueError, TypeError, IndexError):
        return dict(defaults)


def _pack_groups(groups: list[dict[str, Any]], index: dict[torch.Tensor, int]) -> list[StateDict]:
    """Param groups in the layout of ``torch.optim.Optimizer.state_dict()``."""
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in g["params"]]}
        for g in groups
    ]


def _to_device(obj: Any, device: torch.device | str) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


class OSS(Optimizer):
    """Wrap an optimizer class so each rank keeps the state of only its shard (ZeRO-1).

    Example::

        model = DDP(model)                                  # gradients all-reduced
        optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=3e-4)
        for x, y in loader:
            loss_fn(model(x), y).backward()
            optimizer.step()                                # steps this rank's shard,
            optimizer.zero_grad()                           # then broadcasts it

    Each trainable parameter is owned by exactly one rank of ``group`` (greedy, largest
    first: :func:`shardkit.optim.partition.partition_sizes`); the owner creates and
    updates its optimizer state, then broadcasts the new values.

    Args:
        params: an iterable of parameters or of param-group dicts (own lr, weight
            decay, ...), as for any torch optimizer.
        optim: the optimizer class to shard; default ``torch.optim.SGD``.
        group: FairScale's name of ``process_group`` (an alias; give either).
        broadcast_buffer_size: bucket size for the parameter broadcasts after a step,
            in bytes (of the wire dtype). ``-1`` (default) means 16 MiB; ``0`` sends
            each parameter alone. Parameters of at least ``min(this, 1 MiB)`` are
            sent in place, without a copy.
        broadcast_fp16: broadcast the updated parameters in fp16, halving the traffic.
            Every rank, owner included, then holds the fp16-rounded values (ranks stay
            identical; about 3 decimal digits are kept): safe for fp16/bf16 mixed
            precision training, a slight loss of accuracy for fp32 training.
            Default False.
        force_broadcast_object: accepted for FairScale compatibility; state is always
            exchanged with object collectives (pickle). Default False.
        process_group: the process group to shard over (keyword only, the name every
            shardkit wrapper uses); default None (the world group).
        **defaults: arguments of ``optim`` (``lr``, ``weight_decay``, ...).

    Raises:
        TypeError: if ``optim`` is not a ``torch.optim.Optimizer`` subclass or is
            ``OSS`` itself, ``params`` is an optimizer (wrapping twice), or a parameter
            has a complex dtype
            (:func:`shardkit.distributed.validation.check_parameters`). A frozen
            (``requires_grad=False``) integer or bool parameter is accepted, as in
            FairScale: it has no owner and is never stepped nor broadcast.
        ValueError: if ``process_group`` and ``group`` are both given and differ
            (raised before any collective); if ``params`` is empty (or holds only empty
            param groups) or a parameter is on the meta device; ``optim``'s own errors
            (e.g. ``lr=-1``).
        ConsistencyError: if the ranks' parameters or options differ;
            ``PeerRejectedError`` (a subclass), at once, if another rank raised one of
            the TypeError / ValueError above (they travel in the wrap-time exchange).

    Warning:
        The partition is made from ``requires_grad`` at construction. A change of
        ``requires_grad`` is detected at the next ``step`` and the partition rebuilt
        (with a warning; call :meth:`refresh_trainable` yourself to silence it). The
        state of a parameter that becomes frozen is dropped.
    """

    def __init__(
        self,
        params: Iterable[Any],
        optim: type[Optimizer] = torch.optim.SGD,
        group: dist.ProcessGroup | None = None,
        broadcast_buffer_size: int = -1,
        broadcast_fp16: bool = False,
        force_broadcast_object: bool = False,
        *,
        process_group: dist.ProcessGroup | None = None,
        **defaults: Any,
    ) -> None:
        group = _one_group(process_group, group)
        with local_checks("OSS", group):  # an error here stops every rank (no rank waits)
            self._optim_class = _check_optim_class(optim)
            self._in_constructor = True
            self._optim_defaults = dict(defaults)
            param_list = _param_list(params)
            super().__init__(param_list, _full_defaults(self._optim_class, defaults))
            self._in_constructor = False
            if not self._all_params():  # only empty param groups
                raise _no_parameters()
        self.process_group = self.group = group
        check_group(group, "OSS")
        alone = group is None and not dist.is_initialized()  # no process group: one rank
        self.world_size = 1 if alone else group_size(group)
        self.rank = 0 if alone else group_rank(group)
        self.global_rank = global_rank(group, self.rank)
        self._param_rank: dict[torch.Tensor, int] = {}
        problem = parameter_problem(  # also: no two parts of a split tensor (MoE experts)
            "OSS",
            self._named_params(),
            allow_frozen_integer=True,
            reduce_ranks=None if alone else group_ranks(group),
        )
        if problem is None:
            try:  # no collective in the first build; the inner optimizer checks its arguments
                self.optim: Optimizer = self._build_local_optimizer()
            except (TypeError, ValueError) as error:  # e.g. lr=-1 on this rank only
                problem = error
        verify_consistent(
            describe_parameters(self._named_params()),
            what="OSS",
            group=group,
            options={"optim": self._optim_class.__name__, "broadcast_fp16": broadcast_fp16},
            local_error=problem,  # every rank stops
        )
        self.broadcast_buffer_size = (
            DEFAULT_BUCKET_BYTES if broadcast_buffer_size < 0 else broadcast_buffer_size
        )
        self.broadcast_fp16 = broadcast_fp16
        self.force_broadcast_object = force_broadcast_object
        self._pool = BufferPool(self._all_params()[0].device)
        self._consolidated: StateDict | None = None
        # DDP bucket indices reduce_to_owner_hook reduced since the last step / zero_grad
        self.hook_reduced_buckets: set[int] = set()

    # views -------------------------------------------------------------------------
    @property  # type: ignore[override]
    def state(self) -> defaultdict[torch.Tensor, Any]:
        """The optimizer state of this rank's shard only (``self.optim.state``)."""
        local = self.__dict__.get("optim")
        if local is None:
            return cast(defaultdict[torch.Tensor, Any], self.__dict__["_bootstrap_state"])
        return local.state

    @state.setter
    def state(self, value: defaultdict[torch.Tensor, Any]) -> None:
        self.__dict__["_bootstrap_state"] = value  # only torch's constructor sets it

    def _named_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                yield f"param_groups[{g}][{i}]", p

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _global_index(self) -> dict[torch.Tensor, int]:
        return {p: i for i, p in enumerate(self._all_params())}

    def _trainable(self) -> list[torch.Tensor]:
        return [p for p in self._all_params() if p.requires_grad]

    @property
    def param_to_rank(self) -> dict[torch.Tensor, int]:
        """Owner (a rank of ``group``) of each trainable parameter."""
        return dict(self._param_rank)

    def partition_parameters(self) -> list[list[dict[str, Any]]]:
        """Per rank of ``group``, its param groups (one per full group, maybe empty)."""
        return [self._groups_of(rank) for rank in range(self.world_size)]

    def _groups_of(self, rank: int) -> list[dict[str, Any]]:
        return [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [p for p in g["params"] if self._param_rank.get(p) == rank],
            }
            for g in self.param_groups
        ]

    def local_params(self) -> list[torch.Tensor]:
        """The parameters this rank owns, in the order of the full view."""
        return [p for p in self._all_params() if self._param_rank.get(p) == self.rank]

    # partition ---------------------------------------------------------------------
    def _partition(self) -> dict[torch.Tensor, int]:
        trainable = self._trainable()
        owners = partition_sizes([p.numel() for p in trainable], self.world_size)
        return dict(zip(trainable, owners))

    def _build_local_optimizer(self) -> Optimizer:
        old = self.__dict__.get("optim")
        old_owner, self._param_rank = self._param_rank, self._partition()
        kept = self._migrate_state(old.state, old_owner) if old is not None else {}
        local = self._optim_class(self._groups_of(self.rank), **self._optim_defaults)
        for p, st in kept.items():
            local.state[p] = st
        self._signature = tuple(p.requires_grad for p in self._all_params())
        return local

    def _migrate_state(
        self, old_state: dict[torch.Tensor, Any], old_owner: dict[torch.Tensor, int]
    ) -> dict[torch.Tensor, Any]:
        """Move the state of parameters whose owner changed (a collective if any did)."""
        new_owner = self._param_rank
        kept = {p: st for p, st in old_state.items() if new_owner.get(p) == self.rank}
        moved = [p for p, r in old_owner.items() if new_owner.get(p, r) != r]
        if not moved or self.world_size == 1:
            return kept
        index = self._global_index()
        outgoing = {
            index[p]: _to_device(old_state[p], "cpu")
            for p in moved
            if p in old_state and new_owner.get(p) is not None
        }
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, outgoing, group=self.group)
        params = self._all_params()
        for shard in gathered:
            for i, st in shard.items():
                if new_owner.get(params[i]) == self.rank:
                    kept[params[i]] = _to_device(st, params[i].device)
        return kept

    def refresh_trainable(self) -> None:
        """Re-partition after ``requires_grad`` changed (a collective over ``group``).

        State of parameters that change owner moves to the new owner; state of
        parameters now frozen is dropped.
        """
        with record_function("OSS::refresh_trainable"):
            self.optim = self._build_local_optimizer()
        self._consolidated = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the full view and re-partition (a collective after construction)."""
        super().add_param_group(param_group)
        if not self.__dict__.get("_in_constructor", True):
            self.refresh_trainable()

    # step --------------------------------------------------------------------------
    def _sync_hyperparams(self, source: list[dict[str, Any]], dest: list[dict[str, Any]]) -> None:
        for src, dst in zip(source, dest):
            for key, value in src.items():
                if key != "params":
                    dst[key] = value

    def trainable_changed(self) -> bool:
        """Whether ``requires_grad`` of some parameter changed since the partition was
        made (the next :meth:`step` re-partitions; see :meth:`refresh_trainable`)."""
        return tuple(p.requires_grad for p in self._all_params()) != self._signature

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        """Step this rank's shard, then broadcast the updated parameters (a collective).

        Args:
            closure: re-evaluates the model and returns the loss (every rank calls it).
            **kwargs: passed to the wrapped optimizer's ``step``.

        Returns:
            What the wrapped optimizer's ``step`` returns (the closure's loss or None).
        """
        with record_function("OSS::step"):
            if self.trainable_changed():
                warnings.warn(
                    "OSS: requires_grad of some parameters changed since the partition; "
                    "re-partitioning (call optimizer.refresh_trainable() to do it explicitly)",
                    stacklevel=2,
                )
                self.refresh_trainable()
            self._sync_hyperparams(self.param_groups, self.optim.param_groups)
            with record_function("OSS::local_step"):
                step = self.optim.step
                loss = step(closure=closure, **kwargs) if closure else step(**kwargs)
            self._sync_hyperparams(self.optim.param_groups, self.param_groups)
            self._broadcast_params()
            self._consolidated = None
            self.hook_reduced_buckets.clear()
            return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad`` over every parameter (the full view); also
        ends the accumulation window of :func:`~shardkit.optim.reduce_to_owner_hook`.

        Args:
            set_to_none: set gradients to None instead of zero (default True).
        """
        super().zero_grad(set_to_none)
        self.hook_reduced_buckets.clear()

    @torch.no_grad()
    def _broadcast_params(self) -> int:
        """Broadcast each owner's parameters in buckets; returns the number of broadcasts."""
        if self.world_size == 1:
            return 0
        owned: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
        for p in self._all_params():
            if p in self._param_rank:
                owned[self._param_rank[p]].append(p.detach())
        wire = torch.float16 if self.broadcast_fp16 else None
        bucket = self.broadcast_buffer_size
        plan = plan_owner_broadcast(owned, bucket, wire, min(bucket, _DIRECT_BYTES))
        with (
            record_function(f"OSS::broadcast buckets={len(plan)}"),
            collective_context("OSS", "step: broadcast of updated parameters", self.group),
        ):
            return broadcast_from_owners(plan, self.group, pool=self._pool, comm_dtype=wire)

    def clip_grad_norm(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        filter_params_fn: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Clip gradients by the total norm over every rank's shard (a collective).

        Equal to ``torch.nn.utils.clip_grad_norm_`` over all parameters of the unsharded
        model, for any ``norm_type`` (1, 2, ``inf``, ...). Only this rank's shard is
        scaled (the other gradients are not used by this rank's step).

        Args:
            max_norm: the largest allowed total norm.
            norm_type: p of the p-norm; default 2.0; ``float("inf")`` for the max norm.
            filter_params_fn: applied to this rank's parameter list to choose those that
                count (and are clipped); default None (all).

        Returns:
            The total norm before clipping (a 0-d fp32 tensor).

        Raises:
            ValueError: parameters split over (or copied on) ranks outside the group
                (a tensor-parallel model, experts split over ``ep``): the norm over the
                group alone would be each tensor-parallel rank's own, a different
                clipping factor on each. The message names the ranks and the fix
                (``shardkit.nn.tensor_parallel.clip_grad_norm_`` with ``shard_group``;
                ``shardkit.nn.moe.clip_grad_norm_``). Checked on every rank, from every
                parameter's shard descriptor, before any collective.
        """
        self._refuse_parts_outside_the_group()
        local = self.local_params()
        if filter_params_fn is not None:
            local = filter_params_fn(local)
        with record_function("OSS::clip_grad_norm"):
            return clip_grad_norm_sharded(local, max_norm, norm_type, self.group)

    def _refuse_parts_outside_the_group(self) -> None:
        """The ValueError of :meth:`clip_grad_norm` for parameters held in parts or
        copies outside the group (read from every parameter's shard descriptor, so
        every rank decides alike)."""
        if not dist.is_initialized():
            return
        views = (view_of(p) for p in self._all_params())
        outside = held_outside(views, group_ranks(self.group))
        if outside:
            raise ValueError(
                f"OSS.clip_grad_norm: parameters are split over (or copied on) ranks "
                f"{sorted(list(r) for r in outside)} outside the optimizer's group "
                f"{group_ranks(self.group)} (tensor- or expert-parallel parts): the norm "
                "over the group would miss the other parts. Tensor parallel: use "
                "shardkit.nn.tensor_parallel.clip_grad_norm_(optimizer.local_params(), "
                "max_norm, norm_type, process_group=<tp group>, shard_group=optimizer.group); "
                "experts split over ep (gradients whole on each rank): "
                "shardkit.nn.moe.clip_grad_norm_(model, max_norm, ep_group=<ep group>)"
            )

    # state dicts -------------------------------------------------------------------
    def sharded_state_dict(self) -> StateDict:
        """This rank's shard, globally indexed: ``{"param_groups", "state"}`` (no collective).

        ``param_groups`` is the full view in ``torch.optim`` layout; ``state`` maps the
        global index of each parameter this rank owns to its state. Merging the shards
        of all ranks gives a plain ``state_dict()``
        (:func:`shardkit.checkpoint.sharded_optim.merge_optimizer_shards`).
        """
        index = self._global_index()
        return {
            "param_groups": _pack_groups(self.param_groups, index),
            "state": {index[p]: st for p, st in self.optim.state.items()},
        }

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather every rank's shard on ``recipient_rank`` (a collective over ``group``).

        Then :meth:`state_dict` on that rank returns the full state.

        Args:
            recipient_rank: rank (in ``group``) that receives the full state; ``-1``
                means every rank. Default 0.
        """
        with record_function("OSS::consolidate_state_dict"):
            self._consolidate(recipient_rank)

    def _consolidate(self, recipient_rank: int) -> None:
        shard = self.sharded_state_dict()
        shard["state"] = _to_device(shard["state"], "cpu")
        meta = {"rank": self.rank, "world_size": self.world_size}
        if self.world_size == 1:
            shards: list[Any] = [{**shard, **meta}]
        elif recipient_rank == -1:
            shards = [None] * self.world_size
            dist.all_gather_object(shards, {**shard, **meta}, group=self.group)
        else:
            receiving = self.rank == recipient_rank
            shards = [None] * self.world_size if receiving else []
            dist.gather_object(
                {**shard, **meta},
                shards if receiving else None,
                dst=global_rank(self.group, recipient_rank),
                group=self.group,
            )
        receives = self.world_size == 1 or recipient_rank in (-1, self.rank)
        self._consolidated = merge_optimizer_shards(shards) if receives else None

    def state_dict(self) -> StateDict:
        """The full, plain ``torch.optim`` state dict (after :meth:`consolidate_state_dict`).

        Loadable into the unwrapped optimizer class over the same parameters.

        Raises:
            RuntimeError: on a rank that did not receive a consolidation since the last
                step (with one rank, the state is consolidated on the fly).
        """
        if self.world_size == 1:
            self.consolidate_state_dict()
        if self._consolidated is None:
            raise RuntimeError(
                f"OSS.state_dict() on rank {self.rank}: no consolidated state since the "
                f"last step. Call optimizer.consolidate_state_dict(recipient_rank={self.rank}) "
                "on every rank first (it is a collective), then state_dict() on that rank; "
                "or save without consolidation with optimizer.save_sharded(directory)"
            )
        return self._consolidated

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Load a full state dict (from :meth:`state_dict` or a plain optimizer).

        Every rank passes the same full dict; each keeps the state of its own shard.
        No collective.

        Raises:
            ValueError: if the numbers of groups or of parameters per group differ.
        """
        saved = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        saved_sizes = [len(g["params"]) for g in saved]
        if sizes != saved_sizes:
            raise ValueError(
                f"the state dict has param groups of sizes {saved_sizes}, this optimizer "
                f"has {sizes}: it was saved for other parameters"
            )
        for group, saved_group in zip(self.param_groups, saved):
            self._sync_hyperparams([saved_group], [group])
        self.optim.load_state_dict(self._local_state_dict(state_dict))
        self._consolidated = None

    def _local_state_dict(self, full: StateDict) -> StateDict:
        """The slice of a full (globally indexed) state dict for the local optimizer."""
        params = self._all_params()
        saved_index = [i for g in full["param_groups"] for i in g["params"]]
        local_pos = {p: i for i, p in enumerate(self.local_params())}
        state: dict[int, Any] = {}
        for p, i in zip(params, saved_index):
            if p in local_pos and i in full["state"]:
                state[local_pos[p]] = full["state"][i]
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": []}
            for g in self.param_groups
        ]
        for g, local_g in zip(groups, self.optim.param_groups):
            g["params"] = [local_pos[p] for p in local_g["params"]]
        return {"state": state, "param_groups": groups}

    def save_sharded(self, directory: str | Path, step: int = 0, keep: int = 0) -> Path:
        """Write this rank's shard under ``directory`` as a universal checkpoint (a
        collective over ``group``): ``save_universal(directory, step, None, self)``.

        No consolidation: each rank writes only the state of the parameters it owns
        (and those parameters), atomically, into
        ``directory/ckpt-<step>/shard-<r>-of-<N>.safetensors``; rank 0 then writes the
        manifest (size and sha256 of every file) and ``directory/latest``. Without a
        model the keys are ``"params.<i>"`` (``i``: the parameter's index in a plain
        ``torch.optim`` state dict). The checkpoint loads at any world size with
        :meth:`load_sharded`. To save the model with it, under its state-dict keys:
        ``save_universal(directory, step, model, optimizer)``.

        Args:
            directory: the checkpoint root, shared by every rank.
            step: the training step; default 0.
            keep: committed checkpoints to keep (the newest); default 0: all.

        Returns:
            The file this rank wrote.

        Raises:
            CheckpointError: (problem ``save``) on every rank, naming the failing ranks;
                nothing is committed then.
        """
        ckpt = save_universal(directory, step, None, self, keep=keep, group=self.group)
        return ckpt / shard_file_name(self.rank, self.world_size)

    def load_sharded(self, directory: str | Path) -> None:
        """Load the optimizer state and hyperparameters of the newest intact checkpoint
        written by :meth:`save_sharded`, at any world size (a collective over ``group``):
        ``load_universal(directory, None, self)``.

        Each rank reads the state of the parameters it owns now. A damaged file makes
        every rank use the previous checkpoint, with a warning. The parameters are not
        changed (load the model on its own); a failed load changes nothing.

        Raises:
            CheckpointMismatchError: another number of parameters or other shapes, no
                optimizer state saved, another optimizer class, or an old-format
                directory (convert it: ``python -m shardkit.checkpoint convert``).
            CheckpointCorruptError, FileNotFoundError, CheckpointError: see
                :func:`shardkit.checkpoint.universal.load_universal`.
        """
        load_universal(directory, None, self, group=self.group, require_optimizer_state=True)
