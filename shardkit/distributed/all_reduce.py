"""The differentiable all-reduces at the borders of a region split over a group.

Shoeybi et al. 2019 (Megatron-LM), section 3, call them ``f`` and ``g``:

| operator | forward | backward |
|---|---|---|
| :func:`copy_to_region` (``f``) | identity | all-reduce (sum) |
| :func:`reduce_from_region` (``g``) | all-reduce (sum) | identity |

``copy`` enters a region whose ranks each use the whole input for a different part of
the output (each contributes a partial gradient of the input: summed in backward);
``reduce`` leaves it when each rank holds a partial sum of the output. One
implementation for every layer split that way: the tensor-parallel layers
(:mod:`shardkit.nn.tensor_parallel.mappings` resolves their default group and calls
these) and tensor parallel inside each expert (:mod:`shardkit.nn.moe.experts`). A
group of one rank, or None, issues no collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["copy_to_region", "reduce_from_region"]


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    out = x.contiguous().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Identity in forward; the gradient all-reduced (summed) over ``group`` in backward
    (Megatron-LM's ``f``).

    Args:
        x: any shape.
        group: the ranks of the region; None: one rank (no collective).
    """
    out: torch.Tensor = _CopyToRegion.apply(x, group)
    return out


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` all-reduced (summed) over ``group`` in forward (a new tensor); identity in
    backward (Megatron-LM's ``g``).

    Args:
        x: any shape; each rank's partial sum.
        group: the ranks of the region; None: one rank (no collective, a copy).
    """
    out: torch.Tensor = _ReduceFromRegion.apply(x, group)
    return out
