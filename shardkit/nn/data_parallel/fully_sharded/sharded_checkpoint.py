"""Sharded FSDP checkpoints under FairScale-era names: calls to the universal checkpoint.

:func:`save_fsdp_sharded` is :func:`~shardkit.checkpoint.universal.save_universal` of
the FSDP model over its process group, and :func:`load_fsdp_sharded`
:func:`~shardkit.checkpoint.universal.load_universal`: one implementation of sharded
save and load, so these load at any world size, any wrapping (other units, FSDP or
not, hybrid or not) and any tensor-parallel degree, and a universal checkpoint saved
by any other strategy loads through them.

On disk (format ``shardkit.universal/1``, see ``docs/checkpointing.md``)::

    <directory>/latest                         the newest committed step
    <directory>/ckpt-<step>/manifest.json      files, sha256, layout (keys, shapes,
                                               the optimizer's param groups)
    <directory>/ckpt-<step>/shard-<r>-of-<N>.safetensors   rank r's element ranges of
                                               every parameter and optimizer state,
                                               under the unwrapped model's keys
    <directory>/ckpt-<step>/extra-<r>.pt       empty here

Until this release the files were ``fsdp-shard-<r>-of-<N>.pt`` (format
``shardkit.fsdp_sharded/1``); ``python -m shardkit.checkpoint convert`` turns such a
checkpoint into a universal one.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardkit.checkpoint.manifest import _rank_world
from shardkit.checkpoint.universal import load_universal, save_universal
from shardkit.checkpoint.universal.shardfile import shard_file_name
from shardkit.nn.data_parallel.fully_sharded.disk_tier import refuse_on_disk
from shardkit.nn.data_parallel.fully_sharded.unit import UnitRuntime, named_units

__all__ = ["fsdp_shard_path", "load_fsdp_sharded", "save_fsdp_sharded"]

PathLike = str | os.PathLike[str]


def fsdp_shard_path(directory: PathLike, rank: int, world_size: int) -> Path:
    """The shard file of rank ``rank`` in a checkpoint directory saved at ``world_size``
    ranks: ``directory/shard-<rank>-of-<world_size>.safetensors``."""
    return Path(directory) / shard_file_name(rank, world_size)


def _root(model: nn.Module, what: str) -> UnitRuntime:
    runtimes = named_units(model)
    if "flat_param" not in runtimes:
        raise TypeError(
            f"{what} expects a root FullyShardedDataParallel; got {type(model).__name__} "
            "(for any other model: shardkit.checkpoint.universal.save_universal / load_universal)"
        )
    refuse_on_disk(list(runtimes.values()), what)
    return runtimes["flat_param"]


def _group(root: UnitRuntime, what: str) -> dist.ProcessGroup | None:
    """The ranks that save and load together: the model's process group; with hybrid
    sharding every shard group of every replica, which must be the world group."""
    if root.replicate_group is None:
        return root.process_group
    ranks = root.world_size * dist.get_world_size(root.replicate_group)
    if ranks != dist.get_world_size():
        raise ValueError(
            f"{what} of a hybrid-sharded model over {ranks} of {dist.get_world_size()} "
            "ranks: call shardkit.checkpoint.universal.save_universal / load_universal "
            "with group= a process group of exactly the model's ranks"
        )
    return None


def save_fsdp_sharded(
    model: nn.Module,
    directory: PathLike,
    optim: torch.optim.Optimizer | None = None,
    *,
    step: int = 0,
    keep: int = 0,
) -> Path:
    """Save ``model`` (and ``optim``) as a universal checkpoint under ``directory`` (a
    collective): ``save_universal(directory, step, model, optim, keep=keep)`` over the
    model's ranks.

    Every rank of the model's process group (with hybrid sharding: of every replica)
    calls it with the same ``directory`` (created if missing). Each rank writes its
    pieces to ``directory/ckpt-<step>/shard-<r>-of-<N>.safetensors``; rank 0 then
    writes the manifest and ``directory/latest``. With hybrid sharding the first
    replica writes the shards (the others hold the same ones).

    Args:
        model: a root ``FullyShardedDataParallel`` (nested units inside).
        directory: the checkpoint root, shared by every rank.
        optim: the optimizer built over ``model.parameters()``; default None (model
            only). Element-wise optimizers (Adam, AdamW, SGD with momentum, ...).
        step: the training step; default 0.
        keep: committed checkpoints to keep (the newest); default 0: all.

    Returns:
        This rank's file, ``directory/ckpt-<step, 6 digits>/shard-<r>-of-<N>.safetensors``
        (``r``, ``N``: rank and size of the saving group).

    Raises:
        CheckpointError: (problem ``save``) on every rank, naming the failing ranks
            (see ``save_universal``); nothing is committed then.
        ValueError: a hybrid-sharded model over part of the world (pass
            ``group=`` to ``save_universal``), or non-element-wise optimizer state.
        TypeError: ``model`` is not a root FSDP module.
        RuntimeError: the model is on a disk tier (its directory is the checkpoint).
    """
    root = _root(model, "save_fsdp_sharded")
    group = _group(root, "save_fsdp_sharded")
    ckpt = save_universal(directory, step, model, optim, keep=keep, group=group)
    rank, world_size = _rank_world(group)
    return fsdp_shard_path(ckpt, rank, world_size)


def load_fsdp_sharded(
    model: nn.Module,
    directory: PathLike,
    optim: torch.optim.Optimizer | None = None,
) -> None:
    """Load the newest intact checkpoint under ``directory`` into ``model`` (and
    ``optim``), a collective: ``load_universal(directory, model, optim)`` over the
    model's ranks.

    Any universal checkpoint loads, whatever the world size, wrapping or strategy it was
    saved with. A damaged file makes every rank use the previous checkpoint, with a
    warning. Every check runs and the ranks agree before anything is written: a load
    that fails changes nothing on any rank.

    Args:
        model: a root ``FullyShardedDataParallel``.
        directory: the checkpoint root (or one ``ckpt-<step>`` directory).
        optim: the optimizer built over ``model.parameters()`` after wrapping; it gets
            the saved state and hyperparameters. Default None: the model only.

    Raises:
        CheckpointMismatchError: ``optim`` given and the checkpoint holds no optimizer
            state; keys or shapes that differ from the model's; an old-format directory
            (convert it: ``python -m shardkit.checkpoint convert``).
        CheckpointCorruptError: every committed checkpoint is damaged.
        FileNotFoundError: nothing committed under ``directory``.
        CheckpointError: (problem ``load`` / ``read``) a rank failed while reading.
        TypeError, ValueError, RuntimeError: as :func:`save_fsdp_sharded`.
    """
    root = _root(model, "load_fsdp_sharded")
    group = _group(root, "load_fsdp_sharded")
    load_universal(directory, model, optim, group=group, require_optimizer_state=True)
