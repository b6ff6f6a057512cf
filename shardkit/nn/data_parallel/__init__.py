"""Data-parallel wrappers: ShardedDataParallel (ZeRO-2) and FullyShardedDataParallel (ZeRO-3)."""

from shardkit.nn.data_parallel.fully_sharded import FSDP, FullyShardedDataParallel
from shardkit.nn.data_parallel.sharded_ddp import ShardedDataParallel, ShardedDDP

__all__ = ["FSDP", "FullyShardedDataParallel", "ShardedDDP", "ShardedDataParallel"]
