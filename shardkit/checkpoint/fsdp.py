"""Deprecated location of FSDP's sharded checkpoints (kept so old imports work).

The format belongs to FSDP: import from
:mod:`shardkit.nn.data_parallel.fully_sharded.sharded_checkpoint` (or ``shardkit.nn``).
This module is the one allowed import of a wrapper from ``shardkit.checkpoint``
(listed in the import contracts); it will be removed with the universal checkpoint.
"""

from shardkit.checkpoint.flat import read_flat_range
from shardkit.nn.data_parallel.fully_sharded.sharded_checkpoint import (
    FSDP_SHARD_FORMAT,
    fsdp_shard_path,
    load_fsdp_sharded,
    save_fsdp_sharded,
)

__all__ = [
    "FSDP_SHARD_FORMAT",
    "fsdp_shard_path",
    "load_fsdp_sharded",
    "read_flat_range",
    "save_fsdp_sharded",
]
