"""Deprecated location of FSDP's sharded checkpoints (kept so old imports work).

The format belongs to FSDP: import ``save_fsdp_sharded``, ``load_fsdp_sharded``,
``fsdp_shard_path`` and ``FSDP_SHARD_FORMAT`` from
:mod:`shardkit.nn.data_parallel.fully_sharded.sharded_checkpoint` (the first two also
from ``shardkit.nn.data_parallel.fully_sharded``), ``read_flat_range`` from
:mod:`shardkit.checkpoint.flat`. The first name read from here raises one
``DeprecationWarning`` per process (:func:`shardkit.deprecation.moved_names`). The names
resolve lazily, so ``shardkit.checkpoint`` imports no wrapper; the module goes with the
universal checkpoint format.
"""

from shardkit.deprecation import moved_names

# each name this old path still serves -> the canonical module to import it from (a
# literal dict: tools/api_table.py reads it without importing)
_TARGETS = {
    "FSDP_SHARD_FORMAT": "shardkit.nn.data_parallel.fully_sharded.sharded_checkpoint",
    "fsdp_shard_path": "shardkit.nn.data_parallel.fully_sharded.sharded_checkpoint",
    "load_fsdp_sharded": "shardkit.nn.data_parallel.fully_sharded",
    "read_flat_range": "shardkit.checkpoint.flat",
    "save_fsdp_sharded": "shardkit.nn.data_parallel.fully_sharded",
}

__all__ = sorted(_TARGETS)

__getattr__ = moved_names(__name__, _TARGETS)
