"""Data-parallel wrappers: ShardedDataParallel (ZeRO-2) and FullyShardedDataParallel (ZeRO-3)."""

__all__: list[str] = []
