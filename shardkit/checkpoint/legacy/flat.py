"""Reading a range of a flat tensor saved as equal shards (the previous release's FSDP format)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["read_flat_range"]


def read_flat_range(
    shards: Sequence[torch.Tensor], shard_numel: int, start: int, end: int
) -> torch.Tensor:
    """Elements ``[start, end)`` of the concatenation of ``shards`` (each ``(S,)``).

    Only the shards overlapping the range are touched.

    Raises:
        ValueError: the range is outside ``[0, len(shards) * S]``.
    """
    if not 0 <= start <= end <= len(shards) * shard_numel:
        raise ValueError(
            f"range [{start}, {end}) outside the {len(shards)} x {shard_numel} saved elements"
        )
    pieces = []
    for k in range(start // shard_numel if shard_numel else 0, len(shards)):
        lo, hi = k * shard_numel, (k + 1) * shard_numel
        if lo >= end:
            break
        pieces.append(shards[k][max(start, lo) - lo : min(end, hi) - lo])
    if not pieces:
        return torch.empty(0)
    return torch.cat(pieces)
