"""Gradient norm and clipping over parameters sharded across ranks.

Each rank holds the gradients of its own shard (or, under DDP, all gradients, of which
it only needs its shard). The global norm is reduced from per-rank partial results:
``sum |g|^p`` over the shard for a finite ``p`` (summed across ranks), or ``max |g|``
for ``p = inf`` (maximum across ranks), so the result equals
``torch.nn.utils.clip_grad_norm_`` over the whole unsharded model.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence

import torch
import torch.distributed as dist

from shardkit.distributed.shard_descriptor import Ranks, TensorView

__all__ = ["clip_grad_norm_sharded", "held_outside"]


def held_outside(views: Iterable[TensorView], world: Collection[int]) -> set[Ranks]:
    """The groups of ranks outside ``world`` that hold other parts or copies of the
    tensors ``views`` describe: a split's group not inside ``world`` (a tensor-parallel
    part), and a replica group meeting ``world`` in this rank alone (a tensor-parallel
    copy). A norm summed over ``world`` alone misses (or repeats) them: each such group
    must be summed over too, each copy counted once. Empty for tensors held whole, or
    split and copied inside ``world`` only. No collective.

    Args:
        views: the tensors' shard descriptors.
        world: the global ranks the caller sums the norm over.
    """
    me = dist.get_rank() if dist.is_initialized() else 0
    inside = set(world)
    found: set[Ranks] = set()
    for view in views:
        found.update(
            s.group for s in view.splits if s.group is not None and not set(s.group) <= inside
        )
        copies = view.replicate_group
        if copies and not set(copies) <= inside and set(copies) & inside == {me}:
            found.add(copies)
    return found


def _local_partial(grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """``max |g|`` (inf norm) or ``sum |g|^p`` over this rank's gradients, as fp32.

    Empty gradients (a rank holding no element of a parameter) contribute nothing: the
    inf norm of an empty tensor is undefined in torch (no identity for max), and 0 is
    the identity of both reductions over non-negative values.
    """
    grads = [g for g in grads if g.numel() > 0]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type) for g in grads])
    norms = norms.float()
    if math.isinf(norm_type):
        return norms.max()
    return torch.linalg.vector_norm(norms, norm_type) ** norm_type


def clip_grad_norm_sharded(
    local_params: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    group: dist.ProcessGroup | Sequence[dist.ProcessGroup | None] | None = None,
    *,
    copies: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """Clip the gradients of ``local_params`` by the norm over all ranks' shards.

    A collective over ``group`` (one all-reduce of one element per group). Every rank
    passes its own, disjoint shard; ``clip_coef = max_norm / (total_norm + 1e-6)``,
    clamped to 1, multiplies each local gradient in place, as torch does.

    Args:
        local_params: this rank's parameters whose gradients the norm counts (those
            without ``.grad`` are skipped); disjoint across the ranks of ``group``.
        max_norm: the largest allowed total norm.
        norm_type: ``p`` of the p-norm; ``float("inf")`` for the max norm. Default 2.
        group: the process group; default None (world). A sequence of groups reduces
            over each in turn (a shard group, then its replica group: the sum over
            their product), for shards whose copies are left out of ``local_params``
            on all but one rank of the replica group.
        copies: parameters clipped by the same coefficient but not counted here (a
            copy whose gradient another rank counts). Default none.

    Returns:
        The total norm over all ranks (a 0-d fp32 tensor on the gradients' device),
        before clipping.
    """
    norm_type = float(norm_type)
    grads = [p.grad for p in local_params if p.grad is not None]
    every = [*local_params, *copies]
    device = every[0].device if every else torch.device("cpu")
    partial = _local_partial(grads, norm_type).to(device)
    groups = list(group) if isinstance(group, Sequence) else [group]
    for each in groups:
        if dist.is_initialized() and dist.get_world_size(each) > 1:
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            dist.all_reduce(partial, op=op, group=each)
    total = partial if math.isinf(norm_type) else partial ** (1.0 / norm_type)
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads + [p.grad for p in copies if p.grad is not None]:
        g.mul_(clip_coef.to(g.device, g.dtype))
    return total
