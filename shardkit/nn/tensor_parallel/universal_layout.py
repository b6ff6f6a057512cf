"""The shard descriptors of tensor-parallel tensors: parts, replicas, Megatron's attributes.

A tensor-parallel layer keeps, on rank ``r`` of ``T``, the part
``shard(full, dim, r, T, stride)`` of the full tensor (:mod:`.partition`).
:func:`tensor_parallel_view` states that as a
:class:`~shardkit.distributed.shard_descriptor.TensorView` (with the group it is split
over), and :func:`record_view` records it on the parameter: the one description of the
split, which every universal-checkpoint adapter, FSDP's flattening, the state-dict
helpers and the gradient norm read. A tensor-parallel model thus saves each part under
the plain model's key, inside any data-parallel wrapper (DDP, OSS, FSDP), and loads at
any tensor-parallel degree (a plain model is degree 1).

[Note: Megatron's attributes]
Megatron-LM and DeepSpeed code reads three attributes of a tensor-parallel parameter:
``tensor_model_parallel`` (True), ``partition_dim`` and ``partition_stride``.
:func:`record_view` is the one place that sets them, derived from the descriptor it
records; nothing in shardkit reads them back (they are a view for that code).

A tensor every tensor-parallel rank holds whole (a LayerNorm weight, a row-parallel
bias, the position embedding) is a replica across the tensor-parallel group:
:func:`record_replica` records that group as its descriptor's replica group, so a
checkpoint writes it once (see ``[Note: who writes a replicated tensor]`` in
:mod:`shardkit.distributed.shard_descriptor`), with no process-wide mesh.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from shardkit.distributed.shard_descriptor import Ranks, TensorView, set_view, view_of

__all__ = ["record_replica", "record_view", "tensor_parallel_view"]


def tensor_parallel_view(
    local_shape: tuple[int, ...],
    dim: int,
    stride: int,
    rank: int,
    world_size: int,
    split_group: Ranks | None = None,
) -> TensorView:
    """The view of rank ``rank``'s part (shape ``local_shape``) of a tensor split along
    ``dim`` over ``world_size`` ranks with ``stride`` interleaved blocks.

    The full shape is ``local_shape`` with ``dim`` multiplied by ``world_size``.

    Args:
        split_group: the global ranks of the tensor-parallel group (sorted), or None
            when not known. Default None.

    Raises:
        ValueError: ``dim`` outside ``local_shape``, ``rank`` outside
            ``[0, world_size)``, ``local_shape[dim]`` not divisible by ``stride``, or a
            ``split_group`` of another size than ``world_size`` (values named).
    """
    if not 0 <= dim < len(local_shape):
        raise ValueError(f"partition_dim {dim} is not a dimension of shape {local_shape}")
    if not 0 <= rank < world_size:
        raise ValueError(f"tensor-parallel rank {rank} is not in [0, {world_size})")
    if stride < 1 or local_shape[dim] % stride:
        raise ValueError(
            f"size {local_shape[dim]} of dim {dim} is not divisible by partition_stride {stride}"
        )
    if split_group is not None and len(split_group) != world_size:
        raise ValueError(
            f"split group {split_group} has {len(split_group)} ranks, the tensor-parallel "
            f"degree is {world_size}: pass the group the tensor is split over"
        )
    full = list(local_shape)
    full[dim] *= world_size
    return TensorView(
        tuple(full),
        split_dim=dim,
        part=rank,
        parts=world_size,
        stride=stride,
        split_group=split_group,
        mesh_dim="tp",
    )


def record_view(param: torch.Tensor, view: TensorView) -> TensorView:
    """Record ``view`` on ``param`` as its shard descriptor and derive Megatron's
    attributes from it (see ``[Note: Megatron's attributes]``); return ``view``.

    Raises:
        ValueError: ``param``'s shape is not ``view.local_shape``, or ``view`` is not
            split (``split_dim`` None).
    """
    if view.split_dim is None:
        raise ValueError(f"{view} is not a tensor-parallel part (split_dim is None)")
    set_view(param, view)
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.partition_dim = view.split_dim  # type: ignore[attr-defined]
    param.partition_stride = view.stride  # type: ignore[attr-defined]
    return view


def record_replica(tensor: torch.Tensor, replicate_group: Ranks | None) -> TensorView:
    """Record that every rank of ``replicate_group`` (global ranks) holds ``tensor``
    whole, as identical copies; return its descriptor.

    A tensor already split (a tensor-parallel part) keeps its split and gets the replica
    group; None leaves the descriptor as it is.
    """
    view = view_of(tensor)
    if replicate_group is None:
        return view
    view = replace(view, replicate_group=tuple(sorted(replicate_group)))
    set_view(tensor, view)
    return view
