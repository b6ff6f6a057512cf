"""The ``--strategy`` registry of the main job: how the plain GPT is wrapped for training.

[Note: adding a strategy]
Write one factory and register one :class:`StrategySpec` in :data:`STRATEGIES`::

    def _oss(model: GPT, config: StrategyConfig, device: torch.device) -> Strategy:
        optimizer = OSS(model.parameters(), torch.optim.AdamW, **adamw_kwargs(config))
        return Strategy(module=DistributedDataParallel(model), optimizer=optimizer, model=model)

    STRATEGIES = _registry(..., StrategySpec("oss", _oss, "torch DDP + OSS(AdamW)", zero_stage=1))

The spec is the only place a strategy is named: the main job's ``--strategy`` choices
and option checks (``train_gpt.py``), the benchmarks' rows (``benchmarks/runners.py``)
and the options table of ``docs/train_gpt.md`` (:func:`strategy_table`, kept equal by a
test) all read it. Its capabilities (meta init, precision mode, loss scaler, activation
checkpointing, checkpoint layout, the flags only it reads) are what
:func:`build_strategy` and :func:`option_error` act on.

A factory gets ``(model, config, device)``: the plain :class:`GPT`, on ``device`` and
identical on every rank (same seed), or on the meta device where the spec says so
(``meta_init``); the typed options (:class:`StrategyConfig`; build the optimizer from
:func:`adamw_kwargs` so that every strategy trains with the same settings); and this
rank's device. The default process group is initialised. It returns a
:class:`Strategy`, which the training loop (``train_gpt.py``) uses like this::

    loss = strategy.train_step(x, y, accumulation)   # zero_grad, forward(s), backward(s),
                                                     # step; the mean loss

:class:`Strategy` and its contract (``train_step``, checkpoints, reports) live in
``gpt_strategy.py``; the pipeline and offload wrappers of the GPT in ``gpt_wrappers.py``.
The mesh (:func:`parallel_dims`) and the composition (tensor parallel, activation
checkpointing, FSDP / hybrid units, the pipeline split) come from
:func:`shardkit.compose.parallelize_model`: this module only chooses its flags.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from gpt_context_parallel import apply_context_parallel
from gpt_moe import MoEGPT, moe_error, moe_tp_plan
from gpt_optimizer import muon_names, oss_optimizer, sharded_optimizer, whole_optimizer
from gpt_stage_init import materialize_stage
from gpt_strategy import (
    PRECISIONS,
    PrecisionStrategy,
    Strategy,
    StrategyConfig,
    TensorParallelStrategy,
    adamw_kwargs,
)
from gpt_wrappers import OffloadGPT, OffloadStrategy, PipelineGPT, PipeStrategy, lm_loss
from torch.nn.parallel import DistributedDataParallel

from shardkit.compose import DataParallel, ParallelModel, PipelineSplit, parallelize_model
from shardkit.distributed.compression import get_compressor, register_ddp_comm_hook
from shardkit.distributed.mesh import ParallelDims, ProcessMesh
from shardkit.memory import ModelStateBytes, model_state_bytes
from shardkit.models import GPT, Block, gpt_stages, gpt_unit_init_fn
from shardkit.nn import tensor_parallel as tp
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel, MixedPrecision
from shardkit.nn.moe import all_reduce_expert_gradients, ignore_experts_in_ddp
from shardkit.nn.offload import OffloadModel, remove_offloaded
from shardkit.optim import OSS, register_reduce_to_owner_hook
from shardkit.optim.grad_scaler import ShardedGradScaler

# re-exported: the names the main job, the benchmarks and the tests import from here
__all__ = [
    "PRECISIONS",
    "STRATEGIES",
    "OffloadGPT",
    "Strategy",
    "StrategyConfig",
    "StrategyFactory",
    "StrategySpec",
    "adamw_kwargs",
    "build_strategy",
    "data_parallel_group",
    "fsdp_policy",
    "option_error",
    "parallel_dims",
    "strategy_table",
]

StrategyFactory = Callable[[GPT, StrategyConfig, torch.device], Strategy]


_MESH: ContextVar[ProcessMesh | None] = ContextVar("mesh", default=None)


def parallel_dims(config: StrategyConfig, world_size: int) -> ParallelDims:
    """The mesh of ``config`` on ``world_size`` ranks: the ``--pp``, ``--dp-replicate``,
    ``--dp-shard``, ``--tp`` given, the others inferred as the strategy's shorthand says:

    - fsdp: ``dp_shard`` is the rest (``dp_replicate`` default 1);
    - hsdp: ``dp_shard`` is ``--shard-size`` (default ``LOCAL_WORLD_SIZE / (tp x cp)``:
      one node's data-parallel ranks; the shard group is ``dp_shard x cp`` ranks),
      ``dp_replicate`` the rest;
    - pipe: ``pp`` is the rest (one stage per rank by default), ``dp_shard`` is the
      rest when ``--pp`` is given;
    - ddp, oss, sdp, offload: ``tp`` only; the data-parallel ranks are the rest.

    Raises:
        ValueError: degrees whose product is not ``world_size`` (the equation named),
            or ``--shard-size`` and ``--dp-shard`` both given and different.
    """
    tp_, pp, dpr, dps, cp = config.tp, config.pp, config.dp_replicate, config.dp_shard, config.cp
    if config.name == "hsdp":
        if config.shard_size is not None and dps not in (None, config.shard_size):
            raise ValueError(
                f"--shard-size {config.shard_size} and --dp-shard {dps} name the same "
                "degree (ranks per shard group); give one of them"
            )
        if dps is None:
            dps = config.shard_size
        if dps is None and dpr is None:  # one node's data-parallel ranks
            dps = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) // (tp_ * cp))
        if dpr is None:
            others = (pp or 1) * tp_ * cp * (dps or 1)
            dpr = world_size // others if world_size % others == 0 else -1
            if dpr < 1:
                cp_term = f" x cp ({cp})" if cp > 1 else ""
                raise ValueError(
                    f"hsdp: the world size {world_size} is not a multiple of "
                    f"dp_shard ({dps}){cp_term} x tp ({tp_}) = {others}; choose a --shard-size "
                    f"(or --dp-shard) whose product with --tp{' and --cp' if cp > 1 else ''} "
                    f"divides {world_size}"
                )
    elif config.name == "pipe" and pp is None:
        others = (dpr or 1) * (dps or 1) * tp_
        pp = world_size // others if world_size % others == 0 else world_size
    return ParallelDims(
        world_size,
        pp=pp or 1,
        dp_replicate=dpr or 1,
        dp_shard=dps or -1,
        tp=tp_,
        ep=config.ep,
        cp=config.cp,
    )


def strategy_mesh(config: StrategyConfig) -> ProcessMesh:
    """The mesh a factory builds on: :func:`build_strategy`'s (set while the factory
    runs), else one built here from :func:`parallel_dims` (a collective when it
    creates groups: call it on every rank)."""
    mesh = _MESH.get()
    return mesh if mesh is not None else ProcessMesh(parallel_dims(config, dist.get_world_size()))


def data_parallel_group() -> dist.ProcessGroup | None:
    """The group a data-parallel factory (ddp, oss, sdp) reduces or shards over: under
    ``--tp`` > 1 the mesh's ``dp_cp`` group (``dp`` and the ``--cp`` ranks, which hold
    the same parameters; set by :func:`build_strategy` while the factory runs), else
    None (the world)."""
    mesh = _MESH.get()
    return mesh.group("dp_cp") if mesh is not None and mesh.size("tp") > 1 else None


class _MoEDDPStrategy(Strategy):
    """torch DDP over the dense parameters, the experts (which DDP ignores) averaged
    over the mesh's ``edp`` group before each step (``shardkit.nn.moe``'s [Note: why
    experts are not data parallel over dp])."""

    def __init__(self, *args: Any, edp: dist.ProcessGroup, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.edp = edp

    def before_step(self) -> None:
        all_reduce_expert_gradients(self.model, self.edp)


def _ddp(model: GPT, config: StrategyConfig, device: torch.device) -> Strategy:
    """torch DistributedDataParallel + AdamW: every rank holds the full model state
    (with ``--moe-experts``: the experts are left out of DDP and averaged over the
    mesh's ``edp`` group, each rank holding its ``--ep`` share of them)."""
    device_ids = [device] if device.type == "cuda" else None
    moe = isinstance(model, MoEGPT)
    if moe:
        ignore_experts_in_ddp(model)
    module = DistributedDataParallel(
        model, device_ids=device_ids, process_group=data_parallel_group()
    )
    if config.grad_compression is not None:
        register_ddp_comm_hook(module, config.grad_compression)
    optimizer = whole_optimizer(config.optimizer, model, adamw_kwargs(config))
    if moe:
        edp = strategy_mesh(config).group("edp")
        return _MoEDDPStrategy(module=module, optimizer=optimizer, model=model, edp=edp)
    return Strategy(module=module, optimizer=optimizer, model=model)


class _OSSStrategy(Strategy):
    """A strategy whose optimizer is an :class:`OSS`: checkpoints hold this rank's shard."""

    optimizer: OSS

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.sharded_state_dict()}


def _oss(model: GPT, config: StrategyConfig, device: torch.device) -> Strategy:
    """torch DDP + OSS(AdamW): optimizer state sharded across ranks (ZeRO-1); each
    gradient reduced to its owner only (``reduce_to_owner_hook``: 2 psi per step)."""
    device_ids = [device] if device.type == "cuda" else None
    group = data_parallel_group()
    module = DistributedDataParallel(model, device_ids=device_ids, process_group=group)
    optimizer = oss_optimizer(config.optimizer, model, adamw_kwargs(config), group)
    register_reduce_to_owner_hook(module, optimizer, grad_compression=config.grad_compression)
    return _OSSStrategy(module=module, optimizer=optimizer, model=model)


def _sdp(model: GPT, config: StrategyConfig, device: torch.device) -> Strategy:
    """ShardedDataParallel + OSS(AdamW): gradients and optimizer state sharded (ZeRO-2)."""
    group = data_parallel_group()
    optimizer = oss_optimizer(config.optimizer, model, adamw_kwargs(config), group)
    module = ShardedDataParallel(
        model, optimizer, process_group=group, grad_compression=config.grad_compression
    )
    return _OSSStrategy(module=module, optimizer=optimizer, model=model)


def _pipe(model: GPT, config: StrategyConfig, device: torch.device) -> Strategy:
    """GPT blocks split over the mesh's ``pp`` ranks (one stage each; by default every
    rank), ``--chunks`` micro-batches, ``--schedule gpipe|1f1b``, stages replicated over
    ``dp`` and split over ``tp``; AdamW on each stage's parameters."""
    split = PipelineSplit(
        gpt_stages, lm_loss, config.chunks, config.schedule, materialize=materialize_stage
    )
    parallel = _parallelize(model, config, strategy_mesh(config), "ddp", device, split)
    module = PipelineGPT(parallel)
    optimizer = torch.optim.AdamW(module.stage_module.parameters(), **adamw_kwargs(config))
    return PipeStrategy(module, optimizer, model)


def _offload(model: GPT, config: StrategyConfig, device: torch.device) -> Strategy:
    """OffloadModel over the GPT's stages (embedding, blocks, head; the tied embedding /
    LM head weight stays resident), 4 slices, activation checkpointing, gradients
    averaged across ranks. CPU memory by default; ``--offload-dir`` for the disk tier
    (one sub-directory per rank, stepped by ``sliced_optimizer``; ``--resume`` deletes
    the offloaded model a sub-directory holds and loads the checkpoint into a new one)."""
    offload_dir = config.offload_dir
    kwargs: dict[str, Any] = {"num_slices": min(4, len(model.blocks) + 2)}
    if offload_dir is not None:
        kwargs["offload_dir"] = f"{offload_dir}/rank{dist.get_rank()}"
        if config.resume:  # the checkpoint is the state: the directory starts afresh
            remove_offloaded(kwargs["offload_dir"])
    offload = OffloadModel(
        gpt_stages(model),
        device,
        checkpoint_activation=True,
        process_group=dist.group.WORLD,
        **kwargs,
    )
    if offload_dir is None:
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            offload.parameters(), **adamw_kwargs(config)
        )
    else:
        optimizer = offload.sliced_optimizer(torch.optim.AdamW, **adamw_kwargs(config))
    return OffloadStrategy(OffloadGPT(offload), optimizer, model)


class _FSDPStrategy(Strategy):
    """FSDP: checkpoints hold this rank's shards; the final model is gathered."""

    module: FullyShardedDataParallel

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.module.local_state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_local_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def consolidated_model_state(self) -> dict[str, Any] | None:
        return self.module.state_dict()  # a collective; plain GPT keys

    def model_state_bytes(self) -> ModelStateBytes:
        return model_state_bytes(self.module, self.optimizer)


def _fsdp(model: GPT, config: StrategyConfig, device: torch.device) -> Strategy:
    """FullyShardedDataParallel, one unit per Block + the root (ZeRO-3) over the mesh's
    ``dp_shard`` ranks, hybrid when ``dp_replicate`` > 1; AdamW with the settings of
    every strategy (one param group: a checkpoint moves between strategies, and the
    universal checkpoint refuses param groups whose hyperparameters differ).
    ``--precision bf16|fp16``: FSDP's own mixed precision (:func:`fsdp_policy`)."""
    muon = muon_names(model)  # --optimizer muon: the blocks' matrices, before wrapping
    mesh = strategy_mesh(config)
    parallel = _parallelize(model, config, mesh, "fsdp", device)
    optimizer = sharded_optimizer(
        config.optimizer,
        parallel.module,
        list(parallel.parameters()),
        muon,
        adamw_kwargs(config),
        mesh.group("dp_shard_cp"),
    )
    strategy = _FSDPStrategy(module=parallel.module, optimizer=optimizer)
    strategy.split_tensors = parallel.split_tensors
    return strategy


def _hsdp(model: GPT, config: StrategyConfig, device: torch.device) -> Strategy:
    """As :func:`_fsdp` with hybrid sharding: full shard inside a shard group of
    ``--shard-size`` data-parallel ranks (default: one node's, ``LOCAL_WORLD_SIZE``),
    replicas across groups; each rank all-reduces only its gradient shard across
    nodes. The mesh (:func:`parallel_dims`) decides, as for fsdp."""
    return _fsdp(model, config, device)


def _parallelize(
    model: GPT,
    config: StrategyConfig,
    mesh: ProcessMesh,
    data_parallel: DataParallel,
    device: torch.device,
    pipeline: PipelineSplit | None = None,
) -> ParallelModel:
    """The GPT through :func:`shardkit.compose.parallelize_model`: ``--tp``
    (``tp.gpt_plan()``), ``--activation-checkpointing`` (every Block), then
    ``data_parallel`` (fsdp: a unit per Block, ``--precision``, ``--grad-compression``,
    a meta GPT initialised unit by unit) and the ``pipeline``."""
    fsdp = data_parallel == "fsdp"
    kwargs: dict[str, Any] = {}
    if fsdp and isinstance(model, MoEGPT):  # experts: a unit of their own over edp
        for layer in model.moe_layers():
            layer.moe.experts = FullyShardedDataParallel(  # type: ignore[assignment]
                layer.moe.experts,
                process_group=mesh.group("edp"),
                mixed_precision=fsdp_policy(config.precision),
            )
    if fsdp:  # a GPT built on meta is materialised unit by unit (deferred initialisation)
        meta = any(p.is_meta for p in model.parameters())
        kwargs["param_init_fn"] = gpt_unit_init_fn if meta else None
    if fsdp and config.grad_compression is not None:  # one compressor, state per unit
        kwargs["grad_compression"] = get_compressor(config.grad_compression)
    return parallelize_model(
        model,
        mesh,
        tp_plan=moe_tp_plan(model, tp.gpt_plan(sequence_parallel=config.sequence_parallel)),
        activation_checkpointing={Block} if config.activation_checkpointing else (),
        fsdp_units={Block},
        mixed_precision=fsdp_policy(config.precision) if fsdp else None,
        fsdp_kwargs=kwargs,
        pipeline=pipeline,
        data_parallel=data_parallel,
        device=device,
    )


# The registry ---------------------------------------------------------------------------
# [Note: precision per strategy]
# ddp, oss and sdp keep fp32 parameters and run the forward under torch.autocast (bf16 or
# fp16); fsdp casts its own full parameters (a MixedPrecision policy: the all-gather
# moves half the bytes). fp16 adds dynamic loss scaling: torch's GradScaler for ddp
# (every rank holds every gradient), ShardedGradScaler elsewhere (each rank checks its
# shard, the ranks agree). pipe and offload run their own backward (the schedule, the
# slices), so neither precision option applies to them (offload checkpoints every
# slice already).

MetaInit = Literal["no", "optional", "default"]
PrecisionMode = Literal["autocast", "native"]
LossScaler = Literal["torch", "sharded"]
Checkpointing = Literal["flag", "built-in", "no"]
FP16_INIT_SCALE = 2.0**14  # FSDP's fp16 loss: its gradient (the scale) must fit fp16 (65504)


@dataclass(frozen=True)
class StrategySpec:
    """One ``--strategy``: its factory and what it supports.

    Calling the spec calls the factory: ``spec(model, config, device) -> Strategy``.

    Attributes:
        name: the registry key, the ``--strategy`` value.
        factory: builds this rank's :class:`Strategy` (:data:`StrategyFactory`).
        summary: what wraps the GPT, one line (the docs' table, the benchmarks' rows).
        zero_stage: ZeRO stage of the model state (0: replicated, as DDP); None where
            the ZeRO formulas do not apply (a pipeline stage holds part of the model).
        meta_init: ``"default"``: the main job builds the GPT on the meta device and
            the factory allocates only this rank's part, with the plain GPT's values;
            ``"optional"``: the factory also takes a GPT built on meta (initialised
            unit by unit, other values than the plain GPT's: the benchmarks' "meta
            init" rows); ``"no"``: a materialised GPT only. Default ``"no"``.
        precision: how ``--precision bf16|fp16`` applies: ``"autocast"`` (fp32
            parameters, the forward under ``torch.autocast``) or ``"native"`` (the
            wrapper's own mixed-precision policy); None: fp32 only. Default None.
        loss_scaler: the fp16 loss scaler: ``"torch"`` (``torch.amp.GradScaler``: every
            rank holds every gradient) or ``"sharded"`` (``ShardedGradScaler``: each
            rank checks its shard, the ranks agree); None exactly where ``precision``
            is None. Default None.
        activation_checkpointing: ``"flag"``: ``--activation-checkpointing`` wraps
            every Block in ``checkpoint_wrapper`` before the factory runs;
            ``"built-in"``: the strategy recomputes its slices itself and refuses the
            flag; ``"no"``: refused. Default ``"flag"``.
        checkpoint_layout: what this rank writes of the universal checkpoint (its
            layout adapter, ``docs/universal_checkpoint_layouts.md``), for the docs.
            Default: the r-th 1/N of every tensor and its AdamW state.
        options: the flags only this strategy reads (:class:`StrategyConfig` field
            names); another strategy refuses them when set to other than the default.
        composes: the factory builds the whole composition (``--tp``, checkpointing,
            its data parallelism, the pipeline) with
            :func:`shardkit.compose.parallelize_model`; False: :func:`build_strategy`
            applies ``--tp`` and checkpointing first and the factory wraps the result.
            Default False.

    Raises:
        ValueError: ``loss_scaler`` given without ``precision`` or the reverse.
    """

    name: str
    factory: StrategyFactory
    summary: str
    zero_stage: int | None
    meta_init: MetaInit = "no"
    precision: PrecisionMode | None = None
    loss_scaler: LossScaler | None = None
    activation_checkpointing: Checkpointing = "flag"
    checkpoint_layout: str = "the r-th 1/N of every tensor and its AdamW state"
    options: tuple[str, ...] = ()
    composes: bool = False

    def __post_init__(self) -> None:
        if (self.precision is None) != (self.loss_scaler is None):
            raise ValueError(
                f"strategy {self.name!r}: precision={self.precision!r} but "
                f"loss_scaler={self.loss_scaler!r}; fp16 needs a loss scaler, so give both "
                "or neither"
            )

    def __call__(self, model: GPT, config: StrategyConfig, device: torch.device) -> Strategy:
        return self.factory(model, config, device)


def _registry(specs: Iterable[StrategySpec]) -> dict[str, StrategySpec]:
    return {spec.name: spec for spec in specs}


STRATEGIES: dict[str, StrategySpec] = _registry(
    [
        StrategySpec(
            "ddp",
            _ddp,
            "torch `DistributedDataParallel` + AdamW",
            zero_stage=0,
            precision="autocast",
            loss_scaler="torch",
            options=("grad_compression", "tp"),
        ),
        StrategySpec(
            "oss",
            _oss,
            "torch DDP + `OSS(AdamW)`, gradients reduced to their owner",
            zero_stage=1,
            precision="autocast",
            loss_scaler="sharded",
            checkpoint_layout="the parameters it owns (OSS), whole, with their AdamW state",
            options=("grad_compression", "tp"),
        ),
        StrategySpec(
            "sdp",
            _sdp,
            "`ShardedDataParallel` + `OSS(AdamW)`",
            zero_stage=2,
            precision="autocast",
            loss_scaler="sharded",
            checkpoint_layout="the parameters it owns (OSS), whole, with their AdamW state",
            options=("grad_compression", "tp"),
        ),
        StrategySpec(
            "fsdp",
            _fsdp,
            "`FullyShardedDataParallel` over `--dp-shard` ranks (hybrid with "
            "`--dp-replicate` > 1), one unit per Block + the root; AdamW",
            zero_stage=3,
            meta_init="optional",
            precision="native",
            loss_scaler="sharded",
            checkpoint_layout="the pieces of each parameter in its flat shard, and their "
            "AdamW state",
            options=("grad_compression", "tp", "dp_shard", "dp_replicate"),
            composes=True,
        ),
        StrategySpec(
            "hsdp",
            _hsdp,
            "`FullyShardedDataParallel(sharding_strategy='HYBRID_SHARD')`: full shard "
            "inside a node, replicas across nodes; AdamW",
            zero_stage=3,
            meta_init="optional",
            precision="native",
            loss_scaler="sharded",
            checkpoint_layout="as fsdp, on the first replica (shard group) only",
            options=("shard_size", "grad_compression", "tp", "dp_shard", "dp_replicate"),
            composes=True,
        ),
        StrategySpec(
            "pipe",
            _pipe,
            "`--pp` pipeline stages (default: one per rank), `--chunks` micro-batches, "
            "stages replicated (torch DDP) over the other data-parallel ranks; AdamW per stage",
            zero_stage=None,
            meta_init="default",
            checkpoint_layout="its stage, whole (replicated stages: their r-th 1/N), with "
            "its AdamW state",
            options=("chunks", "schedule", "tp", "pp", "dp_shard", "dp_replicate"),
            composes=True,
        ),
        StrategySpec(
            "offload",
            _offload,
            "`OffloadModel`: 4 slices on CPU memory or disk, gradients averaged",
            zero_stage=0,
            activation_checkpointing="built-in",
            checkpoint_layout="rank 0: every tensor with its AdamW state (disk tier: read from its files)",
            options=("offload_dir",),
        ),
    ]
)
"""Every ``--strategy`` of the main job, in table order (the benchmarks' order too)."""


_OPTION_ROLE = {
    "chunks": "micro-batches",
    "schedule": "its schedule",
    "offload_dir": "its disk tier",
    "shard_size": "its shard groups",
    "grad_compression": "gradient compression",
    "tp": "tensor parallelism",
    "pp": "pipeline stages",
    "dp_shard": "its data-parallel ranks",
    "dp_replicate": "its data-parallel replicas",
}
"""What each strategy-only option is, for :func:`option_error`'s message."""


def _flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def option_error(config: StrategyConfig) -> str | None:
    """Why ``config`` does not fit its strategy (an unknown name, ``--precision``,
    ``--activation-checkpointing`` or another strategy's option), or None when it does."""
    spec = STRATEGIES.get(config.name)
    if spec is None:
        return f"unknown --strategy {config.name!r}; choose one of {sorted(STRATEGIES)}"
    if config.precision != "fp32" and spec.precision is None:
        with_precision = sorted(s.name for s in STRATEGIES.values() if s.precision)
        return (
            f"--precision {config.precision} applies to strategies {with_precision}, not "
            f"{spec.name!r}; use --precision fp32"
        )
    if config.activation_checkpointing and spec.activation_checkpointing != "flag":
        with_flag = [s.name for s in STRATEGIES.values() if s.activation_checkpointing == "flag"]
        built_in = f" ({spec.name} checkpoints every slice already)"
        return (
            f"--activation-checkpointing applies to strategies {with_flag}, not {spec.name!r}"
            + (built_in if spec.activation_checkpointing == "built-in" else "")
        )
    defaults = StrategyConfig()
    for option in _OPTION_ROLE:
        value = getattr(config, option)
        if value == getattr(defaults, option) or option in spec.options:
            continue
        owners = [s.name for s in STRATEGIES.values() if option in s.options]
        return (
            f"{_flag(option)} applies to --strategy {' / '.join(owners)} only "
            f"({_OPTION_ROLE[option]}), not {spec.name!r}; drop {_flag(option)} {value} or "
            f"use --strategy {owners[0]}"
        )
    problem = moe_error(
        config.moe_experts, config.moe_top_k, config.moe_every, config.ep, config.name
    )
    if problem is not None:
        return problem
    if config.offload_dir is not None and not config.offload_dir.strip():
        return (
            "--offload-dir needs a directory (got an empty string), e.g. --offload-dir /tmp/offload"
        )
    return None


def fsdp_policy(precision: str) -> MixedPrecision | None:
    """FSDP's policy for ``--precision``: compute in bf16 / fp16, fp32 master shards;
    reduce in bf16, or in fp32 for fp16 (a sum of scaled fp16 gradients may overflow)."""
    if precision == "fp32":
        return None
    dtype = PRECISIONS[precision]
    return MixedPrecision(
        param_dtype=dtype, reduce_dtype=torch.float32 if dtype == torch.float16 else None
    )


def build_strategy(model: GPT, config: StrategyConfig, device: torch.device) -> Strategy:
    """``STRATEGIES[config.name]`` over the mesh of :func:`parallel_dims` (a collective:
    every rank builds its groups), with ``--tp`` (``tp.gpt_plan()``),
    ``--activation-checkpointing`` (every Block wrapped by ``checkpoint_wrapper``) and
    ``--precision`` (see [Note: precision per strategy]), as its spec says. A spec that
    ``composes`` (fsdp, hsdp, pipe) builds all of it with
    :func:`shardkit.compose.parallelize_model`; for the others (ddp, oss, sdp) the same
    function applies ``--tp`` and checkpointing, then the factory wraps the model over
    the mesh's ``dp`` group.

    Raises:
        ValueError: an option that does not apply to the strategy (:func:`option_error`),
            or degrees that do not fit the world size (:func:`parallel_dims`), the GPT's
            heads or its vocabulary.
    """
    problem = option_error(config)
    if problem is not None:
        raise ValueError(problem)
    spec = STRATEGIES[config.name]
    mesh = ProcessMesh(parallel_dims(config, dist.get_world_size()))
    if isinstance(model, MoEGPT) and mesh.size("ep", "tp") > 1:  # each rank keeps its experts
        tp = mesh.group("tp") if mesh.size("tp") > 1 else None
        model.split_experts(mesh.group("ep"), tp, config.sequence_parallel and tp is not None)
    if mesh.size("cp") > 1:  # attention over the cp group; inputs split by a pre-hook
        apply_context_parallel(model, mesh.group("cp"), config.cp_method)
    split: dict[str, tuple[int, int]] = {}
    if not spec.composes:
        split = _parallelize(model, config, mesh, "none", device).split_tensors
    token = _MESH.set(mesh)
    try:
        strategy = spec(model, config, device)
    finally:
        _MESH.reset(token)
    if mesh.size("tp") > 1 and not isinstance(strategy, PipeStrategy):
        strategy = TensorParallelStrategy(
            strategy, split or strategy.split_tensors, mesh.group("tp")
        )
    if config.precision == "fp32":
        return strategy
    autocast = PRECISIONS[config.precision] if spec.precision == "autocast" else None
    scaler: torch.amp.GradScaler | None = None
    if config.precision == "fp16" and spec.loss_scaler == "torch":
        scaler = torch.amp.GradScaler(device.type, init_scale=FP16_INIT_SCALE)
    elif config.precision == "fp16":
        scaler = ShardedGradScaler(init_scale=FP16_INIT_SCALE, device=device.type)
    return PrecisionStrategy(strategy, autocast, scaler)


_COLUMNS = (
    "`--strategy`",
    "wraps the GPT in",
    "ZeRO stage",
    "`--precision`",
    "fp16 loss scaler",
    "`--activation-checkpointing`",
    "meta init",
    "a rank writes (universal checkpoint)",
    "its own flags",
)


def _row(spec: StrategySpec) -> tuple[str, ...]:
    return (
        f"`{spec.name}`",
        spec.summary,
        "-" if spec.zero_stage is None else str(spec.zero_stage),
        spec.precision or "fp32 only",
        {"torch": "`GradScaler`", "sharded": "`ShardedGradScaler`", None: "-"}[spec.loss_scaler],
        {"flag": "yes", "built-in": "always (built in)", "no": "no"}[spec.activation_checkpointing],
        spec.meta_init,
        spec.checkpoint_layout,
        ", ".join(f"`{_flag(o)}`" for o in spec.options) or "-",
    )


def strategy_table() -> str:
    """The registry as the Markdown table of ``docs/train_gpt.md`` (a test keeps them equal)."""
    lines = [_COLUMNS, ("---",) * len(_COLUMNS), *(_row(s) for s in STRATEGIES.values())]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"
