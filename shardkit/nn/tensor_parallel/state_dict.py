"""State dicts of a tensor-parallel model: consolidated (the plain model's), and sharded
files that load back at any tensor-parallel degree.

- :func:`consolidated_state_dict` gathers every shard (a collective over the
  tensor-parallel group): the result has the plain model's keys and shapes and loads
  into the unsplit model with ``load_state_dict``.
- :func:`load_consolidated_state_dict` loads a plain model's state dict into a
  tensor-parallel model: each rank keeps its shard (no communication).
- :func:`save_sharded` writes one file per tensor-parallel rank (``tp-<r>-of-<T>.pt``:
  the rank's tensors and, per split tensor, its ``(partition_dim, partition_stride)``);
  :func:`load_sharded` reads every file, merges the shards and keeps this rank's shard
  at the *current* degree, so a checkpoint written at degree 2 loads at 1 (a plain
  model, e.g. under FSDP over 4 data-parallel ranks), 2 or 4.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from shardkit.checkpoint.atomic import atomic_save
from shardkit.nn.tensor_parallel.groups import TPGroup, rank_and_size, resolve_group
from shardkit.nn.tensor_parallel.partition import (
    full_tensor,
    is_tensor_parallel,
    merge_shards,
    shard,
    split_of,
)

__all__ = [
    "consolidated_state_dict",
    "load_consolidated_state_dict",
    "load_sharded",
    "save_sharded",
]

_FILE = re.compile(r"tp-(\d+)-of-(\d+)\.pt")


def consolidated_state_dict(
    model: nn.Module, process_group: TPGroup = None
) -> dict[str, torch.Tensor]:
    """The full state dict of a tensor-parallel ``model`` (every rank gets it).

    A collective over the tensor-parallel group (one all-gather per split tensor).

    Returns:
        The plain model's keys (tied weights under each of their names) and full shapes,
        detached copies.
    """
    group = resolve_group(process_group)
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if is_tensor_parallel(t):
            dim, stride = split_of(t)
            out[name] = full_tensor(t, dim, group, stride)
        else:
            out[name] = t.detach().clone()
    return out


def _load_full(
    model: nn.Module, full: dict[str, torch.Tensor], group: TPGroup, strict: bool
) -> None:
    rank, world = rank_and_size(resolve_group(group))
    own = model.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(full))
    unexpected = sorted(set(full) - set(own))
    if strict and (missing or unexpected):
        raise KeyError(f"state dict keys differ: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, t in own.items():
            if name not in full:
                continue
            value = full[name]
            if is_tensor_parallel(t):
                dim, stride = split_of(t)
                value = shard(value, dim, rank, world, stride)
            if value.shape != t.shape:
                raise ValueError(
                    f"{name}: the checkpoint's shard has shape {tuple(value.shape)}, the "
                    f"model's {tuple(t.shape)} (tensor-parallel degree {world})"
                )
            t.copy_(value)


def load_consolidated_state_dict(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    process_group: TPGroup = None,
    strict: bool = True,
) -> None:
    """Load a plain model's (full) ``state_dict`` into a tensor-parallel ``model``.

    Raises:
        KeyError: with ``strict``, keys that differ (both lists named).
        ValueError: a tensor whose shard does not fit (shapes and degree named).
    """
    _load_full(model, state_dict, process_group, strict)


def save_sharded(model: nn.Module, directory: str | Path, process_group: TPGroup = None) -> Path:
    """Write this tensor-parallel rank's tensors to ``directory/tp-<r>-of-<T>.pt``.

    No communication. Call it on the ranks of one tensor-parallel group (e.g.
    data-parallel rank 0); the other replicas hold the same shards.

    Returns:
        The file written.
    """
    rank, world = rank_and_size(resolve_group(process_group))
    tensors, layout = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        tensors[name] = t.detach().clone()
        if is_tensor_parallel(t):
            layout[name] = split_of(t)
    path = Path(directory) / f"tp-{rank}-of-{world}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_save({"tensors": tensors, "layout": layout}, path)
    return path


def load_sharded(
    model: nn.Module, directory: str | Path, process_group: TPGroup = None, strict: bool = True
) -> None:
    """Load what :func:`save_sharded` wrote, at any tensor-parallel degree of ``model``
    (a plain model is degree 1).

    Raises:
        FileNotFoundError: the directory lacks some rank's file (the missing ranks named).
        KeyError, ValueError: as :func:`load_consolidated_state_dict`.
    """
    found = {}
    for path in Path(directory).iterdir():
        match = _FILE.fullmatch(path.name)
        if match:
            found[(int(match[1]), int(match[2]))] = path
    degrees = {w for _, w in found}
    if len(degrees) != 1:
        raise FileNotFoundError(
            f"{directory}: expected tp-<r>-of-<T>.pt of one degree T; found {sorted(found)}"
        )
    (saved_world,) = degrees
    missing = [r for r in range(saved_world) if (r, saved_world) not in found]
    if missing:
        raise FileNotFoundError(
            f"{directory}: no file for tensor-parallel ranks {missing} of {saved_world}"
        )
    files = [torch.load(found[(r, saved_world)], weights_only=True) for r in range(saved_world)]
    full = {}
    for name, first in files[0]["tensors"].items():
        if name in files[0]["layout"]:
            dim, stride = files[0]["layout"][name]
            full[name] = merge_shards([f["tensors"][name] for f in files], dim, stride)
        else:
            full[name] = first
    _load_full(model, full, process_group, strict)
