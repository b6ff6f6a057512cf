"""The four autograd operators at the borders of a tensor-parallel region.

Shoeybi et al. 2019 (Megatron-LM), section 3, call the first two ``f`` and ``g``:

| operator | forward | backward |
|---|---|---|
| :func:`copy_to_tensor_parallel_region` | identity | all-reduce (sum) |
| :func:`reduce_from_tensor_parallel_region` | all-reduce (sum) | identity |
| :func:`scatter_to_tensor_parallel_region` | keep own last-dim chunk | all-gather last dim |
| :func:`gather_from_tensor_parallel_region` | all-gather last dim | keep own chunk |

``copy`` enters a region whose ranks each use the whole input for a different part of
the output (so each contributes a partial gradient of the input: summed in backward);
``reduce`` leaves a region whose ranks each hold a partial sum of the output. FairScale
names them ``*_model_parallel_region``; both names are exported. With one rank every
operator is the identity and issues no collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardkit.nn.tensor_parallel.groups import TPGroup, rank_and_size, resolve_group

__all__ = [
    "copy_to_model_parallel_region",
    "copy_to_tensor_parallel_region",
    "gather_from_model_parallel_region",
    "gather_from_tensor_parallel_region",
    "reduce_from_model_parallel_region",
    "reduce_from_tensor_parallel_region",
    "scatter_to_model_parallel_region",
    "scatter_to_tensor_parallel_region",
]


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    out = x.contiguous().clone()
    if rank_and_size(group)[1] > 1:
        dist.all_reduce(out, group=group)
    return out


def _split_last(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    rank, world = rank_and_size(group)
    if world == 1:
        return x
    size = x.shape[-1]
    if size % world != 0:
        raise ValueError(
            f"last dimension {size} is not divisible by the tensor-parallel degree {world}"
        )
    return x.chunk(world, dim=-1)[rank].contiguous()


def _gather_last(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    world = rank_and_size(group)[1]
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


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


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, ctx.group), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: TPGroup = None) -> torch.Tensor:
    """Identity in forward; all-reduce (sum) of the gradient over ``group`` in backward
    (Megatron-LM's ``f``). Default group: see :func:`~shardkit.nn.tensor_parallel.groups.resolve_group`."""
    return _CopyToRegion.apply(x, resolve_group(group))


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: TPGroup = None) -> torch.Tensor:
    """All-reduce (sum) over ``group`` in forward; identity in backward (Megatron-LM's ``g``)."""
    return _ReduceFromRegion.apply(x, resolve_group(group))


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: TPGroup = None) -> torch.Tensor:
    """This rank's chunk of the last dimension in forward (``(..., n)`` -> ``(..., n / T)``);
    all-gather of the gradient in backward.

    Raises:
        ValueError: ``n`` is not divisible by the degree ``T``.
    """
    return _ScatterToRegion.apply(x, resolve_group(group))


def gather_from_tensor_parallel_region(x: torch.Tensor, group: TPGroup = None) -> torch.Tensor:
    """All-gather of the last dimension in forward (``(..., n)`` -> ``(..., n x T)``, rank
    order); this rank's chunk of the gradient in backward."""
    return _GatherFromRegion.apply(x, resolve_group(group))


# FairScale's names
copy_to_model_parallel_region = copy_to_tensor_parallel_region
reduce_from_model_parallel_region = reduce_from_tensor_parallel_region
scatter_to_model_parallel_region = scatter_to_tensor_parallel_region
gather_from_model_parallel_region = gather_from_tensor_parallel_region
