"""The step contract of the main job's strategies: :class:`Strategy` and its options.

The training loop (``train_gpt.py``) uses a strategy like this::

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

:class:`PrecisionStrategy` (``--precision``: autocast, loss scaler) and
:class:`TensorParallelStrategy` (``--tp``: ``model.pt`` gathered back) wrap another
strategy. The registry of ``--strategy`` names is ``strategies.py``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from gpt_dist import mean_over_ranks
from torch import nn

from shardkit.memory import ModelStateBytes, model_state_bytes
from shardkit.nn import tensor_parallel as tp

__all__ = [
    "PRECISIONS",
    "Autocast",
    "Precision",
    "PrecisionStrategy",
    "Strategy",
    "StrategyConfig",
    "TensorParallelStrategy",
    "adamw_kwargs",
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
        sequence_parallel: with ``tp`` > 1 (not pipe): Megatron-LM's sequence
            parallelism, ``tp.gpt_plan(sequence_parallel=True)``
            (``examples/gpt_sequence_parallel.py``). Default False.
        dp_shard: fsdp, hsdp, pipe: the mesh's ``dp_shard`` (ranks sharding each FSDP
            unit; pipe: stage replicas). None: inferred (:func:`parallel_dims`).
            Default None.
        dp_replicate: fsdp, hsdp, pipe: the mesh's ``dp_replicate`` (replicas of the
            shards: hybrid sharding above 1). None: inferred. Default None.
        pp: pipe: the mesh's ``pp`` (pipeline stages). None: inferred. Default None.
        moe_experts: experts per MoE layer (``examples/gpt_moe.py``); 0: the dense
            GPT. Default 0.
        moe_top_k: experts per token. Default 1.
        moe_every: an MoE in every ``moe_every``-th block. Default 1 (all).
        ep: the mesh's expert-parallel degree (``ParallelDims.ep``: it splits
            ``dp_shard``; the experts are split over it). Default 1.
        cp: ddp, fsdp: the mesh's context-parallel degree (``ParallelDims.cp``): each
            sequence split over ``cp`` ranks (``examples/gpt_context_parallel.py``).
            Default 1.
        cp_method: ``ulysses`` or ``ring``, the attention of ``cp > 1``. Default
            ``ulysses``.
        optimizer: ``adamw``, ``muon`` (Muon for the blocks' matrices + AdamW) or
            ``adafactor``, at the peak LR ``lr`` (``examples/gpt_optimizer.py``).
            Default ``adamw``.
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
    sequence_parallel: bool = False
    dp_shard: int | None = None
    dp_replicate: int | None = None
    pp: int | None = None
    moe_experts: int = 0
    moe_top_k: int = 1
    moe_every: int = 1
    ep: int = 1
    cp: int = 1
    cp_method: str = "ulysses"
    optimizer: str = "adamw"


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


def adamw_kwargs(config: StrategyConfig) -> dict[str, Any]:
    """The optimizer settings every strategy uses: AdamW at ``config.lr`` (the peak LR)."""
    return {"lr": config.lr, "betas": (0.9, 0.95), "weight_decay": 0.01}


class Autocast(nn.Module):
    """``module``'s forward under ``torch.autocast(dtype)`` on the inputs' device type."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> Any:
        with torch.autocast(x.device.type, dtype=self.dtype):
            return self.module(x, targets=targets)


class PrecisionStrategy(Strategy):
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


class TensorParallelStrategy(Strategy):
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
