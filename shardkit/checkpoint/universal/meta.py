"""The manifest ``layout`` of a universal checkpoint: what every key is, and its groups.

::

    {"format": "shardkit.universal/1", "strategy": "fsdp", "world_size": 4,
     "keys": {"wte.weight": {"shape": [64, 32], "dtype": "float32"}, ...},
     "optimizer": {"class": "AdamW",
                   "param_groups": [{"hyper": {"lr": 0.01, "betas": [0.9, 0.999], ...},
                                     "keys": ["wte.weight", ...]}, ...]} or null,
     "aliases": {"lm_head.weight": "wte.weight"}}   # tied keys: other -> first

:func:`build_layout` also checks, from what every rank writes, that each element of
each key (and of each saved optimizer state, of its own shape for per-tensor state)
is written exactly once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shardkit.checkpoint.universal.optim_state import state_shape
from shardkit.checkpoint.universal.plan import cover_problem
from shardkit.checkpoint.universal.shardfile import SavedPiece

__all__ = ["FORMAT", "KeyMeta", "build_layout", "extra_file_name"]

FORMAT = "shardkit.universal/1"
"""The format version, in the manifest's ``layout["format"]``."""


@dataclass(frozen=True)
class KeyMeta:
    """A key's global shape and dtype name."""

    shape: list[int]
    dtype: str


def extra_file_name(rank: int) -> str:
    """``extra-<rank>.pt``."""
    return f"extra-{rank}.pt"


def _cover_problems(summaries: list[dict[str, Any]], keys: dict[str, KeyMeta]) -> list[str]:
    by_key: dict[tuple[str, str], list[SavedPiece]] = {}
    for rank, summary in enumerate(summaries):
        for key, state, view, start, stop in summary["written"]:
            piece = SavedPiece(key, state, view, start, stop, "", f"rank {rank}", "")
            by_key.setdefault((key, state), []).append(piece)
    problems = []
    for key, meta in keys.items():
        if math.prod(meta.shape) and (key, "") not in by_key:
            problems.append(f"{key!r}: written by no rank")
    for (key, state), pieces in by_key.items():
        shape = tuple(keys[key].shape)
        problem = cover_problem(pieces, state_shape(shape, pieces) if state else shape)
        if problem is not None:
            what = f"{key!r}" + (f" (optimizer state {state!r})" if state else "")
            problems.append(f"{what}: {problem}")
    return problems


def build_layout(
    summaries: list[dict[str, Any]],
    strategy: str,
    world_size: int,
    groups: list[dict[str, Any]] | None,
    optimizer_class: str,
) -> dict[str, Any]:
    """The manifest layout from every rank's summary (``{"keys", "written",
    "groups", "aliases"}``, rank order), this rank's optimizer param groups and the
    optimizer's class name (:func:`~.optim_state.optimizer_class`).

    Raises:
        ValueError: an element written twice or by no rank (the keys are named, at
            most 10, and the count).
    """
    keys: dict[str, KeyMeta] = {}
    for summary in summaries:
        for key, meta in summary["keys"].items():
            keys.setdefault(key, meta)
    problems = _cover_problems(summaries, keys)
    if problems:
        raise ValueError(
            f"the {strategy!r} layout does not write every element exactly once "
            f"({len(problems)} problems): " + "; ".join(problems[:10])
        )
    optimizer = None
    if groups is not None:
        for g, record in enumerate(groups):
            for summary in summaries:
                for key in summary["groups"].get(g, []):
                    if key not in record["keys"]:
                        record["keys"].append(key)
        optimizer = {"class": optimizer_class, "param_groups": groups}
    aliases: dict[str, str] = {}
    for summary in summaries:
        aliases.update(summary.get("aliases", {}))
    return {
        "aliases": aliases,
        "format": FORMAT,
        "strategy": strategy,
        "world_size": world_size,
        "keys": {k: {"shape": m.shape, "dtype": m.dtype} for k, m in keys.items()},
        "optimizer": optimizer,
    }
