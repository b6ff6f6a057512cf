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

[Note: parts and copies outside the root's ranks]
A tensor-parallel model wrapped over the data-parallel group holds, on each rank of
``W``, one tensor-parallel rank's view of the model: a split parameter's part (its
descriptor's split group lies outside ``W``, meeting it in this rank alone) and the
copies the producer made (a LayerNorm weight, a row-parallel bias: the descriptor's
replica group, the tensor-parallel ranks). The sum over ``W`` is then this
tensor-parallel rank's norm, not the model's: each tensor-parallel rank clipped by its
own factor. So the norm is also summed over that outside group ``M`` (the split
group, found once among the process groups the modules hold: the tensor-parallel
layers keep theirs), and a producer's copy is counted only by the ``W`` that holds the
lowest rank of its replica group (tensor-parallel rank 0's, as Megatron-LM's
``param_is_not_tensor_parallel_duplicate``); the other ranks clip it uncounted. Every
element is then counted once over ``W x M``. The decision is per original parameter:
a unit's shard can mix parts and copies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.collectives import group_rank, group_ranks, group_size
from shardkit.distributed.grad_norm import held_outside
from shardkit.distributed.shard_descriptor import TensorView, writes_replica
from shardkit.nn.data_parallel.fully_sharded.unit import UnitRuntime

__all__ = ["NormScope", "counted_shards", "norm_scope"]


@dataclass(frozen=True)
class NormScope:
    """Where a root's global norm is summed. Its groups and units are fixed at
    construction, so the scope is found once (:func:`norm_scope`, a collective under
    hybrid sharding) and kept by the root.

    Attributes:
        world: the global ranks ``W`` of the root's data-parallel ranks (its shard
            group's, over every replica).
        groups: the process groups the partial sum is reduced over, in turn: the
            root's shard group, its replica group under hybrid sharding, and the
            tensor-parallel group of ``[Note: parts and copies outside the root's
            ranks]`` when the parameters are split over one.
    """

    world: frozenset[int]
    groups: tuple[dist.ProcessGroup | None, ...]


def _parts_inside(view: TensorView | None, world: frozenset[int]) -> int:
    """Distinct parts of a parameter held inside ``world`` (its splits over groups of
    ``world``'s ranks; splits over other ranks, or not recorded, count 1)."""
    if view is None or view.split_dim is None:
        return 1
    splits = [(view.parts, view.split_group)] + [(s.parts, s.group) for s in view.inner_splits]
    return math.prod(n for n, ranks in splits if ranks is not None and set(ranks) <= world)


def _root_ranks(
    shard_group: dist.ProcessGroup | None, replicate_group: dist.ProcessGroup | None
) -> frozenset[int]:
    """The global ranks of every shard group of the root's replicas (an all-gather of
    the shard group's ranks over the replica group under hybrid sharding)."""
    mine = torch.tensor(group_ranks(shard_group), dtype=torch.int64)
    if replicate_group is None or group_size(replicate_group) == 1:
        return frozenset(mine.tolist())
    every = torch.empty(group_size(replicate_group) * mine.numel(), dtype=torch.int64)
    dist.all_gather_into_tensor(every, mine, group=replicate_group)
    return frozenset(every.tolist())


def _outside_group(
    units: list[UnitRuntime], world: frozenset[int], modules: Iterable[nn.Module]
) -> dist.ProcessGroup | None:
    """The process group ``M`` of ``[Note: parts and copies outside the root's ranks]``
    (None: every part and copy is inside ``world``), taken from the groups ``modules``
    hold as attributes (a tensor-parallel layer's ``process_group``, an expert's
    ``tp_group``)."""
    found = held_outside((i.view for u in units for i in u.handle.infos if i.view), world)
    if not found:
        return None
    if len(found) > 1 or len(set(next(iter(found))) & world) != 1:
        raise ValueError(
            f"clip_grad_norm_: the parameters are split or copied over the groups of ranks "
            f"{sorted(list(r) for r in found)}, outside the root's data-parallel ranks "
            f"{sorted(world)}: the norm sums over one such group, meeting the "
            "data-parallel ranks in this rank alone (the tensor-parallel group); wrap "
            "the model over the data-parallel group of the mesh its layers were split on"
        )
    ranks = next(iter(found))
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, dist.ProcessGroup) and tuple(sorted(group_ranks(value))) == ranks:
                return value
    raise ValueError(
        f"clip_grad_norm_: parameters are split over (or copied on) ranks {list(ranks)} "
        f"outside the root's data-parallel ranks {sorted(world)}, but no module of the "
        "model holds a process group of those ranks to sum the norm over; build the "
        "tensor-parallel layers with their group (shardkit.nn.tensor_parallel keeps it "
        "as `process_group`)"
    )


def norm_scope(
    units: list[UnitRuntime],
    shard_group: dist.ProcessGroup | None,
    replicate_group: dist.ProcessGroup | None,
    modules: Iterable[nn.Module] = (),
) -> NormScope:
    """The scope of a root's global norm over its ``shard_group`` x ``replicate_group``,
    and the tensor-parallel group when the parameters are split over one (see ``[Note:
    counting every element once]`` and ``[Note: parts and copies outside the root's
    ranks]``). A collective over ``replicate_group`` when given (one all-gather).

    Args:
        units: every unit under the root.
        shard_group: the root's shard group (None: the world).
        replicate_group: the root's replica group under hybrid sharding, or None.
        modules: the modules whose process-group attributes may be the tensor-parallel
            group (the root's ``modules()``). Default none.

    Raises:
        ValueError: the parameters are split over ranks outside the root's in more
            than one way, or over ranks no module holds a process group of (the ranks
            named).
    """
    world = _root_ranks(shard_group, replicate_group)
    outside = _outside_group(units, world, modules)
    groups = (shard_group,) if replicate_group is None else (shard_group, replicate_group)
    return NormScope(world, groups if outside is None else (*groups, outside))


def counted_shards(
    units: list[UnitRuntime], scope: NormScope
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This rank's sharded parameters split into (counted, copies) for the global norm
    over ``scope`` (see ``[Note: counting every element once]`` and ``[Note: parts and
    copies outside the root's ranks]``): the copies are clipped by the same factor but
    counted by another rank. No collective.

    Raises:
        ValueError: a unit's shard has copies on ranks that are not its replica group
            (a unit over a subgroup of the root's ranks that is neither sharded over
            expert parts nor hybrid): the norm would count them several times. The
            message names the unit, the sizes and the fix.
    """
    world = scope.world
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
        for info, param in zip(unit.handle.infos, unit.handle.sharded_params, strict=True):
            own = info.view is None or writes_replica(info.view, world)
            (counted if first and own else copies).append(param)
    return counted, copies
