"""Gradient clipping by the global norm of a tensor-parallel model.

A tensor-parallel shard's gradient is part of the full gradient: every rank's shard
counts. A replica's gradient (LayerNorm, row-parallel bias, position embedding) is the
same on every tensor-parallel rank: counted once, on tensor-parallel rank 0
(Megatron-LM's ``param_is_not_tensor_parallel_duplicate``). The partial results are
reduced over the tensor-parallel group, then, when each data-parallel rank passes only
the parameters it owns (OSS / ShardedDDP: ``optimizer.local_params()``), over the
data-parallel group too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from shardkit.distributed.grad_norm import clip_grad_norm_sharded
from shardkit.nn.tensor_parallel.groups import TPGroup, rank_and_size, resolve_group
from shardkit.nn.tensor_parallel.partition import is_tensor_parallel

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    process_group: TPGroup = None,
    *,
    shard_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip the gradients of a tensor-parallel model by the norm of the full model's.

    Equals ``torch.nn.utils.clip_grad_norm_`` on the unsplit model (same total norm,
    same clipped gradients, each rank clipping its own part). A collective over the
    tensor-parallel group (and ``shard_group``): one all-reduce of one element each.

    Example (tensor parallel x ShardedDDP / OSS)::

        loss.backward()
        tp.clip_grad_norm_(oss.local_params(), 1.0, process_group=mesh.group("tp"),
                           shard_group=mesh.group("dp"))
        oss.step()

    Args:
        parameters: this rank's parameters (shards and replicas, with the
            tensor-parallel attributes the layers set). With ``shard_group``, only
            those whose gradients this rank owns, disjoint across ``shard_group``.
        max_norm: the largest allowed total norm.
        norm_type: ``p`` of the p-norm; ``float("inf")`` for the max norm. Default 2.
        process_group: the tensor-parallel group; default None (the mesh's).
        shard_group: the data-parallel group over which ``parameters`` are disjoint
            (OSS's group); default None (every data-parallel rank holds every gradient,
            as under DDP: no reduction over it).

    Returns:
        The total norm (0-d fp32) before clipping, the same on every rank.
    """
    group = resolve_group(process_group)
    norm_type = float(norm_type)
    params = [p for p in parameters if p.grad is not None]
    tp_rank, _ = rank_and_size(group)
    counted = [p for p in params if is_tensor_parallel(p) or tp_rank == 0]
    if math.isinf(norm_type):  # max is idempotent: replicas may all count
        counted = params
    total = clip_grad_norm_sharded(counted, math.inf, norm_type, group)  # no clipping
    if shard_group is not None and dist.get_world_size(shard_group) > 1:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=shard_group)
        else:
            total = total**norm_type
            dist.all_reduce(total, group=shard_group)
            total = total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        assert p.grad is not None
        p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
    return total
