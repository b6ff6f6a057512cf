"""Sharded FSDP checkpoints: one file per rank, loadable at any world size.

The format belongs to FSDP and is built on :mod:`shardkit.checkpoint.manifest`
(atomic files, checksums) and :func:`shardkit.checkpoint.flat.read_flat_range`.

Each rank writes only its own shards (no gather), atomically, through the manifest
(:mod:`shardkit.checkpoint.manifest`): ``<directory>/ckpt-<step>/`` holds the files
and ``manifest.json`` (size and sha256 of each), ``<directory>/latest`` the newest
committed step. Loading verifies the checksums (the ranks share the work) and falls
back to the previous checkpoint when a file is damaged. A plain directory of shard
files (written before the manifest existed) still loads, unchecked::

    fsdp-shard-<rank>-of-<world_size>.pt  holds
    {"format": "shardkit.fsdp_sharded/1", "rank": r, "world_size": N,
     "units": {unit key: {"total": T, "shard_numel": S, "names": [...],
                          "shapes": [...], "keys": [[state-dict keys], ...],
                          "flat": (S,) tensor}},
     "buffers": {name: tensor}, "buffer_keys": {name: state-dict key},
     "optim": None | {"param_groups": [...], "scalars": {param name: {...}},
                      "flat": {unit key: {state key: (S,) tensor}}}}

A unit's flat parameter is the concatenation of its parameters padded to N * S
elements; rank r's file holds elements ``[r * S, (r + 1) * S)``. Loading at another
world size M reads, for each unit, the elements of the new rank's range from the old
files it overlaps (memory-mapped, so only those bytes are read) and pads the rest.
Optimizer state is stored the same way (flat shards per state key, see
``shardkit.nn.data_parallel.fully_sharded.optim_state``), so it re-shards too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.checkpoint.agreement import broadcast_outcome, gather_failures
from shardkit.checkpoint.flat import read_flat_range
from shardkit.checkpoint.manifest import (
    CheckpointError,
    _save_failed,
    checkpoint_name,
    load_tensors_only,
    save_checkpoint,
)
from shardkit.checkpoint.sharded_optim import resolve_shard_directory
from shardkit.nn.data_parallel.fully_sharded.disk_tier import refuse_on_disk
from shardkit.nn.data_parallel.fully_sharded.optim_state import (
    flat_optim_state,
    flat_optim_state_dict,
)
from shardkit.nn.data_parallel.fully_sharded.unit import (
    UnitRuntime,
    as_sharded,
    named_units,
    units_in,
    unwrapped_module,
)

__all__ = [
    "FSDP_SHARD_FORMAT",
    "fsdp_shard_path",
    "load_fsdp_sharded",
    "save_fsdp_sharded",
]

FSDP_SHARD_FORMAT = "shardkit.fsdp_sharded/1"
PathLike = str | os.PathLike[str]
_NAME = re.compile(r"fsdp-shard-(\d+)-of-(\d+)\.pt")


def fsdp_shard_path(directory: PathLike, rank: int, world_size: int) -> Path:
    """The file of rank ``rank`` in a checkpoint saved at ``world_size`` ranks."""
    return Path(directory) / f"fsdp-shard-{rank}-of-{world_size}.pt"


def _unit_record(unit: UnitRuntime, keys: dict[int, list[str]]) -> dict[str, Any]:
    handle = unit.handle
    return {
        "total": handle.layout.total,
        "shard_numel": handle.layout.shard_numel,
        "names": [info.name for info in handle.infos],
        "shapes": [list(info.shape) for info in handle.infos],
        "keys": [keys.get(id(param), []) for param in handle.sharded_params],
        "flat": handle.local_shard.detach().clone(),
    }


def _state_dict_keys(model: nn.Module) -> tuple[dict[int, list[str]], dict[int, str]]:
    """The plain model's state-dict keys of every sharded parameter (every name of a
    tied one) and persistent buffer, by object id, from the module tree as it stands
    (no gathering: ``keep_vars`` state dict of the wrapped module, units in gathering
    mode so that their own state-dict hooks let it through). The keys are the plain
    model's however many units wrap it directly (``FSDP(FSDP(m))``)."""
    units = units_in(model)
    for unit in units:
        unit.gathering_state_dict = True
    try:
        raw = nn.Module.state_dict(unwrapped_module(model), keep_vars=True)
    finally:
        for unit in units:
            unit.gathering_state_dict = False
    params: dict[int, list[str]] = {}
    buffers: dict[int, str] = {}
    for key, value in raw.items():
        if isinstance(value, nn.Parameter):
            params.setdefault(id(as_sharded(units, value)), []).append(key)
        elif isinstance(value, torch.Tensor):
            buffers[id(value)] = key
    return params, buffers


def save_fsdp_sharded(
    model: nn.Module,
    directory: PathLike,
    optim: torch.optim.Optimizer | None = None,
    *,
    step: int = 0,
    keep: int = 0,
) -> Path:
    """Write this rank's shards (and ``optim``'s) under ``directory`` (a collective).

    Every rank of the model's process group calls it with the same ``directory``
    (created if missing). The files go to ``directory/ckpt-<step>/``; rank 0 then
    writes the manifest and ``directory/latest``
    (:func:`shardkit.checkpoint.manifest.save_checkpoint`). With hybrid sharding only the
    first replica's shard group writes (the replicas hold the same shards); the file
    world size is the shard group's, so the checkpoint loads at any other shape.

    Args:
        step: the training step; default 0. Saving a step again overwrites it: pass
            the step so that a crash mid-save leaves the previous one usable.
        keep: committed checkpoints to keep (the newest); default 0: all.

    Returns:
        The path of this rank's file, ``directory/ckpt-<step, 6 digits>/<file>`` (a
        replica that does not write gets the path of the same file its first
        replica wrote).

    Raises:
        CheckpointError: (problem ``save``) on every rank of the data-parallel group,
            within seconds, naming the failing ranks with their exception's type and
            message: a rank could not build its record (the exception is chained on
            that rank) or write its file, or the commit failed. Nothing is committed
            then; the previous checkpoint stays ``latest``.
        RuntimeError: the model is on a disk tier (its directory is the checkpoint).
    """
    runtimes = named_units(model)
    refuse_on_disk(list(runtimes.values()), "save_fsdp_sharded")
    root = _root(runtimes)
    group, replicas = root.process_group, root.replicate_group
    writer = replicas is None or dist.get_rank(replicas) == 0  # replicas hold the same shards
    ckpt = Path(directory) / checkpoint_name(step)
    name = fsdp_shard_path(".", root.rank, root.world_size).name
    error: Exception | None = None
    try:  # a rank's failure is told to every rank, not left to hang them (below)
        record = _shard_record(model, runtimes, root, optim)
    except Exception as err:
        record, error = {}, err
    me = dist.get_rank() if dist.is_initialized() else 0  # the global rank: named
    # the replica group only under hybrid sharding (None there would mean the world:
    # ranks outside this model's group never join, and the save hung until the timeout)
    failed = gather_failures(me, error, [group] if replicas is None else [group, replicas])
    if failed:
        raise _save_failed(ckpt, f"not committed: {failed}") from error
    status = [""]
    if writer:
        layout = {"format": FSDP_SHARD_FORMAT, "reshardable": True}
        try:
            ckpt = save_checkpoint(
                directory, step, {name: record}, layout=layout, keep=keep, group=group
            )
        except CheckpointError as err:  # raised on every rank of the writing group
            status[0], error = str(err), err
    if replicas is not None:  # the others return once the writers committed, or failed
        broadcast_outcome(status, replicas)
    if status[0]:
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(ckpt, "save", status[0])
    return ckpt / name


def _shard_record(
    model: nn.Module,
    runtimes: dict[str, UnitRuntime],
    root: UnitRuntime,
    optim: torch.optim.Optimizer | None,
) -> dict[str, Any]:
    """This rank's file: its units' flat shards, the buffers, ``optim``'s flat state."""
    param_keys, buffer_keys = _state_dict_keys(model)
    units = {key: _unit_record(unit, param_keys) for key, unit in runtimes.items()}
    named_buffers = dict(model.named_buffers())
    record: dict[str, Any] = {
        "format": FSDP_SHARD_FORMAT,
        "rank": root.rank,
        "world_size": root.world_size,
        "units": units,
        "buffers": {n: b.detach().clone() for n, b in named_buffers.items()},
        "buffer_keys": {
            n: buffer_keys[id(b)] for n, b in named_buffers.items() if id(b) in buffer_keys
        },
        "optim": None,
    }
    if optim is not None:
        flat, scalars = flat_optim_state(model, optim)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]
        record["optim"] = {"param_groups": groups, "scalars": scalars, "flat": flat}
    return record


def _open_all(directory: PathLike) -> list[dict[str, Any]]:
    found = {}
    for entry in Path(directory).iterdir():
        match = _NAME.fullmatch(entry.name)
        if match:
            found[(int(match.group(1)), int(match.group(2)))] = entry
    sizes = {n for _, n in found}
    if len(sizes) != 1:
        raise FileNotFoundError(
            f"{directory}: expected the files of one sharded FSDP checkpoint, found world "
            f"sizes {sorted(sizes)}; save each checkpoint to its own directory"
        )
    (n,) = sizes
    missing = [r for r in range(n) if (r, n) not in found]
    if missing:
        raise FileNotFoundError(f"{directory}: shard files of ranks {missing} (of {n}) missing")
    return [load_tensors_only(found[(r, n)], mmap=True) for r in range(n)]


def _dig(record: dict[str, Any], path: tuple[str, ...]) -> Any:
    for part in path:
        record = record[part]
    return record


def _root(runtimes: dict[str, UnitRuntime]) -> UnitRuntime:
    if "flat_param" not in runtimes:
        raise TypeError("expected a FullyShardedDataParallel model (the root unit)")
    return runtimes["flat_param"]


def _resharded(
    records: list[dict[str, Any]], unit: UnitRuntime, key: str, path: tuple[str, ...]
) -> torch.Tensor:
    """This rank's shard of the flat tensor at ``path`` in every record, zero-padded."""
    lo, hi = unit.handle.layout.shard_range(unit.rank)
    total = records[0]["units"][key]["total"]
    shards = [_dig(rec, path) for rec in records]
    end = min(hi, total)
    part = read_flat_range(shards, records[0]["units"][key]["shard_numel"], min(lo, end), end)
    out = shards[0].new_zeros(hi - lo)
    out[: part.numel()].copy_(part)
    return out


@torch.no_grad()
def load_fsdp_sharded(
    model: nn.Module,
    directory: PathLike,
    optim: torch.optim.Optimizer | None = None,
) -> None:
    """Load the newest intact checkpoint written by :func:`save_fsdp_sharded`, at any
    world size (a collective over the model's process group).

    The model must be wrapped the same way (same units, same parameters); the world
    size may differ. ``optim`` (built after wrapping) gets the saved state. A damaged
    file makes every rank use the previous checkpoint, with a warning. Every rank
    reads and checks everything it loads first and the ranks agree; only then are the
    shards, buffers and optimizer state replaced, so a load that fails changes nothing
    on any rank (this rank's share of the checkpoint is held once more meanwhile).

    Raises:
        CheckpointCorruptError: every committed checkpoint is damaged.
        FileNotFoundError: shard files missing, or nothing committed.
        ValueError: the units or their parameters differ from the saved ones, or
            ``optim`` is given and the checkpoint has no optimizer state.
        CheckpointError: (problem ``load``) another rank failed while reading.
        RuntimeError: the model is on a disk tier (resume its directory instead).
    """
    units = named_units(model)
    refuse_on_disk(list(units.values()), "load_fsdp_sharded")
    root = _root(units)
    found = resolve_shard_directory(directory, collective=True, group=root.process_group)
    error: Exception | None = None
    try:
        commit = _read_shards(model, units, found, directory, optim)
    except Exception as err:  # told to every rank below: none loads, none hangs
        error = err
    me = dist.get_rank() if dist.is_initialized() else 0
    failed = gather_failures(me, error, [root.process_group])
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(found, "load", f"loading {found} failed on {failed}")
    commit()


def _read_shards(
    model: nn.Module,
    units: dict[str, UnitRuntime],
    found: Path,
    directory: PathLike,
    optim: torch.optim.Optimizer | None,
) -> Callable[[], None]:
    """Everything :func:`load_fsdp_sharded` loads, read and checked; returns the commit
    (``optim.load_state_dict`` of a state dict it accepts, in-memory copies)."""
    records = _open_all(found)
    _check_units(records[0]["units"], units)
    shards = {
        key: _resharded(records, unit, key, ("units", key, "flat")) for key, unit in units.items()
    }
    buffers = [(buf, records[0]["buffers"][name]) for name, buf in model.named_buffers()]
    optim_state: dict[str, Any] | None = None
    if optim is not None:
        saved = records[0]["optim"]
        if saved is None:
            raise ValueError(f"{directory}: the checkpoint has no optimizer state")
        if len(saved["param_groups"]) != len(optim.param_groups):
            raise ValueError(
                f"{directory}: the checkpoint's optimizer has {len(saved['param_groups'])} "
                f"param groups, this one {len(optim.param_groups)}; build the optimizer "
                "with the same groups"
            )
        flat = {
            key: {
                sk: _resharded(records, unit, key, ("optim", "flat", key, sk))
                for sk in saved["flat"][key]
            }
            for key, unit in units.items()
        }
        optim_state = flat_optim_state_dict(
            model, optim, flat, saved["scalars"], saved["param_groups"]
        )

    def commit() -> None:
        if optim is not None and optim_state is not None:
            optim.load_state_dict(optim_state)
        for key, unit in units.items():
            unit.handle.local_shard.copy_(shards[key])
        for buf, value in buffers:
            buf.copy_(value)

    return commit


def _check_units(saved: dict[str, Any], units: dict[str, UnitRuntime]) -> None:
    if set(saved) != set(units):
        raise ValueError(
            f"the checkpoint's units {sorted(saved)} differ from the model's {sorted(units)}; "
            "wrap the model as it was wrapped when saved"
        )
    for key, unit in units.items():
        names = [info.name for info in unit.handle.infos]
        shapes = [list(info.shape) for info in unit.handle.infos]
        if saved[key]["names"] != names or saved[key]["shapes"] != shapes:
            raise ValueError(
                f"unit {key!r}: saved parameters {list(zip(saved[key]['names'], saved[key]['shapes']))} "
                f"differ from the model's {list(zip(names, shapes))}"
            )
