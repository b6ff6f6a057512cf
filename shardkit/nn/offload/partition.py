"""Partition of a sequence of layers into contiguous slices balanced by parameter count.

[Note: why an exact partition]
FairScale's ``_split`` walks the layers and closes a slice once the running count passes
``total / num_slices``; a large layer late in the model can leave the last slice with
most of the parameters. Resident memory of the offload tiers is set by the *largest*
slice, so shardkit minimises exactly that with the exact solver shared with Pipe
(:mod:`shardkit.distributed.linear_partition`).
"""

from __future__ import annotations

from collections.abc import Sequence

from shardkit.distributed.linear_partition import linear_partition

__all__ = ["balance_by_size"]


def _check(sizes: Sequence[int], num_slices: int) -> None:
    if num_slices < 1:
        raise ValueError(f"num_slices must be >= 1; got {num_slices}")
    if num_slices > len(sizes):
        raise ValueError(
            f"num_slices ({num_slices}) is larger than the number of layers ({len(sizes)}); "
            f"every slice needs at least one layer: use num_slices <= {len(sizes)} or split "
            "the model into more nn.Sequential children"
        )
    if any(s < 0 for s in sizes):
        raise ValueError(f"layer sizes must be >= 0; got {list(sizes)}")


def balance_by_size(sizes: Sequence[int], num_slices: int) -> list[int]:
    """Split ``len(sizes)`` layers into ``num_slices`` contiguous, non-empty slices.

    Minimises the largest slice sum (the resident size of the offload tiers); among
    optimal partitions the one with the longest leading slices is returned (deterministic).

    Args:
        sizes: per-layer sizes (e.g. parameter elements), each >= 0.
        num_slices: number of slices, ``1 <= num_slices <= len(sizes)``.

    Returns:
        ``balance``: number of layers in each slice (sums to ``len(sizes)``), as in
        torchgpipe / ``shardkit.nn.Pipe``.

    Raises:
        ValueError: if ``num_slices`` is < 1 or larger than ``len(sizes)``, or a size is negative.

    Example:
        >>> balance_by_size([1, 1, 1, 9], 2)
        [3, 1]
    """
    _check(sizes, num_slices)
    return linear_partition(sizes, num_slices)
