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
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.memory import ModelStateBytes, model_state_bytes
from shardkit.optim import OSS
from shardkit.testing.models import GPT

__all__ = ["STRATEGIES", "Strategy", "StrategyFactory", "adamw_kwargs"]


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
    """torch DDP + OSS(AdamW): optimizer state sharded across ranks (ZeRO-1)."""
    device_ids = [device] if device.type == "cuda" else None
    module = DistributedDataParallel(model, device_ids=device_ids)
    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, **adamw_kwargs(args))
    return _OSSStrategy(module=module, optimizer=optimizer, model=model)


STRATEGIES: dict[str, StrategyFactory] = {
    "ddp": _ddp,
    "oss": _oss,
}
