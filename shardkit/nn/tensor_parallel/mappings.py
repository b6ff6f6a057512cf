"""The autograd operators at the borders of a tensor-parallel region.

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
operator is the identity and issues no collective. ``copy`` and ``reduce`` are
:mod:`shardkit.distributed.all_reduce`'s (shared with tensor parallel inside experts),
called here with the layer's group resolved.

[Note: sequence-parallel regions]
Megatron-LM's sequence parallelism (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4.2.2) keeps the activations
*between* tensor-parallel regions (LayerNorm, dropout, the residual stream) split along
the sequence dimension instead of replicated. Three operators replace ``f`` and ``g``
(``dim`` is the sequence dimension, 1 for ``(batch, sequence, features)``; ``s`` the
full length, ``T`` the degree):

| operator | forward | backward |
|---|---|---|
| :func:`scatter_to_sequence_parallel_region` | keep own ``s / T`` chunk | all-gather ``dim`` |
| :func:`gather_from_sequence_parallel_region` | all-gather ``dim`` | reduce-scatter ``dim`` |
| :func:`reduce_scatter_to_sequence_parallel_region` | reduce-scatter ``dim`` | all-gather ``dim`` |

``gather`` enters a tensor-parallel region (before a column-parallel layer: each rank
contributes a partial gradient of the whole input, summed and split back by the
reduce-scatter); ``reduce_scatter`` leaves it (after a row-parallel layer), replacing
``g``'s all-reduce; ``scatter`` splits a replicated activation (the embedding output).
An all-reduce of ``n`` elements moves what an all-gather plus a reduce-scatter of ``n``
move (``2 (T - 1) / T x n`` per rank in a ring), so a layer costs the same bytes as
without sequence parallelism. The shards are contiguous chunks in rank order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardkit.distributed.all_reduce import copy_to_region, reduce_from_region
from shardkit.distributed.sequence_split import (
    gather_sequence,
    reduce_scatter_sequence,
    split_sequence,
)
from shardkit.nn.tensor_parallel.groups import TPGroup, rank_and_size, resolve_group

__all__ = [
    "SEQUENCE_DIM",
    "copy_to_model_parallel_region",
    "copy_to_tensor_parallel_region",
    "gather_from_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "reduce_from_model_parallel_region",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
]

#: The sequence dimension of the sequence-parallel operators by default:
#: activations are ``(batch, sequence, features)`` (torch's ``SequenceParallel`` default;
#: Megatron-LM's own layout is sequence-first, ``dim=0``).
SEQUENCE_DIM = 1


def _split_last(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    rank, world = rank_and_size(group)
    size = x.shape[-1]
    if size % world != 0:
        raise ValueError(
            f"last dimension {size} is not divisible by the tensor-parallel degree {world}"
        )
    return x if world == 1 else x.chunk(world, dim=-1)[rank].contiguous()


def _gather_last(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    world = rank_and_size(group)[1]
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


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
    return copy_to_region(x, resolve_group(group))


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: TPGroup = None) -> torch.Tensor:
    """All-reduce (sum) over ``group`` in forward; identity in backward (Megatron-LM's ``g``)."""
    return reduce_from_region(x, resolve_group(group))


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


def scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: TPGroup = None, dim: int = SEQUENCE_DIM
) -> torch.Tensor:
    """This rank's contiguous chunk of the sequence dimension in forward (``(b, s, h)`` ->
    ``(b, s / T, h)``); all-gather of the gradient in backward. Enters the
    sequence-parallel region from a replicated activation (``[Note: sequence-parallel
    regions]``).

    Args:
        x: the same tensor on every rank of ``group``.
        group: the tensor-parallel group; default None (see
            :func:`~shardkit.nn.tensor_parallel.groups.resolve_group`).
        dim: the sequence dimension. Default 1.

    Raises:
        ValueError: the sequence length is not divisible by the degree ``T`` (both named).
    """
    return split_sequence(x, resolve_group(group), dim)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: TPGroup = None, dim: int = SEQUENCE_DIM
) -> torch.Tensor:
    """All-gather of the sequence dimension in forward (``(b, s / T, h)`` -> ``(b, s, h)``,
    rank order); reduce-scatter (sum) of the gradient in backward, for a tensor-parallel
    consumer such as a column-parallel layer (Megatron-LM's
    ``gather_from_sequence_parallel_region`` with ``tensor_parallel_output_grad=True``).

    Every rank's ``x`` must have the same shape.

    Args:
        x: this rank's sequence chunk.
        group: the tensor-parallel group; default None (the mesh's).
        dim: the sequence dimension. Default 1.
    """
    return gather_sequence(x, resolve_group(group), dim)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: TPGroup = None, dim: int = SEQUENCE_DIM
) -> torch.Tensor:
    """Sum over ``group`` of this rank's chunk of the sequence dimension in forward
    (``(b, s, h)`` partial sums -> ``(b, s / T, h)``; it replaces the all-reduce after a
    row-parallel layer); all-gather of the gradient in backward.

    Args:
        x: this rank's partial sum, the full sequence.
        group: the tensor-parallel group; default None (the mesh's).
        dim: the sequence dimension. Default 1.

    Raises:
        ValueError: the sequence length is not divisible by the degree ``T`` (both named).
    """
    return reduce_scatter_sequence(x, resolve_group(group), dim)


# FairScale's names
copy_to_model_parallel_region = copy_to_tensor_parallel_region
reduce_from_model_parallel_region = reduce_from_tensor_parallel_region
scatter_to_model_parallel_region = scatter_to_tensor_parallel_region
gather_from_model_parallel_region = gather_from_tensor_parallel_region
