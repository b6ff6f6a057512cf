"""Rank workers of test_fsdp_policies: which shard store and reducer each unit gets."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.hybrid import hybrid_groups
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel.fully_sharded.disk_tier import DiskOffload
from shardkit.nn.data_parallel.fully_sharded.unit import units_in


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _picked(model: FSDP) -> list[dict[str, Any]]:
    return [
        {
            "store": type(u.store).__name__,
            "reducer": type(u.reducer).__name__,
            "compress_scatter": getattr(u.reducer, "compress_scatter", None),
            "replicas": u.reducer.replicate_group is not None,
            "has_disk_attribute": hasattr(u, "disk"),
        }
        for u in units_in(model)
    ]


def policies_picked(directory: str) -> dict[str, list[dict[str, Any]]]:
    """The store and reducer of the root unit and a nested unit, per option set."""
    out: dict[str, list[dict[str, Any]]] = {}

    def nested(**kwargs: Any) -> FSDP:
        model = _model()
        model[0] = FSDP(model[0], **kwargs)
        return FSDP(model, **kwargs)

    out["plain"] = _picked(nested())
    out["bf16"] = _picked(nested(grad_compression="bf16"))
    groups = hybrid_groups(1)  # shard groups of 1 rank, replicas across the 2 ranks
    pair = (groups.shard, groups.replicate)
    out["hybrid"] = _picked(nested(sharding_strategy="HYBRID_SHARD", process_group=pair))
    out["hybrid-bf16"] = _picked(
        nested(sharding_strategy="HYBRID_SHARD", process_group=pair, grad_compression="bf16")
    )
    disk = DiskOffload(f"{directory}/disk")
    out["disk"] = _picked(nested(disk_offload=disk))
    disk.close()
    dist.barrier()
    return out
