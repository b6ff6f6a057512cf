"""Reading the previous release's OSS sharded format (``shardkit.sharded_optim/1``).

``OSS.save_sharded`` wrote, until it became a call to the universal checkpoint, one
file per rank, ``optim-shard-<r>-of-<N>.pt`` (a manifest checkpoint, or a plain
directory of shard files)::

    {"format": "shardkit.sharded_optim/1", "rank": r, "world_size": N,
     "param_groups": [...],          # the full groups, torch layout (global indices)
     "state": {global_index: {...}}} # only the parameters rank r owned

Global indices are those of a plain ``torch.optim`` state dict. It holds optimizer
state only, no parameter: the universal checkpoint ``convert`` writes keys each
parameter with state as ``OSS.save_sharded`` does now (``"params.<i>"``), with zeros
for its values (the model is saved on its own); a parameter without state (frozen)
is not in it. Only ``convert`` reads it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from shardkit.checkpoint.legacy.state import LegacyState, open_records, rank_files
from shardkit.checkpoint.sharded_optim import merge_optimizer_shards
from shardkit.checkpoint.universal.optim_state import optimizer_param_key

__all__ = ["FILE", "FORMAT", "load_optimizer_shards", "read"]

FORMAT = "shardkit.sharded_optim/1"
FILE = re.compile(r"optim-shard-(\d+)-of-(\d+)\.pt")


def load_optimizer_shards(ckpt: Path) -> dict[str, Any]:
    """The plain ``torch.optim`` state dict merged from the shard files in ``ckpt``.

    Raises:
        ValueError: files of another format, or not one complete save (see
            :func:`~shardkit.checkpoint.sharded_optim.merge_optimizer_shards`).
    """
    files = rank_files(ckpt, FILE)
    shards = open_records(files)
    for path, shard in zip(files, shards):
        if shard.get("format") != FORMAT:
            raise ValueError(f"{path} has format {shard.get('format')!r}, expected {FORMAT!r}")
    return merge_optimizer_shards(shards)


def read(ckpt: Path) -> LegacyState:
    """The state of the OSS sharded checkpoint in directory ``ckpt``.

    Raises:
        ValueError: as :func:`load_optimizer_shards`.
    """
    full = load_optimizer_shards(ckpt)
    out = LegacyState(
        FORMAT,
        0,
        notes=[
            "OSS sharded: optimizer state only; parameters with state are saved as "
            "zeros under params.<index>, parameters without state are left out "
            "(load with OSS.load_sharded, or load_universal(..., strict=False))"
        ],
    )
    for group in full["param_groups"]:
        keys = []
        for index in group["params"]:
            state = full["state"].get(index)
            shape = next(
                (
                    v.shape
                    for v in (state or {}).values()
                    if isinstance(v, torch.Tensor) and v.dim()
                ),
                None,
            )
            if state is None or shape is None:
                continue
            key = optimizer_param_key(index)
            out.add_param([key], torch.zeros(shape, dtype=_dtype(state)))
            out.optim_state[key] = dict(state)
            keys.append(key)
        hyper = {k: v for k, v in group.items() if k != "params"}
        out.param_groups.append({"hyper": hyper, "keys": keys})
    return out


def _dtype(state: dict[str, Any]) -> torch.dtype:
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim()]
    return tensors[0].dtype
