"""Workers of ``test_disk_universal.py``: the disk tier across layouts on 2 gloo ranks.

Built on ``tests/checkpoint/universal_workers.py`` (its ``seq`` model, batches,
AdamW, the FSDP / OSS layouts, :func:`consolidate` and :func:`reference`). The disk
tier is a data-parallel ``OffloadModel`` (every rank its own ``offload_dir``, gradients
averaged over the 2 ranks, each rank feeding half of the global batch) stepped by its
``sliced_optimizer``; what it holds is read back from a universal checkpoint
(:func:`checkpoint_tensors`), since its parameters are placeholders between uses.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.checkpoint.manifest import read_manifest
from shardkit.checkpoint.universal import load_universal, save_universal
from shardkit.checkpoint.universal.loader import read_saved_index, read_tensor
from shardkit.nn import OffloadModel
from tests.checkpoint.universal_workers import (
    BATCH,
    TRAIN_STEPS,
    Consolidated,
    Run,
    batch,
    consolidate,
    group,
    loss_of,
    make_model,
    reference,
)

HYPER = {"lr": 1e-2, "eps": 1e-4, "weight_decay": 0.01}  # universal_workers.adamw's


def checkpoint_tensors(root: str | Path) -> Consolidated:
    """Every tensor of the newest checkpoint under ``root``, flattened: ``params``,
    element-wise ``state`` and ``scalars`` per key (the format of :func:`reference`)."""
    ckpt = sorted(Path(root).glob("ckpt-*"))[-1]
    manifest = read_manifest(ckpt)
    index = read_saved_index(ckpt, manifest)
    out: Consolidated = {"params": {}, "state": {}, "scalars": {}}
    for key, meta in manifest.layout["keys"].items():
        shape, dtype = tuple(meta["shape"]), meta["dtype"]
        out["params"][key] = read_tensor(ckpt, index, key, shape, dtype).reshape(-1)
        for name in index.states(key):
            value = read_tensor(ckpt, index, key, shape, dtype, name).reshape(-1)
            out["state"].setdefault(key, {})[name] = value
        for name, scalar in index.scalars.get(key, {}).items():
            out["scalars"].setdefault(key, {})[name] = float(scalar.value)
    return out


class DiskRun:
    """A data-parallel disk-tier OffloadModel over the 2 ranks, stepping like ``Run``."""

    def __init__(self, base: nn.Module, directory: str) -> None:
        self.group = group([0, 1])
        self.rank = dist.get_rank()
        self.model = OffloadModel(
            base,
            "cpu",
            offload_dir=f"{directory}/rank{self.rank}",
            num_slices=2,
            process_group=self.group,
        )
        self.optimizer = self.model.sliced_optimizer(torch.optim.AdamW, **HYPER)

    def step(self, step: int) -> None:
        x, y = batch("seq", step)
        rows = BATCH // 2
        x, y = (
            x[self.rank * rows : (self.rank + 1) * rows],
            y[self.rank * rows : (self.rank + 1) * rows],
        )
        self.optimizer.zero_grad()
        loss_of("seq", self.model, x, y).backward()
        self.optimizer.step()

    def held(self, root: str) -> Consolidated:
        """What the tier holds, through a universal checkpoint in ``root``."""
        save_universal(root, 0, self.model, self.optimizer, group=self.group)
        return checkpoint_tensors(root)


def _held(run: Any, root: str) -> Consolidated | None:
    """What ``run`` holds (a collective): the disk tier through a checkpoint in
    ``root``, another layout from its adapter's pieces (on rank 0)."""
    return run.held(root) if isinstance(run, DiskRun) else consolidate(run)


def _twin_step(twin: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x, y = batch("seq", step)
    optimizer.zero_grad()
    loss_of("seq", twin, x, y).backward()
    optimizer.step()


def disk_and_fsdp(root: str, other: str = "fsdp") -> dict[str, Any] | None:
    """Disk tier (2 ranks) -> ``other`` (2 ranks), and ``other`` -> disk tier, each
    trained 2 steps beside a plain twin, saved, loaded (another initialisation) and
    stepped once more. Rank 0 returns, per direction, the checkpoint's tensors, the
    loaded layout's, the twin's, and both after the next step."""
    out: dict[str, Any] = {}
    for direction in ("disk->other", "other->disk"):
        torch.manual_seed(0)
        base = make_model("seq")
        twin = copy.deepcopy(base)
        twin_opt = torch.optim.AdamW(twin.parameters(), **HYPER)  # type: ignore[arg-type]
        where = f"{root}/{direction.replace('->', '-to-')}"
        first: Any = (
            DiskRun(copy.deepcopy(base), f"{where}/offload-a")
            if direction == "disk->other"
            else Run("seq", other, 2, copy.deepcopy(base))
        )
        for step in range(TRAIN_STEPS):
            first.step(step)
            _twin_step(twin, twin_opt, step)
        save_universal(
            f"{where}/ckpt", TRAIN_STEPS, first.model, first.optimizer, group=first.group
        )
        saved = checkpoint_tensors(f"{where}/ckpt")
        want = reference(twin, twin_opt)
        torch.manual_seed(1)  # another initialisation: loading must replace all of it
        second: Any = (
            Run("seq", other, 2, make_model("seq"))
            if direction == "disk->other"
            else DiskRun(make_model("seq"), f"{where}/offload-b")
        )
        load_universal(f"{where}/ckpt", second.model, second.optimizer, group=second.group)
        loaded = _held(second, f"{where}/held")
        second.step(TRAIN_STEPS)
        _twin_step(twin, twin_opt, TRAIN_STEPS)
        stepped = _held(second, f"{where}/held-stepped")
        out[direction] = {
            "saved": saved,
            "loaded": loaded,
            "want": want,
            "stepped": stepped,
            "want_stepped": reference(twin, twin_opt),
        }
        dist.barrier()
    return out if dist.get_rank() == 0 else None
