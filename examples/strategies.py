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

``train_step`` is the one step contract of every strategy: the pipeline runs its
schedule (forwards and backwards of every micro-batch) inside it
(:meth:`Strategy.forward_backward`), the others a forward and ``loss.backward()``; then
the ``before_step`` hook (gradient clipping goes there) and the optimizer step. For
checkpoints and reports:

- ``state_dict()`` / ``load_state_dict(state)``: this rank's payload (model +
  optimizer), saved as ``ckpt-<step>/rank<r>.pt``. Every rank saves and loads its own
  file, so a sharded strategy returns only its shard; a replicated one (ddp) returns
  the full state on every rank. Loading happens after the factory, on the same world
  size and strategy (the manifest checks both).
- ``consolidated_model_state()``: called on every rank at the end (it may be a
  collective); returns the plain GPT's ``state_dict`` on rank 0 (saved as
  ``model.pt``), anything on other ranks; None skips the final save.
- ``model_state_bytes()``: this rank's :class:`shardkit.memory.ModelStateBytes`.

Override a method in a subclass only where the defaults (which treat ``model`` as
this rank's whole model) do not hold. Gradient accumulation (``accumulation`` > 1:
the main job's global batch kept at another world size) splits this rank's rows into
equal micro-batches, each loss weighted ``1 / accumulation``; the non-final ones run
under :meth:`Strategy.no_sync` (the wrapper's ``no_sync()``: DDP, ShardedDDP and FSDP
all have one), so gradients are reduced once per step (:meth:`Strategy.accumulate`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpt_dist import mean_over_ranks
from gpt_stage_init import materialize_stage
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.checkpoint.universal import LayoutAdapter, ParamEntry, layout_of, register_layout
from shardkit.checkpoint.universal.layout import Purpose, session_of
from shardkit.compose import DataParallel, ParallelModel, PipelineSplit, parallelize_model
from shardkit.distributed import mpu
from shardkit.distributed.compression import get_compressor, register_ddp_comm_hook
from shardkit.distributed.mesh import ParallelDims, ProcessMesh
from shardkit.memory import ModelStateBytes, model_state_bytes
from shardkit.models import GPT, Block, gpt_stages, gpt_unit_init_fn
from shardkit.nn import tensor_parallel as tp
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel, MixedPrecision
from shardkit.nn.offload import DiskTier, OffloadModel, remove_offloaded
from shardkit.nn.pipe import consolidated_state_dict
from shardkit.optim import OSS, register_reduce_to_owner_hook
from shardkit.optim.grad_scaler import ShardedGradScaler

__all__ = [
    "PRECISIONS",
    "STRATEGIES",
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

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class StrategyConfig:
    """The options a strategy reads: the main job's flags of the same names.

    Attributes:
        name: the registry key (``--strategy``). Default ``"ddp"``.
        lr: AdamW's peak learning rate (:func:`adamw_kwargs`). Default 2e-3.
        precision: ``fp32``, ``bf16`` or ``fp16`` compute (strategies whose spec has a
            ``precision`` mode). Default ``fp32``.
        activation_checkpointing: recompute every Block in backward. Default False.
        chunks: pipe: micro-batches per step. Default 4.
        schedule: pipe: ``gpipe`` or ``1f1b``. Default ``1f1b``.
        offload_dir: offload: the disk tier's directory (``rank<r>/`` per rank); None:
            CPU memory. Default None.
        resume: the job resumes from a checkpoint (offload's disk tier then starts
            its directory afresh: the checkpoint, or the step-0 model when there is
            none, is what it continues from). Default False.
        shard_size: hsdp: ranks per shard group (one node's); None: torchrun's
            ``LOCAL_WORLD_SIZE``. Default None.
        grad_compression: ddp, oss, sdp, fsdp, hsdp: a gradient compressor's name
            (``bf16``, ``fp16``, ``powersgd``, ``int8``; :mod:`shardkit.distributed.compression`)
            for the gradient reduction (hsdp: the cross-node all-reduce only). Default
            None: exact.
        tp: ddp, oss, sdp, fsdp, hsdp, pipe: the tensor-parallel degree (the mesh's
            ``tp``). Above 1 the GPT is split over groups of ``tp`` consecutive ranks
            (``tp.gpt_plan()``) and the strategy reduces, shards or pipelines over the
            other ranks only. Default 1.
        dp_shard: fsdp, hsdp, pipe: the mesh's ``dp_shard`` (ranks sharding each FSDP
            unit; pipe: stage replicas). None: inferred (:func:`parallel_dims`).
            Default None.
        dp_replicate: fsdp, hsdp, pipe: the mesh's ``dp_replicate`` (replicas of the
            shards: hybrid sharding above 1). None: inferred. Default None.
        pp: pipe: the mesh's ``pp`` (pipeline stages). None: inferred. Default None.
    """

    name: str = "ddp"
    lr: float = 2e-3
    precision: Precision = "fp32"
    activation_checkpointing: bool = False
    chunks: int = 4
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    offload_dir: str | None = None
    resume: bool = False
    shard_size: int | None = None
    grad_compression: str | None = None
    tp: int = 1
    dp_shard: int | None = None
    dp_replicate: int | None = None
    pp: int | None = None


class Strategy:
    """A wrapped model and its optimizer, as the training loop sees them.

    Args:
        module: the module to call forward on, ``module(x, targets=y) -> (logits, loss)``
            with ``x``, ``y`` of shape ``(batch, seq_len)``.
        optimizer: steps this rank's parameters (an LR scheduler is attached to it).
        model: the module whose ``state_dict`` is this rank's model payload; default
            ``module``. For a wrapper that adds a prefix (DDP's ``module.``) pass the
            plain model, so checkpoints hold plain GPT keys.
    """

    #: the fp16 loss scaler (``--precision fp16``); it skips steps whose gradients are
    #: not finite, so :meth:`train_step` leaves that decision to it
    scaler: torch.amp.GradScaler | None = None

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, model: nn.Module | None = None
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.model = module if model is None else model
        #: ``(partition_dim, partition_stride)`` of each tensor-parallel tensor by its
        #: plain GPT key (``ParallelModel.split_tensors``); empty without ``--tp``
        self.split_tensors: dict[str, tuple[int, int]] = {}

    def train_step(self, x: torch.Tensor, y: torch.Tensor, accumulation: int = 1) -> float:
        """One training step on this rank's batch; the loss averaged over ranks.

        Gradients zeroed, :meth:`accumulate` (:meth:`forward_backward` per micro-batch),
        one all-reduce of the loss, then :meth:`before_step` and :meth:`step`, unless the
        mean loss is not finite: then no rank steps (the model keeps its last good
        state) and the caller sees the NaN or inf. With a loss scaler the step is always
        taken: the scaler skips it.

        Args:
            x: input token ids, ``(rows, seq_len)`` int64, on this rank's device.
            y: target token ids, the same shape.
            accumulation: micro-batches the rows are split into (gradient
                accumulation); it must divide ``rows``. Default 1.

        Returns:
            The mean over ranks of each rank's loss (the same on every rank).
        """
        self.optimizer.zero_grad(set_to_none=True)
        mean = mean_over_ranks(self.accumulate(x, y, accumulation))
        if math.isfinite(mean) or self.scaler is not None:
            self.before_step()
            self.step()
        return mean

    def accumulate(self, x: torch.Tensor, y: torch.Tensor, accumulation: int) -> torch.Tensor:
        """:meth:`forward_backward` on ``accumulation`` equal micro-batches of the rows,
        each loss weighted ``1 / accumulation`` (the gradient of the rows' mean loss),
        all but the last under :meth:`no_sync`; the mean of their losses, detached.

        Raises:
            ValueError: ``accumulation`` does not divide the rows.
        """
        if accumulation == 1:  # no weighting: bit for bit the plain step
            return self.forward_backward(x, y)
        if accumulation < 1 or len(x) % accumulation:
            raise ValueError(f"{len(x)} rows do not split into {accumulation} equal micro-batches")
        rows, total = len(x) // accumulation, torch.zeros((), device=x.device)
        for i, (xi, yi) in enumerate(zip(x.split(rows), y.split(rows), strict=True)):
            last = i == accumulation - 1
            with contextlib.nullcontext() if last else self.no_sync():
                total = total + self.forward_backward(xi, yi, 1.0 / accumulation)
        return total / accumulation

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """The wrapper's ``no_sync()`` (gradients kept local, reduced after the next
        backward outside it); a null context where ``module`` has none."""
        sync = getattr(self.module, "no_sync", None)
        return sync() if sync is not None else contextlib.nullcontext()

    def forward_backward(
        self, x: torch.Tensor, y: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        """Forward with the loss, then :meth:`backward` of ``weight x loss`` (1.0: the
        loss itself); this rank's loss (unweighted), detached."""
        _, loss = self.module(x, targets=y)
        self.backward(loss if weight == 1.0 else loss * weight)
        return loss.detach()

    def state_dict(self) -> dict[str, Any]:
        """This rank's checkpoint payload: ``{"model": ..., "optimizer": ...}``."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned on this rank."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def checkpoint_module(self) -> Any:
        """The wrapped model as ``shardkit.checkpoint.universal`` takes it (DDP,
        ShardedDataParallel, FSDP, OffloadModel, ...): its layout adapter says which
        piece of which plain GPT tensor this rank holds. Default ``module``."""
        return self.module

    def extra_state(self) -> dict[str, Any]:
        """State besides the model and optimizer that a checkpoint must carry (the fp16
        loss scaler's); plain data and tensors, the same on every rank. Default none."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`extra_state` returned (on any rank, at any world size)."""

    def consolidated_model_state(self) -> dict[str, Any] | None:
        """The plain GPT ``state_dict`` (on rank 0); called on every rank."""
        return self.model.state_dict()

    def model_state_bytes(self) -> ModelStateBytes:
        """Bytes of parameters, gradients, optimizer state and buffers on this rank."""
        return model_state_bytes(self.module, self.optimizer)

    def before_step(self) -> None:
        """Called after the backward pass, before :meth:`step`; default no-op.

        Gradient clipping goes here; a sharded strategy must clip by the global norm
        (its wrapper's ``clip_grad_norm_``), not by the norm of its local shard.
        """

    def backward(self, loss: torch.Tensor) -> None:
        """The backward pass of :meth:`forward_backward`; default ``loss.backward()``."""
        loss.backward()

    def step(self) -> None:
        """The optimizer step of :meth:`train_step`; default ``optimizer.step()``."""
        self.optimizer.step()


StrategyFactory = Callable[[GPT, StrategyConfig, torch.device], Strategy]


def adamw_kwargs(config: StrategyConfig) -> dict[str, Any]:
    """The optimizer settings every strategy uses: AdamW at ``config.lr`` (the peak LR)."""
    return {"lr": config.lr, "betas": (0.9, 0.95), "weight_decay": 0.01}


_MESH: ContextVar[ProcessMesh | None] = ContextVar("mesh", default=None)


def parallel_dims(config: StrategyConfig, world_size: int) -> ParallelDims:
    """The mesh of ``config`` on ``world_size`` ranks: the ``--pp``, ``--dp-replicate``,
    ``--dp-shard``, ``--tp`` given, the others inferred as the strategy's shorthand says:

    - fsdp: ``dp_shard`` is the rest (``dp_replicate`` default 1);
    - hsdp: ``dp_shard`` is ``--shard-size`` (default ``LOCAL_WORLD_SIZE / tp``: one
      node's data-parallel ranks), ``dp_replicate`` the rest;
    - pipe: ``pp`` is the rest (one stage per rank by default), ``dp_shard`` is the
      rest when ``--pp`` is given;
    - ddp, oss, sdp, offload: ``tp`` only; the data-parallel ranks are the rest.

    Raises:
        ValueError: degrees whose product is not ``world_size`` (the equation named),
            or ``--shard-size`` and ``--dp-shard`` both given and different.
    """
    tp_, pp, dpr, dps = config.tp, config.pp, config.dp_replicate, config.dp_shard
    if config.name == "hsdp":
        if config.shard_size is not None and dps not in (None, config.shard_size):
            raise ValueError(
                f"--shard-size {config.shard_size} and --dp-shard {dps} name the same "
                "degree (ranks per shard group); give one of them"
            )
        if dps is None:
            dps = config.shard_size
        if dps is None and dpr is None:
            dps = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) // tp_)
        if dpr is None:
            others = (pp or 1) * tp_ * (dps or 1)
            dpr = world_size // others if world_size % others == 0 else -1
            if dpr < 1:
                raise ValueError(
                    f"hsdp: the world size {world_size} is not a multiple of "
                    f"dp_shard ({dps}) x tp ({tp_}) = {others}; choose a --shard-size "
                    f"(or --dp-shard) whose product with --tp divides {world_size}"
                )
    elif config.name == "pipe" and pp is None:
        others = (dpr or 1) * (dps or 1) * tp_
        pp = world_size // others if world_size % others == 0 else world_size
    return ParallelDims(world_size, pp=pp or 1, dp_replicate=dpr or 1, dp_shard=dps or -1, tp=tp_)


def strategy_mesh(config: StrategyConfig) -> ProcessMesh:
    """The mesh a factory builds on: :func:`build_strategy`'s (set while the factory
    runs), else one built here from :func:`parallel_dims` (a collective when it
    creates groups: call it on every rank)."""
    mesh = _MESH.get()
    return mesh if mesh is not None else ProcessMesh(parallel_dims(config, dist.get_world_size()))


def data_parallel_group() -> dist.ProcessGroup | None:
    """The group a data-parallel factory (ddp, oss, sdp) reduces or shards over: under
    ``--tp`` > 1 the mesh's ``dp`` group (set by :func:`build_strategy` while the
    factory runs), else None (the world)."""
    mesh = _MESH.get()
    return mesh.group("dp") if mesh is not None and mesh.size("tp") > 1 else None


def _ddp(model: GPT, config: StrategyConfig, device: torch.device) -> Strategy:
    """torch DistributedDataParallel + AdamW: every rank holds the full model state."""
    device_ids = [device] if device.type == "cuda" else None
    module = DistributedDataParallel(
        model, device_ids=device_ids, process_group=data_parallel_group()
    )
    if config.grad_compression is not None:
        register_ddp_comm_hook(module, config.grad_compression)
    optimizer = torch.optim.AdamW(model.parameters(), **adamw_kwargs(config))
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
    optimizer = OSS(
        model.parameters(), optim=torch.optim.AdamW, process_group=group, **adamw_kwargs(config)
    )
    register_reduce_to_owner_hook(module, optimizer, grad_compression=config.grad_compression)
    return _OSSStrategy(module=module, optimizer=optimizer, model=model)


def _sdp(model: GPT, config: StrategyConfig, device: torch.device) -> Strategy:
    """ShardedDataParallel + OSS(AdamW): gradients and optimizer state sharded (ZeRO-2)."""
    group = data_parallel_group()
    optimizer = OSS(
        model.parameters(), optim=torch.optim.AdamW, process_group=group, **adamw_kwargs(config)
    )
    module = ShardedDataParallel(
        model, optimizer, process_group=group, grad_compression=config.grad_compression
    )
    return _OSSStrategy(module=module, optimizer=optimizer, model=model)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, as ``GPT.forward`` computes it."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class PipelineGPT(nn.Module):
    """This rank's pipeline stage of the GPT: the schedule in :meth:`forward_backward`.

    Built by :func:`shardkit.compose.parallelize_model` over the mesh's ``pp`` ranks
    (``gpt_stages``, balanced by size), after ``--tp`` and
    ``--activation-checkpointing``; with ``dp`` > 1 each stage is replicated (torch
    DDP) over the ranks holding the same stage. ``model`` may be built on the meta
    device (the main job does without ``--tp``, see the spec's ``meta_init``): only
    this rank's stage is then allocated and initialised, bit-identically to the plain
    GPT's initialisation at the same seed (:func:`gpt_stage_init.materialize_stage`).

    Every rank samples its own batch, as under DDP; the batches of one pipeline's ranks
    (its ``pp`` group) are all-gathered so that each pipeline trains on ``pp x batch``
    rows and the ``dp`` pipelines together on the global batch DDP would (mean loss,
    gradients averaged over the replicas). :meth:`forward_backward` runs the whole
    schedule (forwards and backwards of every micro-batch); ``forward``
    (``module(x, targets=y)``, as the evaluation calls it) runs the forwards only,
    without gradients. The tied embedding / LM-head weight lives on the first and the
    last stage; :meth:`ParallelModel.pipeline_step` sums their gradients.
    """

    def __init__(self, parallel: ParallelModel) -> None:
        super().__init__()
        assert parallel.stage is not None and parallel.schedule is not None
        self.parallel = parallel
        self.stage, self.runner = parallel.stage, parallel.schedule
        self.group = parallel.mesh.group("pp")
        self.last = parallel.mesh.ranks("pp")[-1]
        # this rank's stage, unwrapped: plain gpt_stages keys
        inner = getattr(self.stage.module, "module", self.stage.module)
        self.stage_module: nn.Module = inner

    def _global(self, t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts)

    def _on_every_rank(self, loss: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """The last stage's loss (shape ``()``), broadcast to every stage."""
        out = loss.detach().reshape(()) if loss is not None else torch.zeros((), device=device)
        dist.broadcast(out, self.last, group=self.group)
        return out

    def forward_backward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule on this pipeline's batch; its mean loss (detached, on every rank)."""
        x, y = self._global(x), self._global(targets)
        first, last = self.stage.is_first, self.stage.is_last
        loss = self.parallel.pipeline_step(x if first else None, y if last else None)
        return self._on_every_rank(loss, x.device)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[None, torch.Tensor]:
        """The forwards only (evaluation): ``(None, mean loss)`` on every rank."""
        x, y = self._global(x), self._global(targets)
        logits = self.runner.forward(x if self.stage.is_first else None)
        loss = lm_loss(logits, y) if isinstance(logits, torch.Tensor) else None
        return None, self._on_every_rank(loss, x.device)


class _PipeStrategy(Strategy):
    """Checkpoints hold this rank's stage (keys of ``gpt_stages``); the final
    ``model.pt`` holds the plain GPT, consolidated from every stage onto rank 0."""

    module: PipelineGPT

    def __init__(self, module: PipelineGPT, optimizer: torch.optim.Optimizer, gpt: GPT) -> None:
        super().__init__(module=module, optimizer=optimizer, model=module.stage_module)
        self.gpt = gpt

    def forward_backward(
        self, x: torch.Tensor, y: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        if weight != 1.0:
            raise ValueError(f"pipe runs whole steps only (weight {weight}, expected 1.0)")
        return self.module.forward_backward(x, y)

    def checkpoint_module(self) -> Any:
        """The :class:`PipelineGPT`: this rank's stage under the plain GPT's keys
        (:class:`GPTKeys`)."""
        return self.module

    def accumulate(self, x: torch.Tensor, y: torch.Tensor, accumulation: int) -> torch.Tensor:
        """Every row in one schedule (its ``--chunks`` micro-batches already accumulate
        the gradients of the global batch): the same gradient for any ``accumulation``."""
        return self.forward_backward(x, y)

    def consolidated_model_state(self) -> dict[str, Any] | None:
        """The plain GPT's state dict on rank 0: each stage's tensor-parallel parts
        gathered over ``tp``, then the stages over ``pp`` (every pipeline replica
        gathers its own; rank 0's is kept)."""
        parallel = self.module.parallel
        split = parallel.split_tensors
        group = parallel.mesh.group("tp")

        def full(key: str, value: torch.Tensor) -> torch.Tensor:
            if gpt_key(key) not in split:
                return value
            dim, stride = split[gpt_key(key)]
            return tp.full_tensor(value, dim, group, stride)

        merged = consolidated_state_dict(
            self.module.stage_module, process_group=self.module.group, transform=full
        )
        if merged is None:
            return None
        # plain GPT keys, matched to gpt_stages keys by tensor identity (rank 0 may hold
        # only its stage: the other layers are on meta)
        stage_key = {id(t): k for k, t in gpt_stages(self.gpt).state_dict(keep_vars=True).items()}
        return {k: merged[stage_key[id(t)]] for k, t in self.gpt.state_dict(keep_vars=True).items()}


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
    return _PipeStrategy(module, optimizer, model)


class OffloadGPT(nn.Module):
    """The GPT as an :class:`OffloadModel` behind the loop's ``module(x, targets=y)``."""

    def __init__(self, offload: OffloadModel) -> None:
        super().__init__()
        self.offload = offload

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.offload(x)
        return logits, lm_loss(logits, targets)


class _OffloadStrategy(Strategy):
    """Offload: checkpoints and ``model.pt`` hold plain GPT keys. On the disk tier the
    model state lives in ``--offload-dir/rank<r>`` (stepped by ``sliced_optimizer``);
    the universal checkpoint reads it from there and a resume writes it back
    (:class:`GPTKeys` over OffloadModel's layout). The per-rank ``state_dict`` records
    the directory's generation: loading it needs the directory at that generation."""

    module: OffloadGPT

    def __init__(self, module: OffloadGPT, optimizer: torch.optim.Optimizer, gpt: GPT) -> None:
        super().__init__(module=module, optimizer=optimizer, model=gpt)
        names = {id(p): n for n, p in gpt.named_parameters()}
        self.to_gpt = {n: names[id(p)] for n, p in module.offload.named_parameters()}
        self.disk = module.offload.tier if isinstance(module.offload.tier, DiskTier) else None

    def _gpt_state(self) -> dict[str, Any]:
        if self.disk is None:
            return self.model.state_dict()
        state = {self.to_gpt[k]: v for k, v in self.module.offload.state_dict().items()}
        state["lm_head.weight"] = state["wte.weight"]  # tied
        return state

    def state_dict(self) -> dict[str, Any]:
        if self.disk is None:
            return super().state_dict()
        return {
            "model": self._gpt_state(),
            "optimizer": self.optimizer.state_dict(),  # hyperparameters (LR) only
            "offload_generation": self.disk.generation,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.disk is None:
            super().load_state_dict(state)
        elif state["offload_generation"] != self.disk.generation:
            raise ValueError(
                f"the checkpoint is at offload generation {state['offload_generation']} but "
                f"{self.disk.directory} holds generation {self.disk.generation}; resume from "
                "the checkpoint written with the directory's last step"
            )
        else:
            self.optimizer.load_state_dict(state["optimizer"])

    def consolidated_model_state(self) -> dict[str, Any] | None:
        return self._gpt_state()

    def checkpoint_module(self) -> Any:
        """The :class:`OffloadGPT`: its slices under the plain GPT's keys
        (:class:`GPTKeys`), on the CPU tier or the disk tier."""
        return self.module


def gpt_key(stage_key: str) -> str:
    """The plain GPT's key of a ``gpt_stages`` key: ``"0.wte.weight"`` -> ``"wte.weight"``,
    ``"2.attn.qkv.weight"`` -> ``"blocks.1.attn.qkv.weight"``, ``"5.ln_f.bias"`` ->
    ``"ln_f.bias"`` (the embedding and the head keep their attribute names)."""
    index, _, rest = stage_key.partition(".")
    if rest.startswith(("wte.", "wpe.", "ln_f.", "lm_head.")):
        return rest
    return f"blocks.{int(index) - 1}.{rest}"


class GPTKeys:
    """The universal-checkpoint layout of a ``gpt_stages`` wrapper (pipe, offload) under
    the plain GPT's keys, so that its checkpoints cross to and from ddp, oss, sdp, fsdp.

    ``inner`` is the wrapper's own adapter (keys of ``gpt_stages``). The tied LM-head
    weight appears as ``lm_head.weight`` only where it is a copy of its own (the last
    pipeline stage, the first holding ``wte.weight``): the plain GPT saves the tied
    weight once, as ``wte.weight``, so that copy is listed under ``wte.weight`` and
    not written (the first stage writes it), and loading fills it from ``wte.weight``.
    """

    def __init__(self, inner: LayoutAdapter) -> None:
        self.inner = inner
        self.strategy = inner.strategy

    def entries(self) -> Iterator[ParamEntry]:
        for entry in self.inner.entries():
            key = gpt_key(entry.key)
            if key == "lm_head.weight":
                yield dataclasses.replace(entry, key="wte.weight", write=False)
            else:
                yield dataclasses.replace(entry, key=key)

    def aliases(self) -> dict[str, str]:
        """The plain GPT's tied key (its LM head is the token embedding), recorded in
        the manifest so that ``python -m shardkit.checkpoint convert`` writes both
        names and the output loads into ``GPT`` with ``strict=True``."""
        return {"lm_head.weight": "wte.weight"}

    def after_load(self) -> None:
        self.inner.after_load()

    def session(self, purpose: Purpose) -> contextlib.AbstractContextManager[Any]:
        """The inner adapter's session (the offload disk tier maps its files in it)."""
        return session_of(self.inner, purpose)


register_layout(PipelineGPT, lambda model, optimizer: GPTKeys(layout_of(model.stage, optimizer)))
register_layout(OffloadGPT, lambda model, optimizer: GPTKeys(layout_of(model.offload, optimizer)))


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
    return _OffloadStrategy(OffloadGPT(offload), optimizer, model)


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
    parallel = _parallelize(model, config, strategy_mesh(config), "fsdp", device)
    optimizer = torch.optim.AdamW(parallel.parameters(), **adamw_kwargs(config))
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
    if fsdp:  # a GPT built on meta is materialised unit by unit (deferred initialisation)
        meta = any(p.is_meta for p in model.parameters())
        kwargs["param_init_fn"] = gpt_unit_init_fn if meta else None
    if fsdp and config.grad_compression is not None:  # one compressor, state per unit
        kwargs["grad_compression"] = get_compressor(config.grad_compression)
    return parallelize_model(
        model,
        mesh,
        tp_plan=tp.gpt_plan(),
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


class Autocast(nn.Module):
    """``module``'s forward under ``torch.autocast(dtype)`` on the inputs' device type."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> Any:
        with torch.autocast(x.device.type, dtype=self.dtype):
            return self.module(x, targets=targets)


class _Precision(Strategy):
    """A strategy with autocast around its forward and/or a loss scaler (fp16); every
    checkpoint and report method is the inner strategy's (plus the scaler's state)."""

    def __init__(
        self, inner: Strategy, autocast: torch.dtype | None, scaler: torch.amp.GradScaler | None
    ) -> None:
        module = inner.module if autocast is None else Autocast(inner.module, autocast)
        super().__init__(module=module, optimizer=inner.optimizer, model=inner.model)
        self.inner, self.scaler = inner, scaler

    def state_dict(self) -> dict[str, Any]:
        state = self.inner.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def checkpoint_module(self) -> Any:
        return self.inner.checkpoint_module()

    def extra_state(self) -> dict[str, Any]:
        state = self.inner.extra_state()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.inner.load_extra_state(state)
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def consolidated_model_state(self) -> dict[str, Any] | None:
        return self.inner.consolidated_model_state()

    def model_state_bytes(self) -> ModelStateBytes:
        return self.inner.model_state_bytes()

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return self.inner.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        scaled: torch.Tensor = loss if self.scaler is None else self.scaler.scale(loss)
        scaled.backward()

    def before_step(self) -> None:
        if self.scaler is not None:  # clipping in the inner hook sees true gradients
            self.scaler.unscale_(self.optimizer)
        self.inner.before_step()

    def step(self) -> None:
        if self.scaler is None:
            self.optimizer.step()
            return
        self.scaler.step(self.optimizer)
        self.scaler.update()


class _TensorParallel(Strategy):
    """A data-parallel strategy over a tensor-parallel GPT (``--tp``): every method is
    the inner strategy's, except that ``model.pt`` gathers the split tensors back.

    Args:
        inner: the strategy, built over the mesh's data-parallel group.
        layout: ``(partition_dim, partition_stride)`` of each split tensor, by its plain
            GPT key (read from the parallelized GPT before any wrapper flattens it).
        group: the tensor-parallel group.
    """

    def __init__(
        self, inner: Strategy, layout: dict[str, tuple[int, int]], group: dist.ProcessGroup
    ) -> None:
        super().__init__(module=inner.module, optimizer=inner.optimizer, model=inner.model)
        self.inner, self.layout, self.group = inner, layout, group
        self.scaler = inner.scaler

    def forward_backward(
        self, x: torch.Tensor, y: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        return self.inner.forward_backward(x, y, weight)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return self.inner.no_sync()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()  # this rank's tensor-parallel shard

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def checkpoint_module(self) -> Any:
        return self.inner.checkpoint_module()

    def extra_state(self) -> dict[str, Any]:
        return self.inner.extra_state()

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.inner.load_extra_state(state)

    def consolidated_model_state(self) -> dict[str, Any] | None:
        """The plain GPT's state dict: the inner strategy's (tensor-parallel shards
        under plain keys, on every rank), each split tensor all-gathered over the
        tensor-parallel group (a collective)."""
        state = self.inner.consolidated_model_state()
        if state is None:
            return None
        missing = sorted(set(self.layout) - set(state))
        if missing:
            raise KeyError(f"the consolidated state lacks the split tensors {missing}")
        full = {}
        for key, value in state.items():  # the same order on every rank
            if key in self.layout:
                dim, stride = self.layout[key]
                value = tp.full_tensor(value, dim, self.group, stride)
            full[key] = value
        return full

    def model_state_bytes(self) -> ModelStateBytes:
        return self.inner.model_state_bytes()

    def before_step(self) -> None:
        self.inner.before_step()

    def backward(self, loss: torch.Tensor) -> None:
        self.inner.backward(loss)

    def step(self) -> None:
        self.inner.step()


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
    if mesh.size("tp") > 1:
        # removed once the shard descriptor records replica groups: the universal
        # checkpoint writes a tensor every tensor-parallel rank holds whole from
        # tensor-parallel rank 0 of the process-wide mesh (train_gpt.main forgets it)
        mpu.set_mesh(mesh)
    split: dict[str, tuple[int, int]] = {}
    if not spec.composes:
        split = _parallelize(model, config, mesh, "none", device).split_tensors
    token = _MESH.set(mesh)
    try:
        strategy = spec(model, config, device)
    finally:
        _MESH.reset(token)
    if mesh.size("tp") > 1 and not isinstance(strategy, _PipeStrategy):
        strategy = _TensorParallel(strategy, split or strategy.split_tensors, mesh.group("tp"))
    if config.precision == "fp32":
        return strategy
    autocast = PRECISIONS[config.precision] if spec.precision == "autocast" else None
    scaler: torch.amp.GradScaler | None = None
    if config.precision == "fp16" and spec.loss_scaler == "torch":
        scaler = torch.amp.GradScaler(device.type, init_scale=FP16_INIT_SCALE)
    elif config.precision == "fp16":
        scaler = ShardedGradScaler(init_scale=FP16_INIT_SCALE, device=device.type)
    return _Precision(strategy, autocast, scaler)


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
