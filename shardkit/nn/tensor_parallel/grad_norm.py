"""Gradient clipping by the global norm of a tensor-parallel model.

A tensor-parallel shard's gradient is part of the full gradient: every rank's shard
counts. A replica's gradient (LayerNorm, row-parallel bias, position embedding) is the
same on every tensor-parallel rank: counted once, on tensor-parallel rank 0
(Megatron-LM's ``param_is_not_tensor_parallel_duplicate``). The partial sums are then
reduced over the tensor-parallel group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from shardkit.distributed.grad_norm import clip_grad_norm_sharded
from shardkit.nn.tensor_parallel.groups import TPGroup, rank_and_size, resolve_group
from shardkit.nn.tensor_parallel.partition import is_tensor_parallel

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    process_group: TPGroup = None,
) -> torch.Tensor:
    """Clip the gradients of a tensor-parallel model by the norm of the full model's.

    Equals ``torch.nn.utils.clip_grad_norm_`` on the unsplit model (same total norm,
    same clipped gradients, each rank clipping its own part). A collective over the
    tensor-parallel group (one all-reduce of one element).

    Args:
        parameters: this rank's parameters (shards and replicas; with the
            tensor-parallel attributes the layers set).
        max_norm: the largest allowed total norm.
        norm_type: ``p`` of the p-norm; ``float("inf")`` for the max norm. Default 2.
        process_group: the tensor-parallel group; default None (the mesh's).

    Returns:
        The total norm (0-d fp32) before clipping, the same on every rank.
    """
    group = resolve_group(process_group)
    params = [p for p in parameters if p.grad is not None]
    tp_rank, _ = rank_and_size(group)
    counted = [p for p in params if is_tensor_parallel(p) or tp_rank == 0]
    if math.isinf(norm_type):  # max is idempotent: replicas may all count
        counted = params
    total = clip_grad_norm_sharded(counted, math.inf, norm_type, group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        assert p.grad is not None
        p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
    return total
