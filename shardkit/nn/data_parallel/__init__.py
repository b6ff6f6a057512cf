"""Data-parallel wrappers: ShardedDataParallel (ZeRO-2) and FullyShardedDataParallel (ZeRO-3)."""

from shardkit.nn.data_parallel.sharded_ddp import ShardedDataParallel, ShardedDDP

__all__ = ["ShardedDDP", "ShardedDataParallel"]
