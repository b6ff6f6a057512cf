"""Partition of a sequence of layers into contiguous slices balanced by parameter count.

[Note: why an exact partition]
FairScale's ``_split`` walks the layers and closes a slice once the running count passes
``total / num_slices``; a large layer late in the model can leave the last slice with
most of the parameters. Resident memory of the offload tiers is set by the *largest*
slice, so shardkit minimises exactly that: the classic linear-partition dynamic
programme (O(num_slices * num_layers^2), instant for models with hundreds of layers).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balance_by_size", "slice_bounds"]


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
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: smallest max-slice-sum splitting the first i layers into k slices.
    best = [[inf] * (n + 1) for _ in range(num_slices + 1)]
    cut = [[0] * (n + 1) for _ in range(num_slices + 1)]
    best[0][0] = 0
    for k in range(1, num_slices + 1):
        for i in range(k, n + 1):
            for j in range(i - 1, k - 2, -1):  # last slice is layers j..i-1
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    balance: list[int] = []
    i = n
    for k in range(num_slices, 0, -1):
        j = cut[k][i]
        balance.append(i - j)
        i = j
    return balance[::-1]


def slice_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` layer ranges of each slice, from a ``balance`` list."""
    bounds, start = [], 0
    for count in balance:
        bounds.append((start, start + count))
        start += count
    return bounds
