"""The all-to-all of Ulysses: a tensor split on one dimension becomes split on another.

Each rank of a context-parallel group holds a contiguous slice of the sequence and all
the heads; one all-to-all (:func:`shardkit.distributed.all_to_all.all_to_all`) gives it
all the sequence and a slice of the heads (``scatter_idx`` cut into ``cp`` parts, one per rank, and the parts
received concatenated along ``gather_idx`` in rank order). The backward of that
exchange is the same exchange with the two dimensions swapped (Jacobs et al. 2023,
DeepSpeed-Ulysses, section 3.1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardkit.distributed.all_to_all import all_to_all

__all__ = ["sequence_all_to_all"]


def sequence_all_to_all(
    x: torch.Tensor, group: dist.ProcessGroup, scatter_idx: int, gather_idx: int
) -> torch.Tensor:
    """Split ``x`` on ``scatter_idx`` over the ranks of ``group`` and gather the parts
    every rank sends on ``gather_idx``; differentiable.

    Example: ``(s/P, b, h, d) -> (s, b, h/P, d)`` with ``scatter_idx=2, gather_idx=0``.

    Args:
        x: any shape; ``x.shape[scatter_idx]`` divisible by the group size ``P``.
        group: the context-parallel process group.
        scatter_idx: the dimension cut into ``P`` equal parts (part ``r`` to rank ``r``).
        gather_idx: the dimension the received parts are concatenated on (rank order).

    Returns:
        ``x`` with ``shape[scatter_idx] / P`` and ``shape[gather_idx] x P``.

    Raises:
        ValueError: ``x.shape[scatter_idx]`` not divisible by ``P``, naming both.
    """
    world = dist.get_world_size(group)
    if x.shape[scatter_idx] % world != 0:
        raise ValueError(
            f"dimension {scatter_idx} of size {x.shape[scatter_idx]} cannot be split over "
            f"{world} context-parallel ranks; make it a multiple of {world}"
        )
    if world == 1:
        return x
    # part r of scatter_idx -> rank r: the parts stacked on a new dim 0 are the rows of
    # an equal-split exchange (its backward is the same exchange: autograd through
    # stack / cat gives the swapped dimensions of the reverse all-to-all).
    received = all_to_all(torch.stack(x.chunk(world, dim=scatter_idx)), group)
    return torch.cat(received.unbind(0), dim=gather_idx)
