"""Deprecated: the offload name of the partition solver (use ``solve_balance``).

[Note: why an exact partition]
FairScale's ``_split`` walks the layers and closes a slice once the running count passes
``total / num_slices``; a large layer late in the model can leave the last slice with
most of the parameters. Resident memory of the offload tiers is set by the *largest*
slice, so ``OffloadModel`` minimises exactly that with the one solver shared with Pipe,
:func:`shardkit.distributed.linear_partition.solve_balance`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from shardkit.distributed.linear_partition import solve_balance

__all__ = ["balance_by_size"]


def balance_by_size(sizes: Sequence[int], num_slices: int) -> list[int]:
    """Deprecated alias: ``solve_balance(sizes, num_slices, name="num_slices")``.

    Kept with its old signature (``shardkit.nn.pipe.balance_by_size`` takes
    ``(partitions, module)``: the same name with other arguments, hence the rename).

    Args:
        sizes: per-layer sizes (e.g. parameter elements), each >= 0.
        num_slices: number of slices, ``1 <= num_slices <= len(sizes)``.

    Returns:
        Layers per slice, summing to ``len(sizes)`` (see ``solve_balance``).

    Raises:
        BalanceError: a ``ValueError`` naming ``num_slices`` or the bad size.

    Example:
        >>> balance_by_size([1, 1, 1, 9], 2)  # warns: DeprecationWarning
        [3, 1]
    """
    warnings.warn(
        "shardkit.nn.offload.balance_by_size(sizes, num_slices) is deprecated; use "
        "shardkit.distributed.linear_partition.solve_balance(sizes, num_slices), the one "
        "solver shared with shardkit.nn.pipe",
        DeprecationWarning,
        stacklevel=2,
    )
    return solve_balance(sizes, num_slices, name="num_slices")
