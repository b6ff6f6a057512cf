"""Sharded optimizer-state checkpoints: one file per rank, loadable at any world size.

A sharded optimizer (ZeRO stage 1/2: ``shardkit.optim.OSS``) keeps on each rank the
state of the parameters it owns. Consolidating that state on one rank before saving
costs a gather of the whole optimizer state and one rank's memory for all of it. Here
each rank writes only its own shard, atomically, with the metadata needed to put the
shards back together (no consolidation).

:func:`save_optimizer_checkpoint` (what ``OSS.save_sharded`` calls) writes through the
manifest (:mod:`shardkit.checkpoint.manifest`): ``<root>/ckpt-<step>/`` holds the shard
files and ``manifest.json`` (size and sha256 of each file), and ``<root>/latest`` names
the newest committed step. :func:`load_optimizer_checkpoint` picks the newest intact
checkpoint on every rank alike (a damaged shard is a
:class:`~shardkit.checkpoint.manifest.CheckpointCorruptError`; an older checkpoint is
used, with a warning), at any world size. A plain directory of shard files written by
:func:`save_optimizer_shard` alone (no manifest, no checksums) still loads.

``optim-shard-<rank>-of-<world_size>.pt`` holds a dict::

    {"format": "shardkit.sharded_optim/1", "rank": r, "world_size": N,
     "param_groups": [...],          # the full groups, torch layout (global indices)
     "state": {global_index: {...}}} # only the parameters rank r owned

Global indices are the ones of a plain ``torch.optim.Optimizer.state_dict()``: the
position of the parameter in the concatenation of the param groups. Loading merges
the shards (memory-mapped, so a rank reads only the tensors it keeps) into a plain
optimizer state dict, whatever the world size it was saved at, and whatever world
size loads it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardkit.checkpoint.atomic import atomic_save
from shardkit.checkpoint.manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    find_valid_checkpoint,
    list_checkpoints,
    load_tensors_only,
    save_checkpoint,
    verify_checkpoint,
)

__all__ = [
    "SHARD_FORMAT",
    "load_optimizer_checkpoint",
    "load_optimizer_shards",
    "merge_optimizer_shards",
    "optimizer_shard_path",
    "resolve_shard_directory",
    "save_optimizer_checkpoint",
    "save_optimizer_shard",
]

SHARD_FORMAT = "shardkit.sharded_optim/1"
_NAME = re.compile(r"optim-shard-(\d+)-of-(\d+)\.pt")

PathLike = str | os.PathLike[str]


def optimizer_shard_path(directory: PathLike, rank: int, world_size: int) -> Path:
    """The file of ``rank``'s shard in ``directory``."""
    return Path(directory) / f"optim-shard-{rank}-of-{world_size}.pt"


def save_optimizer_shard(
    directory: PathLike,
    shard: dict[str, Any],
    rank: int,
    world_size: int,
) -> Path:
    """Write one rank's shard atomically (creates ``directory`` if missing).

    Args:
        directory: the checkpoint directory, shared by every rank.
        shard: ``{"param_groups": [...], "state": {global_index: {...}}}`` of this rank.
        rank: this rank (in the optimizer's process group).
        world_size: number of ranks in that group.

    Returns:
        The path written.
    """
    Path(directory).mkdir(parents=True, exist_ok=True)
    path = optimizer_shard_path(directory, rank, world_size)
    atomic_save(_payload(shard, rank, world_size), path)
    return path


def _payload(shard: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    return {
        "format": SHARD_FORMAT,
        "rank": rank,
        "world_size": world_size,
        "param_groups": shard["param_groups"],
        "state": shard["state"],
    }


def save_optimizer_checkpoint(
    root: PathLike,
    step: int,
    shard: dict[str, Any],
    rank: int,
    world_size: int,
    *,
    keep: int = 0,
    group: dist.ProcessGroup | None = None,
) -> Path:
    """Write this rank's shard into ``root/ckpt-<step>`` and commit it (a collective).

    Through :func:`shardkit.checkpoint.manifest.save_checkpoint`: atomic files, a
    manifest with each file's size and sha256, then ``root/latest``.

    Args:
        root: the checkpoint root, shared by every rank (created if missing).
        step: the training step (directory ``ckpt-<step:06d>``); saving a step again
            overwrites it.
        shard: ``{"param_groups": [...], "state": {global_index: {...}}}`` of this rank.
        rank: this rank in ``group``; world_size: the size of ``group``.
        keep: committed checkpoints to keep (the newest); default 0: all.
        group: the optimizer's process group; default None (the world group).

    Returns:
        The file this rank wrote.

    Raises:
        CheckpointError: on every rank, if a rank could not write its file.
    """
    name = optimizer_shard_path(".", rank, world_size).name
    layout = {"format": SHARD_FORMAT, "reshardable": True}
    files = {name: _payload(shard, rank, world_size)}
    ckpt = save_checkpoint(root, step, files, layout=layout, keep=keep, group=group)
    return ckpt / name


def resolve_shard_directory(
    directory: PathLike, *, collective: bool, group: dist.ProcessGroup | None = None
) -> Path:
    """The directory whose shard files to read, checked against its manifest.

    ``directory`` is a checkpoint root (``latest`` and ``ckpt-<step>/``), one
    checkpoint directory (``manifest.json``), or a plain directory of shard files
    (no manifest: returned unchecked).

    Args:
        collective: for a root, every rank of ``group`` calls this: the ranks share the
            checksum work and agree on the newest intact checkpoint, falling back to an
            older one with a warning (:func:`~shardkit.checkpoint.manifest.find_valid_checkpoint`).
            False: this process alone verifies the newest committed checkpoint.
        group: the process group of a collective call; default None (the world group).

    Raises:
        CheckpointCorruptError: a shard file is missing, truncated or corrupted (a root:
            every committed checkpoint is damaged, or the newest one when not collective).
        FileNotFoundError: a root in which nothing was committed.
    """
    path = Path(directory)
    if (path / LATEST_NAME).is_file():
        if collective:
            found = find_valid_checkpoint(path, world_size=None, group=group)
        else:
            found = next(iter(list_checkpoints(path)), None)
            if found is not None:
                verify_checkpoint(found)
        if found is None:
            raise FileNotFoundError(f"{path}: no committed checkpoint ({LATEST_NAME} is empty)")
        return found
    if (path / MANIFEST_NAME).is_file():
        verify_checkpoint(path)  # reshardable: any world size
    return path


def load_optimizer_checkpoint(
    root: PathLike, *, group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """Load the newest intact sharded checkpoint under ``root``, merged (a collective).

    Every rank of ``group`` calls it; any world size may load it. A damaged shard file
    makes every rank fall back to the previous committed checkpoint, with a
    :class:`~shardkit.checkpoint.manifest.CheckpointFallbackWarning`.

    Returns:
        A plain ``torch.optim`` state dict (see :func:`merge_optimizer_shards`).

    Raises:
        CheckpointCorruptError: every committed checkpoint is damaged.
        FileNotFoundError, ValueError: see :func:`load_optimizer_shards`.
    """
    return _load_files(resolve_shard_directory(root, collective=True, group=group))


def merge_optimizer_shards(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge per-rank shards into one plain ``torch.optim`` state dict.

    Raises:
        ValueError: if no shard is given, the shards disagree on their param groups or
            world size, a rank is missing or doubled, or two shards hold the state of
            the same parameter.
    """
    if not shards:
        raise ValueError("no optimizer shards to merge")
    world_size = shards[0]["world_size"]
    ranks = sorted(s["rank"] for s in shards)
    if ranks != list(range(world_size)):
        raise ValueError(
            f"shards saved at world size {world_size} must hold ranks 0..{world_size - 1}; "
            f"found ranks {ranks}: a file is missing or left over from another save"
        )
    groups = shards[0]["param_groups"]
    state: dict[int, Any] = {}
    for shard in shards:
        if [g["params"] for g in shard["param_groups"]] != [g["params"] for g in groups]:
            raise ValueError(
                f"shard of rank {shard['rank']} has other param groups than rank "
                f"{shards[0]['rank']}: the files come from different saves"
            )
        overlap = sorted(set(state) & set(shard["state"]))
        if overlap:
            raise ValueError(
                f"parameters {overlap[:5]} have state in more than one shard "
                f"(second: rank {shard['rank']}); the files come from different saves"
            )
        state.update(shard["state"])
    return {"state": state, "param_groups": groups}


def load_optimizer_shards(directory: PathLike) -> dict[str, Any]:
    """Read every shard in ``directory`` and merge them (see :func:`merge_optimizer_shards`).

    No collective. ``directory`` may be a checkpoint root, one checkpoint directory or
    a plain directory of shard files (see :func:`resolve_shard_directory`); with a
    manifest, this process verifies every file's checksum first.

    Files are memory-mapped: tensors are read from disk only when used, so a rank that
    keeps 1/N of the state reads about 1/N of the bytes.

    Raises:
        CheckpointCorruptError: a file does not match the manifest.
        CheckpointUnsafeError: a file holds something other than tensors and plain
            containers (:func:`~shardkit.checkpoint.manifest.load_tensors_only`).
        FileNotFoundError: if ``directory`` has no shard file.
        ValueError: if the files do not form one complete save, or have another format.
    """
    return _load_files(resolve_shard_directory(directory, collective=False))


def _load_files(directory: Path) -> dict[str, Any]:
    files = sorted(
        (p for p in Path(directory).iterdir() if _NAME.fullmatch(p.name)),
        key=lambda p: int(_NAME.fullmatch(p.name).group(1)),  # type: ignore[union-attr]
    )
    if not files:
        raise FileNotFoundError(
            f"no optimizer shard files (optim-shard-<rank>-of-<world>.pt) in {directory}"
        )
    shards = [load_tensors_only(p, map_location="cpu", mmap=True) for p in files]
    for path, shard in zip(files, shards):
        if shard.get("format") != SHARD_FORMAT:
            raise ValueError(
                f"{path} has format {shard.get('format')!r}, expected {SHARD_FORMAT!r}"
            )
    sizes = {s["world_size"] for s in shards}
    if len(sizes) != 1:
        raise ValueError(
            f"{directory} mixes shards of saves at world sizes {sorted(sizes)}; "
            "save each checkpoint to its own directory"
        )
    return merge_optimizer_shards(shards)
