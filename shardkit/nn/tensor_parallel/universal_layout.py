"""Tensor-parallel parts in the universal checkpoint: the :class:`TensorView` of a part.

A tensor-parallel layer keeps, on rank ``r`` of ``T``, the part
``shard(full, partition_dim, r, T, partition_stride)`` of the full tensor
(:mod:`.partition`). :func:`tensor_parallel_view` states that as a
:class:`~shardkit.checkpoint.universal.layout.TensorView`, and
:func:`~.partition.mark_tensor_parallel` records it on the parameter
(:func:`shardkit.checkpoint.universal.tensor_views.set_view`), where every
universal-checkpoint adapter reads it: a tensor-parallel model saves each part under
the plain model's key, inside any data-parallel wrapper (DDP, OSS, FSDP), and loads at
any tensor-parallel degree (a plain model is degree 1).
"""

from __future__ import annotations

import torch

from shardkit.checkpoint.universal.layout import TensorView
from shardkit.checkpoint.universal.tensor_views import set_view

__all__ = ["record_view", "tensor_parallel_view"]


def tensor_parallel_view(
    local_shape: tuple[int, ...], dim: int, stride: int, rank: int, world_size: int
) -> TensorView:
    """The view of rank ``rank``'s part (shape ``local_shape``) of a tensor split along
    ``dim`` over ``world_size`` ranks with ``stride`` interleaved blocks.

    The full shape is ``local_shape`` with ``dim`` multiplied by ``world_size``.

    Raises:
        ValueError: ``dim`` outside ``local_shape``, ``rank`` outside
            ``[0, world_size)``, or ``local_shape[dim]`` not divisible by ``stride``
            (values named).
    """
    if not 0 <= dim < len(local_shape):
        raise ValueError(f"partition_dim {dim} is not a dimension of shape {local_shape}")
    if not 0 <= rank < world_size:
        raise ValueError(f"tensor-parallel rank {rank} is not in [0, {world_size})")
    if stride < 1 or local_shape[dim] % stride:
        raise ValueError(
            f"size {local_shape[dim]} of dim {dim} is not divisible by partition_stride {stride}"
        )
    full = list(local_shape)
    full[dim] *= world_size
    return TensorView(tuple(full), split_dim=dim, part=rank, parts=world_size, stride=stride)


def record_view(param: torch.Tensor, rank: int, world_size: int) -> TensorView:
    """Record on ``param`` (marked tensor-parallel: ``partition_dim``,
    ``partition_stride``) that it is part ``rank`` of ``world_size``; return the view."""
    view = tensor_parallel_view(
        tuple(param.shape),
        int(param.partition_dim),  # type: ignore[attr-defined]
        int(param.partition_stride),  # type: ignore[attr-defined]
        rank,
        world_size,
    )
    set_view(param, view)
    return view
