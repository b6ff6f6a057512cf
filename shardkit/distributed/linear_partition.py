"""Contiguous partition of a sequence of costs: the shared solver of Pipe and OffloadModel.

Cut a list of per-layer costs into ``parts`` non-empty contiguous runs so that the
largest run sum is as small as possible: the slowest pipeline stage sets the
pipeline's pace (GPipe, Huang et al. 2019, section 2.2), the largest offload slice
sets resident memory. The classic linear-partition dynamic programme is exact, in
``O(parts * layers^2)`` time, instant for the hundreds of layers a model has.

Callers validate their own arguments (their errors name their own terms: stages,
slices) before calling :func:`linear_partition`.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balance_bounds", "linear_partition"]


def linear_partition(costs: Sequence[float], parts: int) -> list[int]:
    """Layers per run minimising the largest run sum of ``costs`` (contiguous runs).

    Args:
        costs: one non-negative cost per layer (any unit: bytes, seconds).
        parts: number of runs, ``1 <= parts <= len(costs)`` (the caller checks).

    Returns:
        The balance: ``parts`` integers >= 1 summing to ``len(costs)``. Among optimal
        balances, the one whose earlier runs are longest (deterministic).

    Example:
        >>> linear_partition([1, 1, 1, 9], 2)
        [3, 1]
    """
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest max-run-sum splitting layers i.. into k runs.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][n] = 0.0
    for k in range(1, parts + 1):
        for i in range(n - k, -1, -1):
            for j in range(n - k + 1, i, -1):  # the first run is layers i..j-1
                cost = max(prefix[j] - prefix[i], best[k - 1][j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    balance, i = [], 0
    for k in range(parts, 0, -1):
        balance.append(cut[k][i] - i)
        i = cut[k][i]
    return balance


def balance_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` layer indices of each run: ``[2, 3] -> [(0, 2), (2, 5)]``."""
    bounds, start = [], 0
    for size in balance:
        bounds.append((start, start + size))
        start += size
    return bounds
