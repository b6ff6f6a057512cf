"""Reading the previous release's FSDP sharded format (``shardkit.fsdp_sharded/1``).

``save_fsdp_sharded`` wrote, until it became a call to the universal checkpoint, one
file per rank, ``fsdp-shard-<r>-of-<N>.pt`` (a manifest checkpoint: ``latest``,
``ckpt-<step>/``, ``manifest.json``; or a plain directory of shard files)::

    {"format": "shardkit.fsdp_sharded/1", "rank": r, "world_size": N,
     "units": {unit key: {"total": T, "shard_numel": S, "names": [...],
                          "shapes": [...], "keys": [[state-dict keys], ...],
                          "flat": (S,) tensor}},
     "buffers": {name: tensor}, "buffer_keys": {name: state-dict key},
     "optim": None | {"param_groups": [...], "scalars": {param name: {...}},
                      "flat": {unit key: {state key: (S,) tensor}}}}

A unit's flat parameter is its parameters, concatenated, padded to ``N * S``
elements; rank r's file holds elements ``[r * S, (r + 1) * S)``. The optimizer state
is laid out the same way per state key. Only ``convert`` reads it.

[Note: names in the FSDP format]
A unit's record names each parameter by its first location relative to the unit's
wrapped module; the key is ``<unit path>.<name>``. A record without ``"keys"`` (per
parameter, the list of its state-dict keys) does not know a tied parameter's other
names nor which names inside a unit are wrapper attributes; a record without
``"buffer_keys"`` names buffers as the wrapped model's ``named_buffers()``. The
converted checkpoint then has those names as recorded (:func:`read` returns a note).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shardkit.checkpoint.legacy.flat import read_flat_range
from shardkit.checkpoint.legacy.state import LegacyState, open_records, rank_files

__all__ = ["FILE", "FORMAT", "read"]

FORMAT = "shardkit.fsdp_sharded/1"
FILE = re.compile(r"fsdp-shard-(\d+)-of-(\d+)\.pt")


def _unit_keys(key: str, unit: dict[str, Any]) -> list[list[str]]:
    """Per parameter of a unit, in flat order: its state-dict keys."""
    if "keys" in unit:
        return [list(keys) for keys in unit["keys"]]
    prefix = key[: -len("flat_param")]
    return [[prefix + name] for name in unit["names"]]


def _notes(first: dict[str, Any]) -> list[str]:
    notes = []
    if not all("keys" in unit for unit in first["units"].values()):
        notes.append(
            f"format {FORMAT} records each parameter under its first name only: a tied "
            "parameter's other names are not in the output (tie them again after "
            "loading with strict=False), and names inside a unit keep wrapper "
            "attributes (checkpoint_wrapper's 'module.')"
        )
    if first["buffers"] and "buffer_keys" not in first:
        notes.append(
            "buffers are named as the wrapped model's named_buffers() (wrapper "
            "attributes kept; non-persistent buffers included)"
        )
    return notes


def _check(files: Sequence[Path], records: Sequence[dict[str, Any]]) -> None:
    n = len(records)
    for rank, (path, record) in enumerate(zip(files, records)):
        if record.get("format") != FORMAT:
            raise ValueError(f"{path} has format {record.get('format')!r}, expected {FORMAT!r}")
        if (record.get("rank"), record.get("world_size")) != (rank, n):
            raise ValueError(
                f"{path} says rank {record.get('rank')} of {record.get('world_size')}, "
                f"its name says {rank} of {n}: the files come from different saves"
            )
        if set(record["units"]) != set(records[0]["units"]):
            raise ValueError(f"{path} has other units than {files[0]}: different saves")


def _full(
    records: Sequence[dict[str, Any]], unit_key: str, path: Sequence[str]
) -> list[torch.Tensor]:
    """Every parameter of unit ``unit_key`` (flat, unpadded) from the flat tensors at
    ``path`` (``("units", key, "flat")`` or ``("optim", "flat", key, state)``)."""
    unit = records[0]["units"][unit_key]
    shards = []
    for record in records:
        value: Any = record
        for part in path:
            value = value[part]
        shards.append(value)
    out, offset = [], 0
    for shape in unit["shapes"]:
        numel = int(torch.Size(shape).numel())
        out.append(read_flat_range(shards, int(unit["shard_numel"]), offset, offset + numel))
        offset += numel
    if offset > int(unit["total"]):
        raise ValueError(
            f"unit {unit_key!r}: parameters of {offset} elements, total {unit['total']}"
        )
    return out


def read(ckpt: Path) -> LegacyState:
    """The full state of the FSDP sharded checkpoint in directory ``ckpt`` (its files
    already verified against the manifest, if any).

    Raises:
        ValueError: the files do not form one save; the optimizer had several param
            groups (the format does not record which parameters each held).
    """
    files = rank_files(ckpt, FILE)
    records = open_records(files)
    _check(files, records)
    first = records[0]
    state = LegacyState(FORMAT, len(records), notes=_notes(first))
    optim = first.get("optim")
    for unit_key, unit in first["units"].items():
        values = _full(records, unit_key, ("units", unit_key, "flat"))
        keys = _unit_keys(unit_key, unit)
        moments = {}
        if optim is not None:
            moments = {
                name: _full(records, unit_key, ("optim", "flat", unit_key, name))
                for name in optim["flat"].get(unit_key, {})
            }
        for i, (names, shape) in enumerate(zip(keys, unit["shapes"])):
            state.add_param(names, values[i].clone().reshape(shape))
            if optim is None:
                continue
            scalars = optim["scalars"].get(names[0], optim["scalars"].get(unit["names"][i]))
            if scalars is None:  # no state for this parameter (frozen, or never stepped)
                continue
            param_state: dict[str, Any] = dict(scalars)
            for name, per_param in moments.items():
                param_state[name] = per_param[i].clone().reshape(shape)
            state.optim_state[names[0]] = param_state
    keyed = first.get("buffer_keys")  # persistent buffers only, where recorded
    for name, buf in first["buffers"].items():
        if keyed is None or name in keyed:
            state.buffers[name if keyed is None else keyed[name]] = buf.clone()
    if optim is not None:
        state.set_single_group(optim["param_groups"], FORMAT)
    return state
