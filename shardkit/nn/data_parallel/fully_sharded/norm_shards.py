"""Which gradient shards this rank counts in the global gradient norm.

[Note: counting every element once]
``clip_grad_norm_`` sums ``|g|^p`` over the local shards of every unit, then over the
root's data-parallel ranks ``W`` (its shard group, then its replica group under hybrid
sharding). Each element must be counted by exactly one rank of ``W``. A unit's shard is
held by ``|W| / (S x P)`` ranks of ``W``, where ``S`` is the unit's shard-group size and
``P`` the number of distinct parts of its parameters inside ``W`` (``E / ep`` experts per
expert-parallel rank: ``P = ep`` for an expert unit over the expert-data-parallel group,
read from the parameters' shard descriptors). A unit whose copies are its declared
replicas (hybrid sharding) is counted on replica rank 0 only; a unit without copies is
counted everywhere. Counting over the root's shard group alone (the earlier rule) missed
the expert shards held by the other replicas (4.09 instead of 6.09 for an MoE under
hybrid sharding with ``ep = dp_shard``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shardkit.distributed.collectives import group_rank, group_ranks, group_size
from shardkit.distributed.shard_descriptor import TensorView
from shardkit.nn.data_parallel.fully_sharded.unit import UnitRuntime

__all__ = ["counted_shards"]


def _parts_inside(view: TensorView | None, world: set[int]) -> int:
    """Distinct parts of a parameter held inside ``world`` (its splits over groups of
    ``world``'s ranks; splits over other ranks, or not recorded, count 1)."""
    if view is None or view.split_dim is None:
        return 1
    splits = [(view.parts, view.split_group)] + [(s.parts, s.group) for s in view.inner_splits]
    return math.prod(n for n, ranks in splits if ranks is not None and set(ranks) <= world)


def _root_ranks(
    shard_group: dist.ProcessGroup | None, replicate_group: dist.ProcessGroup | None
) -> set[int]:
    """The global ranks of every shard group of the root's replicas (an all-gather of
    the shard group's ranks over the replica group under hybrid sharding)."""
    mine = torch.tensor(group_ranks(shard_group), dtype=torch.int64)
    if replicate_group is None or group_size(replicate_group) == 1:
        return set(mine.tolist())
    every = torch.empty(group_size(replicate_group) * mine.numel(), dtype=torch.int64)
    dist.all_gather_into_tensor(every, mine, group=replicate_group)
    return set(every.tolist())


def counted_shards(
    units: list[UnitRuntime],
    shard_group: dist.ProcessGroup | None,
    replicate_group: dist.ProcessGroup | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This rank's sharded parameters split into (counted, copies) for the global norm
    over the root's ``shard_group`` x ``replicate_group`` (see ``[Note: counting every
    element once]``). A collective over ``replicate_group`` when given.

    Raises:
        ValueError: a unit's shard has copies on ranks that are not its replica group
            (a unit over a subgroup of the root's ranks that is neither sharded over
            expert parts nor hybrid): the norm would count them several times. The
            message names the unit, the sizes and the fix.
    """
    world = _root_ranks(shard_group, replicate_group)
    counted: list[torch.Tensor] = []
    copies: list[torch.Tensor] = []
    for unit in units:
        parts = max((_parts_inside(i.view, world) for i in unit.handle.infos), default=1)
        holders = len(world) // (unit.world_size * parts)
        replicas = 1 if unit.replicate_group is None else group_size(unit.replicate_group)
        if holders != replicas:
            raise ValueError(
                f"clip_grad_norm_: {unit.label} shards over {unit.world_size} ranks with "
                f"{parts} distinct part(s) and {replicas} replica(s), but the root's "
                f"{len(world)} data-parallel ranks hold {holders} copies of each shard: "
                "the norm would count them more than once; shard the unit over the "
                "root's ranks, or give it the replica group (sharding_strategy="
                "'HYBRID_SHARD')"
            )
        first = unit.replicate_group is None or group_rank(unit.replicate_group) == 0
        (counted if first else copies).extend(unit.handle.sharded_params)
    return counted, copies
