"""Shared helpers of the OffloadModel tests: a tiny model, a training loop, renaming."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardkit.nn.offload import DiskTier, MemoryTier, OffloadModel

CPU = torch.device("cpu")
X = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def tiny(seed: int = 0, dropout: float = 0.0) -> nn.Sequential:
    """Five layers (three with parameters), 436 parameters."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.GELU(),
        nn.Linear(16, 16),
        nn.Dropout(dropout),
        nn.LayerNorm(16),
        nn.Linear(16, 4),
    )


def target(tier: str, tmp_path: Path) -> Any:
    """The ``offload_device`` argument of a tier name."""
    if tier == "disk":
        return tmp_path / "offload"
    if tier == "memory":  # really copies between two CPU buffers: the CUDA code path
        return MemoryTier(CPU, CPU)
    return CPU


def wrap(
    model: nn.Module, names_from: nn.Module | None = None, **kwargs: Any
) -> tuple[OffloadModel, dict[str, str]]:
    """``OffloadModel(model, "cpu", **kwargs)`` and a map from its parameter names to those
    of ``names_from`` (default ``model``), the plain model sharing its parameters."""
    plain = {id(p): n for n, p in (names_from or model).named_parameters()}
    om = OffloadModel(model, CPU, **kwargs)
    return om, {n: plain[id(p)] for n, p in om.named_parameters()}


def plain_state(om: OffloadModel, rename: dict[str, str]) -> dict[str, torch.Tensor]:
    """The wrapped model's parameters under the plain model's names."""
    return {rename[k]: v for k, v in om.state_dict().items() if k in rename}


def optimizer_for(model: nn.Module, name: str) -> Any:
    """The named optimizer: sliced for an OffloadModel on disk, plain otherwise."""
    cls, kwargs = OPTIMIZERS[name]
    if isinstance(model, OffloadModel) and isinstance(model.tier, DiskTier):
        return model.sliced_optimizer(cls, **kwargs)
    return cls(model.parameters(), **kwargs)


def train(model: nn.Module, optimizer: Any, steps: int, x: torch.Tensor = X) -> list[float]:
    """``steps`` MSE steps on (x, Y); returns the losses."""
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), Y[: x.shape[0]])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
