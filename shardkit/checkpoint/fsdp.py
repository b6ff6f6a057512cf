"""Deprecated location of FSDP's sharded checkpoints (kept so old imports work).

``save_fsdp_sharded`` / ``load_fsdp_sharded`` are calls to the universal checkpoint
(:mod:`shardkit.checkpoint.universal`): import them from
:mod:`shardkit.nn.data_parallel.fully_sharded` (or ``shardkit.nn``). This module is the
one allowed import of a wrapper from ``shardkit.checkpoint`` (listed in the import
contracts); it goes when the import shims do.
"""

from shardkit.nn.data_parallel.fully_sharded.sharded_checkpoint import (
    fsdp_shard_path,
    load_fsdp_sharded,
    save_fsdp_sharded,
)

__all__ = ["fsdp_shard_path", "load_fsdp_sharded", "save_fsdp_sharded"]
