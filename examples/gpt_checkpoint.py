"""Per-rank checkpoints of the main job: ``ckpt-<step>/rank<r>.pt``, a manifest, a pointer.

Layout in ``--out-dir``::

    ckpt-000100/rank0.pt       this rank's payload (strategy state, LR scheduler,
    ckpt-000100/rank1.pt       data-sampler position, RNG states, loss history)
    ckpt-000100/manifest.json  step, world size, strategy, file names (rank 0)
    latest                     the name of the newest complete checkpoint (rank 0)

[Note: crash safety]
Every file is written with :func:`shardkit.checkpoint.atomic.atomic_save` (temporary
file, fsync, rename). The order is: every rank writes its own file; barrier; rank 0
writes the manifest, then the ``latest`` pointer; barrier. A crash at any point leaves
``latest`` naming the previous complete checkpoint, so ``--resume`` never sees a
half-written one. With several nodes, ``--out-dir`` must be on a shared filesystem.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gpt_data import InputError

from shardkit.checkpoint.atomic import atomic_save, atomic_write

__all__ = [
    "find_latest",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]

FORMAT_VERSION = 1
LATEST = "latest"


def _ckpt_name(step: int) -> str:
    return f"ckpt-{step:06d}"


def save_checkpoint(
    out_dir: Path, step: int, payload: dict[str, Any], strategy: str, keep: int = 2
) -> Path:
    """Write this rank's ``payload`` for ``step``; collective (call it on every rank).

    Args:
        keep: complete checkpoints to keep, the newest; older ones are deleted (by rank
            0, after ``latest`` moved on). 0 keeps all. Default 2.

    Returns:
        The checkpoint directory.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ckpt = out_dir / _ckpt_name(step)
    ckpt.mkdir(parents=True, exist_ok=True)
    atomic_save(payload, ckpt / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "world_size": world_size,
            "strategy": strategy,
            "files": [f"rank{r}.pt" for r in range(world_size)],
        }
        with atomic_write(ckpt / "manifest.json", "w") as handle:
            json.dump(manifest, handle, indent=1)
        with atomic_write(out_dir / LATEST, "w") as handle:
            handle.write(ckpt.name + "\n")
        _prune(out_dir, keep)
    dist.barrier()
    return ckpt


def _prune(out_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoint directories (0: keep all)."""
    if keep <= 0:
        return
    for old in sorted(out_dir.glob("ckpt-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def find_latest(out_dir: Path) -> Path | None:
    """The checkpoint directory ``latest`` points to, or None if there is none."""
    pointer = out_dir / LATEST
    if not pointer.is_file():
        return None
    return out_dir / pointer.read_text().strip()


def load_checkpoint(
    ckpt: Path, rank: int, world_size: int, strategy: str, device: torch.device
) -> dict[str, Any]:
    """This rank's payload from ``ckpt``, after checking the manifest matches the run.

    Raises:
        InputError: the manifest is missing, or was written by another world size or
            strategy (the message names both and the fix).
    """
    manifest_path = ckpt / "manifest.json"
    if not manifest_path.is_file():
        raise InputError(f"--resume: {manifest_path} is missing (an incomplete checkpoint)")
    manifest = json.loads(manifest_path.read_text())
    saved = (manifest["world_size"], manifest["strategy"])
    if saved != (world_size, strategy):
        raise InputError(
            f"--resume: {ckpt} was written by {saved[0]} ranks with --strategy {saved[1]}, "
            f"this run has {world_size} ranks with --strategy {strategy}; "
            "resume with the same launch, or use another --out-dir"
        )
    payload: dict[str, Any] = torch.load(
        ckpt / manifest["files"][rank], map_location=device, weights_only=False
    )
    return payload


def rng_state(device: torch.device) -> dict[str, Any]:
    """The random-number generator states a resumed run needs (torch, Python, CUDA)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned (tensors may have been mapped to ``device``)."""
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
