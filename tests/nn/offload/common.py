"""Shared helpers of the OffloadModel tests: a tiny model, a training loop, renaming."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardkit.nn.offload import DiskTier, MemoryTier, OffloadModel
from shardkit.testing import assert_state_dicts_close

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


def killed_then_resumed(
    tmp_path: Path, target: Callable[[str, str], None], io_bytes: int
) -> dict[str, Any]:
    """Run ``target(directory, marker)`` in a spawned process that trains two steps and
    SIGKILLs itself in the third; check the directory resumes at generation 2 without
    step 3's files and then trains on bit for bit as the plain model. Returns what the
    child wrote to ``marker`` (JSON)."""
    plain = tiny()
    expected = train(plain, optimizer_for(plain, "adamw"), 3)
    directory, marker = tmp_path / "offload", tmp_path / "marker.json"
    process = multiprocessing.get_context("spawn").Process(
        target=target, args=(str(directory), str(marker))
    )
    process.start()
    process.join(120)
    assert process.exitcode == -signal.SIGKILL
    assert any(".g3" in f for f in os.listdir(directory))  # part of step 3 on disk
    reopened, rename = wrap(
        tiny(99), offload_device=directory, num_slices=3, resume=True, disk_io_bytes=io_bytes
    )
    assert reopened.tier.generation == 2
    assert not [f for f in os.listdir(directory) if ".g3" in f or f.endswith(".tmp")]
    assert train(reopened, optimizer_for(reopened, "adamw"), 1) == expected[2:]
    assert_state_dicts_close(plain_state(reopened, rename), dict(plain.named_parameters()), atol=0)
    seen: dict[str, Any] = json.loads(marker.read_text())
    return seen
