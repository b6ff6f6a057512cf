"""Sharded optimizers: :class:`OSS` shards the optimizer state across ranks (ZeRO stage 1)."""

from shardkit.optim.oss import OSS

__all__ = ["OSS"]
