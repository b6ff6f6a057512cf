"""The two process groups of hybrid sharding: shard inside a node, replicate across nodes.

``W = R x S`` ranks are split into R *shard groups* of S consecutive ranks (one node's
ranks under torchrun, whose ``LOCAL_WORLD_SIZE`` is S) and S *replica groups* of the
ranks holding the same shard in each shard group (ranks ``s, s + S, s + 2S, ...``).
Consecutive ranks share a shard group because torchrun numbers one node's ranks
consecutively: the frequent, large collectives (all-gather and reduce-scatter of every
unit) stay on the fast intra-node link, and only the 1/S gradient shard crosses nodes.

Source: torch FSDP's ``HYBRID_SHARD``; Zhang et al. 2022, "MiCS" (section 3);
Wang et al. 2023, "ZeRO++" (hpZ, section 3.2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from shardkit.distributed.mesh import ParallelDims, ProcessMesh

__all__ = ["HybridGroups", "hybrid_groups"]


@dataclass(frozen=True)
class HybridGroups:
    """This rank's shard group and replica group.

    Attributes:
        shard: the S ranks that shard each unit between them.
        replicate: the R ranks (one per shard group) that hold the same shard.
        shard_size: S.
        replicate_size: R.
    """

    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup
    shard_size: int
    replicate_size: int


_CACHE: dict[tuple[int, int], HybridGroups] = {}


def hybrid_groups(shard_size: int | None = None) -> HybridGroups:
    """The hybrid groups for shard groups of ``shard_size`` consecutive ranks: the
    ``dp_shard`` and ``dp_replicate`` groups of a :class:`~shardkit.distributed.mesh.ProcessMesh`
    (a collective the first time: every rank creates every group, in the same order;
    cached afterwards). With a mesh of your own, pass its groups to FSDP directly:
    ``process_group=(mesh.group("dp_shard"), mesh.group("dp_replicate"))``.

    Args:
        shard_size: S, ranks per shard group. Default None: torchrun's
            ``LOCAL_WORLD_SIZE`` (the ranks of one node), else the world size.

    Raises:
        RuntimeError: the default process group is not initialised.
        ValueError: S < 1, or the world size is not a multiple of S (the message gives
            the arithmetic).
    """
    if not dist.is_initialized():
        raise RuntimeError("hybrid_groups needs torch.distributed initialised first")
    world = dist.get_world_size()
    if shard_size is None:
        shard_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if shard_size < 1 or world % shard_size:
        raise ValueError(
            f"hybrid sharding splits the world into shard groups of {shard_size} ranks, but "
            f"the world size {world} is not a multiple of {shard_size} "
            f"({world} = replicas x {shard_size} has no integer solution); pass a shard "
            "size that divides the world size (ranks per node)"
        )
    key = (world, shard_size)
    if key not in _CACHE:
        _CACHE[key] = _build(world, shard_size)
    return _CACHE[key]


def _build(world: int, shard_size: int) -> HybridGroups:
    """The groups of a ``dp_replicate x dp_shard`` process mesh (its own layout: the
    shard dimension inner, so a shard group is consecutive ranks)."""
    mesh = ProcessMesh(ParallelDims(world, dp_replicate=world // shard_size, dp_shard=shard_size))
    return HybridGroups(
        mesh.group("dp_shard"), mesh.group("dp_replicate"), shard_size, world // shard_size
    )
