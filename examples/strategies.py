"""The ``--strategy`` registry of the main job: how the plain GPT is wrapped for training.

[Note: adding a strategy]
Write one factory and add one line to :data:`STRATEGIES`::

    def _oss(model: GPT, args: argparse.Namespace, device: torch.device) -> Strategy:
        optimizer = OSS(model.parameters(), torch.optim.AdamW, **adamw_kwargs(args))
        return Strategy(module=DistributedDataParallel(model), optimizer=optimizer, model=model)

    STRATEGIES = {"ddp": _ddp, "oss": _oss}

A factory gets ``(model, args, device)``: the plain :class:`GPT`, already on ``device``
and identical on every rank (same seed); the parsed command line (build the optimizer
from :func:`adamw_kwargs` so that every strategy trains with the same settings); and
this rank's device. The default process group is initialised. It returns a
:class:`Strategy`, which the training loop (``train_gpt.py``) uses like this::

    optimizer.zero_grad(set_to_none=True)
    _, loss = strategy.module(x, targets=y)   # forward: (logits, mean loss)
    loss.backward()
    strategy.before_step()                    # hook: gradient clipping goes here
    strategy.optimizer.step(); scheduler.step()

and, for checkpoints and reports:

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
this rank's whole model) do not hold. The main job does no gradient accumulation; if
it ever does, the non-final micro-batches go under the wrapper's ``no_sync()``
context (DDP, ShardedDDP and FSDP all have one), in the loop above.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpt_stage_init import materialize_stage
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.memory import ModelStateBytes, model_state_bytes
from shardkit.models import GPT, Block, gpt_stages, gpt_unit_init_fn
from shardkit.nn.checkpoint import CheckpointWrapper, checkpoint_wrapper
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel, MixedPrecision
from shardkit.nn.offload import DiskTier, OffloadModel
from shardkit.nn.pipe import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    balance_by_size,
    consolidated_state_dict,
    stage_module,
)
from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy
from shardkit.optim import OSS, register_reduce_to_owner_hook
from shardkit.optim.grad_scaler import ShardedGradScaler

__all__ = [
    "STRATEGIES",
    "Strategy",
    "StrategyFactory",
    "adamw_kwargs",
    "build_strategy",
    "fsdp_policy",
    "option_error",
]


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

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, model: nn.Module | None = None
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.model = module if model is None else model

    def state_dict(self) -> dict[str, Any]:
        """This rank's checkpoint payload: ``{"model": ..., "optimizer": ...}``."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned on this rank."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def consolidated_model_state(self) -> dict[str, Any] | None:
        """The plain GPT ``state_dict`` (on rank 0); called on every rank."""
        return self.model.state_dict()

    def model_state_bytes(self) -> ModelStateBytes:
        """Bytes of parameters, gradients, optimizer state and buffers on this rank."""
        return model_state_bytes(self.module, self.optimizer)

    def before_step(self) -> None:
        """Called after ``backward()``, before ``optimizer.step()``; default no-op.

        Gradient clipping goes here; a sharded strategy must clip by the global norm
        (its wrapper's ``clip_grad_norm_``), not by the norm of its local shard.
        """

    def backward(self, loss: torch.Tensor) -> None:
        """The backward pass of the loop; default ``loss.backward()``."""
        loss.backward()

    def step(self) -> None:
        """The optimizer step of the loop; default ``optimizer.step()``."""
        self.optimizer.step()


StrategyFactory = Callable[[GPT, argparse.Namespace, torch.device], Strategy]


def adamw_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The optimizer settings every strategy uses: AdamW at ``args.lr`` (the peak LR)."""
    return {"lr": args.lr, "betas": (0.9, 0.95), "weight_decay": 0.01}


def _ddp(model: GPT, args: argparse.Namespace, device: torch.device) -> Strategy:
    """torch DistributedDataParallel + AdamW: every rank holds the full model state."""
    device_ids = [device] if device.type == "cuda" else None
    module = DistributedDataParallel(model, device_ids=device_ids)
    optimizer = torch.optim.AdamW(model.parameters(), **adamw_kwargs(args))
    return Strategy(module=module, optimizer=optimizer, model=model)


class _OSSStrategy(Strategy):
    """A strategy whose optimizer is an :class:`OSS`: checkpoints hold this rank's shard."""

    optimizer: OSS

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.sharded_state_dict()}


def _oss(model: GPT, args: argparse.Namespace, device: torch.device) -> Strategy:
    """torch DDP + OSS(AdamW): optimizer state sharded across ranks (ZeRO-1); each
    gradient reduced to its owner only (``reduce_to_owner_hook``: 2 psi per step)."""
    device_ids = [device] if device.type == "cuda" else None
    module = DistributedDataParallel(model, device_ids=device_ids)
    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, **adamw_kwargs(args))
    register_reduce_to_owner_hook(module, optimizer)
    return _OSSStrategy(module=module, optimizer=optimizer, model=model)


def _sdp(model: GPT, args: argparse.Namespace, device: torch.device) -> Strategy:
    """ShardedDataParallel + OSS(AdamW): gradients and optimizer state sharded (ZeRO-2)."""
    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, **adamw_kwargs(args))
    module = ShardedDataParallel(model, optimizer)
    return _OSSStrategy(module=module, optimizer=optimizer, model=model)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, as ``GPT.forward`` computes it."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class PipelineGPT(nn.Module):
    """This rank's pipeline stage of the GPT behind the loop's ``module(x, targets=y)``.

    ``model`` may be built on the meta device (the main job does, see :data:`META_INIT`):
    only this rank's stage is then allocated and initialised, bit-identically to the
    plain GPT's initialisation at the same seed (:func:`gpt_stage_init.materialize_stage`).

    Every rank samples its own batch, as under DDP; the batches are all-gathered so that
    the pipeline trains on the same global batch DDP would (``world_size * batch``
    rows, mean loss). In training, ``forward`` runs the whole schedule (forwards and
    backwards) and returns ``(None, loss)`` with ``loss`` a detached leaf, so the loop's
    ``loss.backward()`` does nothing more. The tied embedding / LM-head weight lives
    on the first and the last stage; their gradients are summed after each step so
    both copies stay equal.
    """

    def __init__(self, model: GPT, args: argparse.Namespace, device: torch.device) -> None:
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        layers = gpt_stages(model)
        self.stage_module = stage_module(layers, balance_by_size(world, layers), rank)
        if model.wte.weight.is_meta:
            materialize_stage(model, self.stage_module, device)
        self.stage = PipelineStage(self.stage_module, device=device)
        self.runner: ScheduleGPipe | Schedule1F1B
        if args.schedule == "1f1b":
            self.runner = Schedule1F1B(self.stage, args.chunks, loss_fn=lm_loss)
        else:
            self.runner = ScheduleGPipe(self.stage, args.chunks, loss_fn=lm_loss)
        self.tied_group = dist.new_group([0, world - 1]) if world > 1 else None
        # this stage's copy of the tied weight (a tuple: not registered as a parameter here)
        self.tied = (model.lm_head.weight if rank == world - 1 else model.wte.weight,)

    def _global(self, t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[None, torch.Tensor]:
        x, y = self._global(x), self._global(targets)
        first, last = self.stage.is_first, self.stage.is_last
        if self.training and torch.is_grad_enabled():
            loss = self.runner.step(x if first else None, target=y if last else None)
            grad = self.tied[0].grad
            if self.tied_group is not None and (first or last) and grad is not None:
                dist.all_reduce(grad, group=self.tied_group)
        else:
            logits = self.runner.forward(x if first else None)
            loss = lm_loss(logits, y) if isinstance(logits, torch.Tensor) else None
        out = loss.detach().reshape(()) if loss is not None else torch.zeros((), device=x.device)
        dist.broadcast(out, dist.get_world_size() - 1)
        return None, out.requires_grad_()


class _PipeStrategy(Strategy):
    """Checkpoints hold this rank's stage (keys of ``gpt_stages``); the final
    ``model.pt`` holds the plain GPT, consolidated from every stage onto rank 0."""

    module: PipelineGPT

    def __init__(self, module: PipelineGPT, optimizer: torch.optim.Optimizer, gpt: GPT) -> None:
        super().__init__(module=module, optimizer=optimizer, model=module.stage_module)
        self.gpt = gpt

    def consolidated_model_state(self) -> dict[str, Any] | None:
        merged = consolidated_state_dict(self.module.stage_module)
        if merged is None:
            return None
        # plain GPT keys, matched to gpt_stages keys by tensor identity (rank 0 may hold
        # only its stage: the other layers are on meta)
        stage_key = {id(t): k for k, t in gpt_stages(self.gpt).state_dict(keep_vars=True).items()}
        return {k: merged[stage_key[id(t)]] for k, t in self.gpt.state_dict(keep_vars=True).items()}


def _pipe(model: GPT, args: argparse.Namespace, device: torch.device) -> Strategy:
    """GPT blocks split over the ranks (one stage each), ``--chunks`` micro-batches,
    ``--schedule gpipe|1f1b``; AdamW on each stage's parameters."""
    module = PipelineGPT(model, args, device)
    optimizer = torch.optim.AdamW(module.stage_module.parameters(), **adamw_kwargs(args))
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
    optimizer state lives in ``--offload-dir/rank<r>``: a checkpoint records the
    directory's generation, and resuming reopens the directory at that generation."""

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


def _offload(model: GPT, args: argparse.Namespace, device: torch.device) -> Strategy:
    """OffloadModel over the GPT's stages (embedding, blocks, head; the tied embedding /
    LM head weight stays resident), 4 slices, activation checkpointing, gradients
    averaged across ranks. CPU memory by default; ``--offload-dir`` for the disk tier
    (one sub-directory per rank, stepped by ``sliced_optimizer``)."""
    offload_dir = getattr(args, "offload_dir", None)
    kwargs: dict[str, Any] = {"num_slices": min(4, len(model.blocks) + 2)}
    if offload_dir is not None:
        kwargs["offload_dir"] = f"{offload_dir}/rank{dist.get_rank()}"
        kwargs["resume"] = bool(args.resume)
    offload = OffloadModel(
        gpt_stages(model),
        device,
        checkpoint_activation=True,
        process_group=dist.group.WORLD,
        **kwargs,
    )
    if offload_dir is None:
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            offload.parameters(), **adamw_kwargs(args)
        )
    else:
        optimizer = offload.sliced_optimizer(torch.optim.AdamW, **adamw_kwargs(args))
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


def _no_decay(name: str) -> bool:
    """Biases and LayerNorm weights, chosen by original parameter name."""
    return name.endswith("bias") or ".ln_" in name or name.startswith("ln_")


def _fsdp(model: GPT, args: argparse.Namespace, device: torch.device) -> Strategy:
    """FullyShardedDataParallel, one unit per Block + the root (ZeRO-3); AdamW without
    weight decay on biases and norms (FSDP keeps the original parameter names).
    ``--precision bf16|fp16``: FSDP's own mixed precision (:func:`fsdp_policy`)."""
    blocks = {CheckpointWrapper if _checkpointing(args) else Block}
    policy = fsdp_policy(getattr(args, "precision", "fp32"))
    # a GPT built on meta is materialised unit by unit (deferred initialisation)
    init = gpt_unit_init_fn if any(p.is_meta for p in model.parameters()) else None
    fsdp_kwargs: dict[str, Any] = {"mixed_precision": policy, "param_init_fn": init}
    with enable_wrap(wrapper_cls=FullyShardedDataParallel, **fsdp_kwargs):
        wrapped = auto_wrap(model, transformer_auto_wrap_policy(blocks))
    module = FullyShardedDataParallel(wrapped, **fsdp_kwargs)
    kwargs = adamw_kwargs(args)
    named = list(module.named_parameters())
    groups: list[dict[str, Any]] = [
        {"params": [p for n, p in named if not _no_decay(n)]},
        {"params": [p for n, p in named if _no_decay(n)], "weight_decay": 0.0},
    ]
    return _FSDPStrategy(module=module, optimizer=torch.optim.AdamW(groups, **kwargs))


#: strategies whose factory takes a GPT built on the meta device (and allocates only
#: what this rank holds); the main job builds the model there for them
META_INIT = ("pipe",)

STRATEGIES: dict[str, StrategyFactory] = {
    "ddp": _ddp,
    "oss": _oss,
    "sdp": _sdp,
    "pipe": _pipe,
    "offload": _offload,
    "fsdp": _fsdp,
}


# --precision and --activation-checkpointing --------------------------------------------
# [Note: precision per strategy]
# ddp, oss and sdp keep fp32 parameters and run the forward under torch.autocast (bf16 or
# fp16); fsdp casts its own full parameters (a MixedPrecision policy: the all-gather
# moves half the bytes). fp16 adds dynamic loss scaling: torch's GradScaler for ddp
# (every rank holds every gradient), ShardedGradScaler elsewhere (each rank checks its
# shard, the ranks agree). pipe and offload run their own backward inside forward, so
# neither option applies to them (offload checkpoints every slice already).
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_MODE = {"ddp": "autocast", "oss": "autocast", "sdp": "autocast", "fsdp": "native"}
CHECKPOINTING = ("ddp", "oss", "sdp", "fsdp", "pipe")
FP16_INIT_SCALE = 2.0**14  # FSDP's fp16 loss: its gradient (the scale) must fit fp16 (65504)


def _checkpointing(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "activation_checkpointing", False))


def option_error(args: argparse.Namespace) -> str | None:
    """Why ``--precision`` / ``--activation-checkpointing`` / ``--offload-dir`` do not
    apply to ``--strategy``, or None when they do."""
    precision = getattr(args, "precision", "fp32")
    if precision != "fp32" and args.strategy not in PRECISION_MODE:
        return (
            f"--precision {precision} applies to strategies {sorted(PRECISION_MODE)}, not "
            f"{args.strategy!r}; use --precision fp32"
        )
    if _checkpointing(args) and args.strategy not in CHECKPOINTING:
        return (
            f"--activation-checkpointing applies to strategies {list(CHECKPOINTING)}, not "
            f"{args.strategy!r} (offload checkpoints every slice already)"
        )
    offload_dir = getattr(args, "offload_dir", None)
    if offload_dir is not None and args.strategy != "offload":
        return (
            f"--offload-dir applies to --strategy offload only (its disk tier), not "
            f"{args.strategy!r}; drop --offload-dir {offload_dir} or use --strategy offload"
        )
    if offload_dir is not None and not str(offload_dir).strip():
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

    def consolidated_model_state(self) -> dict[str, Any] | None:
        return self.inner.consolidated_model_state()

    def model_state_bytes(self) -> ModelStateBytes:
        return self.inner.model_state_bytes()

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


def build_strategy(model: GPT, args: argparse.Namespace, device: torch.device) -> Strategy:
    """``STRATEGIES[args.strategy]`` with ``--activation-checkpointing`` (every Block
    wrapped by ``checkpoint_wrapper`` before the strategy wraps the model) and
    ``--precision`` (see [Note: precision per strategy]).

    Raises:
        ValueError: an option that does not apply to the strategy (:func:`option_error`).
    """
    problem = option_error(args)
    if problem is not None:
        raise ValueError(problem)
    if _checkpointing(args):
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    strategy = STRATEGIES[args.strategy](model, args, device)
    precision = getattr(args, "precision", "fp32")
    if precision == "fp32":
        return strategy
    autocast = PRECISIONS[precision] if PRECISION_MODE[args.strategy] == "autocast" else None
    scaler: torch.amp.GradScaler | None = None
    if precision == "fp16":
        if args.strategy == "ddp":
            scaler = torch.amp.GradScaler(device.type, init_scale=FP16_INIT_SCALE)
        else:
            scaler = ShardedGradScaler(init_scale=FP16_INIT_SCALE, device=device.type)
    return _Precision(strategy, autocast, scaler)
