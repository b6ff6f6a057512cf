"""Contiguous partition of a sequence of costs: the one validated solver of Pipe and OffloadModel.

Cut a list of per-layer costs into ``partitions`` non-empty contiguous runs so that
the largest run sum is as small as possible: the slowest pipeline stage sets the
pipeline's pace (GPipe, Huang et al. 2019, section 2.2), the largest offload slice
sets resident memory. The classic linear-partition dynamic programme is exact, in
``O(partitions * layers^2)`` time, instant for the hundreds of layers a model has.

[Note: one solver, several names]
:func:`solve_balance` validates its arguments and raises :class:`BalanceError` (a
``ValueError``) naming the offending values; ``shardkit.nn.pipe.solve_balance`` is
this function, ``shardkit.nn.pipe.balance_by_size(partitions, module)`` and
``balance_by_time`` reduce a module to costs and call it, and ``OffloadModel`` calls it
with ``name="num_slices"`` so the error names its own argument. The deprecated
``shardkit.nn.offload.balance_by_size(sizes, num_slices)`` is a thin alias.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

__all__ = ["BalanceError", "balance_bounds", "linear_partition", "solve_balance"]


class BalanceError(ValueError):
    """A balance that does not fit the module or the devices (also ``shardkit.nn.pipe``)."""


def solve_balance(
    costs: Sequence[float], partitions: int, *, name: str = "partitions"
) -> list[int]:
    """Layers per partition minimising the largest partition cost (contiguous runs).

    Example:
        >>> solve_balance([1, 1, 1, 9], 2)
        [3, 1]

    Args:
        costs: one finite, non-negative cost per layer (any unit: bytes, seconds).
        partitions: number of partitions (stages, slices), ``1 <= partitions <= len(costs)``.
        name: the caller's name for ``partitions``, used in error messages (keyword
            only; default ``"partitions"``; OffloadModel passes ``"num_slices"``).

    Returns:
        The balance: ``partitions`` integers >= 1 summing to ``len(costs)``. Among
        optimal balances, the one whose earlier partitions are longest (deterministic).

    Raises:
        TypeError: ``partitions`` is not an integer (a bool, a float).
        BalanceError: ``partitions`` out of range, or a cost negative, NaN or infinite;
            the message names the values and the fix.
    """
    partitions = _check_partitions(len(costs), partitions, name)
    _check_costs(costs)
    return _min_max_partition([float(c) for c in costs], partitions)


def linear_partition(costs: Sequence[float], parts: int) -> list[int]:
    """:func:`solve_balance` under this module's original name and argument names."""
    return solve_balance(costs, parts, name="parts")


def _check_partitions(layers: int, partitions: int, name: str) -> int:
    if isinstance(partitions, bool):
        raise TypeError(f"{name} must be an integer; got {partitions!r}")
    try:
        partitions = operator.index(partitions)
    except TypeError:
        raise TypeError(
            f"{name} must be an integer; got {partitions!r} ({type(partitions).__name__})"
        ) from None
    if partitions < 1:
        raise BalanceError(
            f"cannot split {layers} layers into {partitions} partitions: {name} must be >= 1"
        )
    if partitions > layers:
        raise BalanceError(
            f"cannot split {layers} layers into {partitions} partitions: {name} ({partitions}) "
            f"is larger than the number of layers ({layers}); every partition needs at least "
            f"one layer: use {name} <= {layers} or split the model into more layers"
        )
    return partitions


def _check_costs(costs: Sequence[float]) -> None:
    for i, c in enumerate(costs):
        if not (c >= 0 and math.isfinite(c)):
            raise BalanceError(
                f"layer costs must be >= 0 and finite; got {list(costs)} (layer {i}: {c})"
            )


def _min_max_partition(costs: list[float], parts: int) -> list[int]:
    """The dynamic programme, on checked arguments (see :func:`solve_balance`)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
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
