"""Cross-rank consistency checks: one cheap collective at wrap time instead of a hang.

If one rank builds a different model (another width, a parameter in another order,
another dtype) or passes other sharding options, the first collective that depends
on those shapes either hangs until the process-group timeout or, worse, succeeds
with mismatched buffers and trains silently wrong. :func:`verify_consistent`
compares a digest of every rank's description with one ``all_gather_object`` of a
32-byte hash; only on a mismatch are the full descriptions gathered, to name the
first differing entry and the ranks that disagree. The error is raised on every rank,
so no rank is left waiting in a later collective.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ConsistencyError", "describe_parameters", "verify_consistent"]


class ConsistencyError(ValueError):
    """Ranks disagree on something that must be identical across them."""


def describe_parameters(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """One line per parameter: ``name shape=(..) dtype=.. requires_grad=..``, in order."""
    return [
        f"{name} shape={tuple(t.shape)} dtype={t.dtype} requires_grad={t.requires_grad}"
        for name, t in named
    ]


def _first_difference(per_rank: Sequence[Sequence[str]]) -> tuple[int, dict[int, str]]:
    longest = max(len(d) for d in per_rank)
    for i in range(longest):
        entries = {r: (d[i] if i < len(d) else "<missing>") for r, d in enumerate(per_rank)}
        if len(set(entries.values())) > 1:
            return i, entries
    return longest, {}


def verify_consistent(
    description: Sequence[str],
    *,
    what: str,
    group: dist.ProcessGroup | None = None,
    options: Mapping[str, Any] | None = None,
) -> None:
    """Raise on every rank of ``group`` unless all ranks pass the same ``description``.

    A collective: every rank of ``group`` must call it. Costs one ``all_gather_object``
    of a 32-byte digest when the ranks agree.

    Args:
        description: lines that must match across ranks, e.g. from
            :func:`describe_parameters` (names, shapes, dtypes, order).
        what: the caller, for the message (e.g. ``"FullyShardedDataParallel"``).
        group: the process group; default None (the world group).
        options: settings that must match too (e.g. ``{"reshard_after_forward": True}``);
            compared by their ``repr``.

    Raises:
        ConsistencyError: naming the first differing entry, what each rank has, and
            the fix.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    lines = [f"option {k}={v!r}" for k, v in sorted((options or {}).items())] + list(description)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    world = dist.get_world_size(group)
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, lines, group=group)
    index, entries = _first_difference(everyone)
    by_value: dict[str, list[int]] = {}
    for rank, entry in entries.items():
        by_value.setdefault(entry, []).append(rank)
    detail = "; ".join(f"ranks {ranks} have {entry!r}" for entry, ranks in by_value.items())
    raise ConsistencyError(
        f"{what}: ranks disagree at entry {index} of {max(len(e) for e in everyone)}: {detail}. "
        "Every rank must build the same model (same parameters, shapes, dtypes, order) "
        "and pass the same options before wrapping."
    )
