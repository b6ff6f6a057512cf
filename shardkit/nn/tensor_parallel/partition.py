"""Splitting a full (master) tensor into tensor-parallel shards, and gathering it back.

A tensor-parallel parameter carries one description of its split, its shard
descriptor (:class:`shardkit.distributed.shard_descriptor.TensorView`: full shape,
split dimension, part, parts, stride, the group it is split over), which is all
another wrapper or a checkpoint needs to know about it; :func:`mark_tensor_parallel`
records it. Megatron-LM's attributes, for Megatron and DeepSpeed code, are derived
from it at the same place (:func:`~.universal_layout.record_view`):

- ``tensor_model_parallel`` (bool): this tensor is one rank's shard, not a replica;
- ``partition_dim`` (int): the dimension split across the tensor-parallel ranks;
- ``partition_stride`` (int): the number of interleaved blocks (see :func:`shard`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardkit.distributed.shard_descriptor import Split, TensorView, ranks_of, view_of
from shardkit.nn.tensor_parallel.groups import rank_and_size
from shardkit.nn.tensor_parallel.universal_layout import record_view, tensor_parallel_view

__all__ = [
    "divide",
    "full_tensor",
    "is_tensor_parallel",
    "mark_tensor_parallel",
    "merge_shards",
    "shard",
    "split_of",
]


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator``, which must be exact.

    Raises:
        ValueError: naming ``what``, both sizes and the remainder.
    """
    if numerator % denominator != 0:
        raise ValueError(
            f"{what}: {numerator} is not divisible by the tensor-parallel degree x stride "
            f"{denominator} (remainder {numerator % denominator}); choose a degree that "
            f"divides {numerator}"
        )
    return numerator // denominator


def shard(
    full: torch.Tensor, dim: int, rank: int, world_size: int, stride: int = 1
) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` along ``dim`` (a contiguous copy).

    With ``stride`` s, ``full`` is cut along ``dim`` into ``s x world_size`` equal blocks
    and rank r takes blocks ``r, r + world_size, ...``: for a fused ``[q | k | v]``
    projection (``stride=3``) each rank gets its own part of each of q, k and v.

    Shapes: ``full`` ``(..., n, ...)`` -> ``(..., n / world_size, ...)``.

    Raises:
        ValueError: ``n`` is not divisible by ``world_size x stride`` (sizes named).
    """
    block = divide(full.shape[dim], world_size * stride, f"size {full.shape[dim]} of dim {dim}")
    if block == 0:  # an empty tensor: every rank holds an empty shard
        return full.narrow(dim, 0, 0).clone()
    blocks = torch.split(full, block, dim=dim)
    return torch.cat(blocks[rank::world_size], dim=dim).contiguous()


def full_tensor(
    local: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup | None,
    stride: int = 1,
) -> torch.Tensor:
    """The inverse of :func:`shard`: all-gather every rank's shard and re-interleave.

    A collective over ``group`` (None: one rank, ``local`` is returned as a copy).
    Shapes: ``(..., n / world_size, ...)`` -> ``(..., n, ...)``.
    """
    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    return merge_shards(parts, dim, stride)


def merge_shards(parts: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """The full tensor from every rank's :func:`shard` (rank order), without communication.

    ``merge_shards([shard(x, dim, r, T, s) for r in range(T)], dim, s)`` equals ``x``.
    """
    world = len(parts)
    per_rank = [torch.chunk(p, stride, dim=dim) if p.shape[dim] else [p] * stride for p in parts]
    return torch.cat([per_rank[r][s] for s in range(stride) for r in range(world)], dim=dim)


def mark_tensor_parallel(
    param: torch.Tensor,
    dim: int,
    stride: int = 1,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> TensorView:
    """Record on ``param`` that it is this rank's part of a tensor split along ``dim``
    with ``stride`` interleaved blocks: its shard descriptor, and Megatron's three
    attributes derived from it (see the module docstring).

    Args:
        param: the local part, shape ``full.shape`` with ``dim`` divided by the degree.
        dim: the split dimension (``partition_dim``).
        stride: interleaved blocks per part (``partition_stride``). Default 1.
        rank: this rank's index in the tensor-parallel group. Default None: from
            ``group``.
        world_size: the tensor-parallel degree. Default None: from ``group``.
        group: the tensor-parallel process group (its global ranks are recorded as the
            descriptor's split group). Default None: not recorded; ``rank`` and
            ``world_size`` default to 0 and 1.

    Returns:
        The descriptor recorded.

    Raises:
        ValueError: ``dim``, ``rank`` or ``stride`` do not fit ``param``'s shape (see
            :func:`~.universal_layout.tensor_parallel_view`).
    """
    own_rank, own_size = rank_and_size(group)
    view = tensor_parallel_view(
        tuple(param.shape),
        dim,
        stride,
        own_rank if rank is None else rank,
        own_size if world_size is None else world_size,
        split_group=ranks_of(group) if group is not None else None,
    )
    return record_view(param, view)


def _tensor_parallel_split(view: TensorView) -> Split | None:
    """The view's split over the tensor-parallel mesh dimension (an unrecorded one
    counts: see ``[Note: the mesh dimension of a split]`` in the shard descriptor's
    module; the first of them for a view of several splits), or None."""
    return next((s for s in view.splits if s.mesh_dim in (None, "tp")), None)


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` is a tensor-parallel shard, from its shard descriptor: False for
    a replica on every rank and for a split over another mesh dimension (an MoE layer's
    experts, split over ``ep``; True for experts split over ``ep`` and ``tp``)."""
    return _tensor_parallel_split(view_of(param)) is not None


def split_of(param: torch.Tensor) -> tuple[int, int]:
    """``(split dimension, stride)`` of a tensor-parallel part, from its shard descriptor.

    Raises:
        ValueError: ``param`` is not a tensor-parallel part (its shape and the mesh
            dimension of its split named).
    """
    view = view_of(param)
    split = _tensor_parallel_split(view)
    if split is None:
        over = f" (it is split over {view.mesh_dim!r})" if view.split_dim is not None else ""
        raise ValueError(
            f"a tensor of shape {tuple(param.shape)} is not a tensor-parallel part{over}: "
            "mark it with mark_tensor_parallel first"
        )
    return split.dim, split.stride
