"""State dicts of a tensor-parallel model: consolidated (the plain model's), and sharded
files that load back at any tensor-parallel degree.

- :func:`consolidated_state_dict` gathers every shard (a collective over the
  tensor-parallel group): the result has the plain model's keys and shapes and loads
  into the unsplit model with ``load_state_dict``.
- :func:`load_consolidated_state_dict` loads a plain model's state dict into a
  tensor-parallel model: each rank keeps its shard (no communication).
- :func:`save_sharded` / :func:`load_sharded`: calls to the universal checkpoint
  (:func:`~shardkit.checkpoint.universal.save_universal` /
  :func:`~shardkit.checkpoint.universal.load_universal` over the tensor-parallel
  group): each rank writes its parts under the plain model's keys, and a load at any
  degree reads only the byte ranges of its own parts, so a checkpoint written at
  degree 2 loads at 1 (a plain model, e.g. under FSDP over 4 data-parallel ranks), 2
  or 4, and into any other strategy with ``load_universal``. Until this release the
  files were ``tp-<r>-of-<T>.pt``; ``python -m shardkit.checkpoint convert`` turns
  such a directory into a universal checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shardkit.checkpoint.universal import load_universal, save_universal
from shardkit.checkpoint.universal.shardfile import shard_file_name
from shardkit.nn.tensor_parallel.groups import TPGroup, rank_and_size, resolve_group
from shardkit.nn.tensor_parallel.partition import (
    full_tensor,
    is_tensor_parallel,
    shard,
    split_of,
)

__all__ = [
    "consolidated_state_dict",
    "load_consolidated_state_dict",
    "load_sharded",
    "save_sharded",
]


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


def save_sharded(
    model: nn.Module,
    directory: str | Path,
    process_group: TPGroup = None,
    *,
    step: int = 0,
    keep: int = 0,
) -> Path:
    """Save the tensor-parallel ``model`` as a universal checkpoint under ``directory``:
    ``save_universal(directory, step, model, keep=keep, group=process_group)``.

    A collective over the tensor-parallel group: call it on the ranks of one
    tensor-parallel group (e.g. data-parallel rank 0; the other replicas hold the same
    parts). Each rank writes its parts, and 1/T of each tensor every rank holds whole,
    to ``directory/ckpt-<step>/shard-<r>-of-<T>.safetensors``; rank 0 writes the
    manifest and ``directory/latest``.

    Args:
        process_group: the tensor-parallel group; default None (the mesh's, else the
            world group).
        step: the training step; default 0.
        keep: committed checkpoints to keep (the newest); default 0: all.

    Returns:
        The file this rank wrote.

    Raises:
        CheckpointError, ValueError: see ``save_universal``.
    """
    group = resolve_group(process_group)
    rank, world = rank_and_size(group)
    ckpt = save_universal(directory, step, model, keep=keep, group=group)
    return ckpt / shard_file_name(rank, world)


def load_sharded(
    model: nn.Module, directory: str | Path, process_group: TPGroup = None, strict: bool = True
) -> None:
    """Load what :func:`save_sharded` wrote (the newest intact step under
    ``directory``), or any universal checkpoint, at the tensor-parallel degree of
    ``model`` (a plain model is degree 1): ``load_universal(directory, model,
    group=process_group, strict=strict)``.

    A collective over ``process_group`` (default None: the mesh's tensor-parallel
    group, else the world group); each rank reads the byte ranges of its own parts.

    Raises:
        CheckpointMismatchError: with ``strict``, keys that differ; another full shape;
            an old-format directory (convert it: ``python -m shardkit.checkpoint
            convert``).
        FileNotFoundError, CheckpointCorruptError, CheckpointError: see
            ``load_universal``.
    """
    load_universal(directory, model, group=resolve_group(process_group), strict=strict)
