"""Per-rank checkpoints of the main job: ``ckpt-<step>/rank<r>.pt``, a manifest, a pointer.

Layout in ``--out-dir`` (the format of :mod:`shardkit.checkpoint.manifest`)::

    ckpt-000100/rank0.pt       this rank's payload (strategy state, LR scheduler,
    ckpt-000100/rank1.pt       data-sampler position, RNG states, loss history;
                               tensors and plain containers only)
    ckpt-000100/manifest.json  step, world size, strategy, bytes + sha256 per file
    latest                     the name of the newest complete checkpoint (rank 0)

[Note: crash safety]
Every file is written atomically (temporary file, fsync, rename). The order is: every
rank writes its own file; the ranks exchange the files' sizes and checksums; rank 0
writes the manifest, then the ``latest`` pointer. A crash at any point leaves
``latest`` naming the previous complete checkpoint. ``--resume`` verifies the
checksums and, if the newest checkpoint is damaged (a truncated or corrupted file),
falls back to the previous one with a one-line warning. With several nodes,
``--out-dir`` must be on a shared filesystem.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gpt_data import InputError

from shardkit.checkpoint import manifest
from shardkit.checkpoint.manifest import CheckpointError, CheckpointFallbackWarning

__all__ = [
    "find_resume_checkpoint",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]


def _rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def save_checkpoint(
    out_dir: Path,
    step: int,
    payload: dict[str, Any],
    strategy: str,
    keep: int = 2,
    model: dict[str, Any] | None = None,
) -> Path:
    """Write this rank's ``payload`` for ``step``; collective (call it on every rank).

    Args:
        model: what fixes the model's shapes (``--model-size``, ``--seq-len``), kept in
            the manifest so a resume with other shapes is refused with a clear message.
        keep: complete checkpoints to keep, the newest; older ones are deleted (by rank
            0, after ``latest`` moved on). 0 keeps all. Default 2.

    Returns:
        The checkpoint directory.
    """
    files = {_rank_file(dist.get_rank()): payload}
    layout = {"strategy": strategy, "model": model or {}}
    return manifest.save_checkpoint(out_dir, step, files, layout=layout, keep=keep)


def find_resume_checkpoint(
    out_dir: Path, world_size: int, warn: Callable[[str], None]
) -> Path | None:
    """The newest intact checkpoint in ``out_dir`` (collective), or None if none was saved.

    A damaged newer checkpoint is skipped; ``warn`` gets one line saying so.

    Raises:
        InputError: the checkpoints were written by another world size, or every one
            is damaged (the message names the files).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointFallbackWarning)
        try:
            ckpt = manifest.find_valid_checkpoint(out_dir, world_size=world_size)
        except CheckpointError as err:
            raise InputError(f"--resume: {err}; use another --out-dir") from err
    for item in caught:
        warn(str(item.message))
    return ckpt


def load_checkpoint(
    ckpt: Path,
    rank: int,
    world_size: int,
    strategy: str,
    device: torch.device,
    model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """This rank's payload from ``ckpt``, after checking the manifest matches the run.

    A collective when a process group of more than one rank is up: the ranks agree, so
    a file refused on one rank ends every rank with the same error (no rank trains on
    while another has stopped).

    Raises:
        InputError: the manifest or the file is missing or damaged, or was written by
            another world size, strategy or model shape (the message names both and
            the fix), or the file holds an object other than tensors and plain
            containers (refused unloaded: it could run code). On every rank, with the
            message of the first rank that failed.
    """
    payload: dict[str, Any] = {}
    error: str | None = None
    try:
        payload = _load_rank_file(ckpt, rank, world_size, strategy, device, model)
    except InputError as err:
        error = str(err)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise InputError(error)
    return payload


def _load_rank_file(
    ckpt: Path,
    rank: int,
    world_size: int,
    strategy: str,
    device: torch.device,
    model: dict[str, Any] | None,
) -> dict[str, Any]:
    """:func:`load_checkpoint` on this rank alone."""
    try:
        saved = manifest.read_manifest(ckpt)
        run = (saved.world_size, saved.layout.get("strategy"))
        if run != (world_size, strategy):
            raise InputError(
                f"--resume: {ckpt} was written by {run[0]} ranks with --strategy {run[1]}, "
                f"this run has {world_size} ranks with --strategy {strategy}; "
                "resume with the same launch, or use another --out-dir"
            )
        saved_model = saved.layout.get("model") or {}
        differ = {
            k: (saved_model[k], v)
            for k, v in (model or {}).items()
            if k in saved_model and saved_model[k] != v
        }
        if differ:
            flags = ", ".join(
                f"--{k.replace('_', '-')} {a} (this run: {b})" for k, (a, b) in differ.items()
            )
            raise InputError(
                f"--resume: {ckpt} was written with {flags}; resume with the same model "
                "flags, or use another --out-dir"
            )
        # tensors and plain containers only: a file that names any other object is
        # refused (CheckpointUnsafeError), the checksums beside it prove nothing
        payload: dict[str, Any] = manifest.load_checkpoint_file(
            ckpt, _rank_file(rank), map_location=device
        )
    except CheckpointError as err:
        raise InputError(f"--resume: {err}") from err
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
