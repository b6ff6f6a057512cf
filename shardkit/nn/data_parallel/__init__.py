"""Data-parallel wrappers: ShardedDataParallel (ZeRO-2) and FullyShardedDataParallel (ZeRO-3)."""

import shardkit.nn.data_parallel.universal_layout  # noqa: F401 (registers the universal-checkpoint adapter)
from shardkit.nn.data_parallel.fully_sharded import FSDP, FullyShardedDataParallel
from shardkit.nn.data_parallel.sharded_ddp import ShardedDataParallel, ShardedDDP

__all__ = ["FSDP", "FullyShardedDataParallel", "ShardedDDP", "ShardedDataParallel"]
