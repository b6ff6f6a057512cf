"""Sharded optimizer-state checkpoints: one file per rank, loadable at any world size.

A sharded optimizer (ZeRO stage 1/2: ``shardkit.optim.OSS``) keeps on each rank the
state of the parameters it owns. Consolidating that state on one rank before saving
costs a gather of the whole optimizer state and one rank's memory for all of it. Here
each rank writes only its own shard, atomically, with the metadata needed to put the
shards back together (no collective, no consolidation):

``<directory>/optim-shard-<rank>-of-<world_size>.pt`` holds a dict::

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

import torch

from shardkit.checkpoint.atomic import atomic_save

__all__ = [
    "SHARD_FORMAT",
    "load_optimizer_shards",
    "merge_optimizer_shards",
    "optimizer_shard_path",
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
    payload = {
        "format": SHARD_FORMAT,
        "rank": rank,
        "world_size": world_size,
        "param_groups": shard["param_groups"],
        "state": shard["state"],
    }
    path = optimizer_shard_path(directory, rank, world_size)
    atomic_save(payload, path)
    return path


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

    Files are memory-mapped: tensors are read from disk only when used, so a rank that
    keeps 1/N of the state reads about 1/N of the bytes.

    Raises:
        FileNotFoundError: if ``directory`` has no shard file.
        ValueError: if the files do not form one complete save, or have another format.
    """
    files = sorted(
        (p for p in Path(directory).iterdir() if _NAME.fullmatch(p.name)),
        key=lambda p: int(_NAME.fullmatch(p.name).group(1)),  # type: ignore[union-attr]
    )
    if not files:
        raise FileNotFoundError(
            f"no optimizer shard files (optim-shard-<rank>-of-<world>.pt) in {directory}"
        )
    shards = [torch.load(p, map_location="cpu", mmap=True, weights_only=True) for p in files]
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
