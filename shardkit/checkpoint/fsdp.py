"""Deprecated location of FSDP's sharded checkpoints (kept so old imports work).

``save_fsdp_sharded`` / ``load_fsdp_sharded`` are calls to the universal checkpoint
(:mod:`shardkit.checkpoint.universal`): import them from
:mod:`shardkit.nn.data_parallel.fully_sharded` (or ``shardkit.nn``). The first name
read from here raises one ``DeprecationWarning`` per process
(:func:`shardkit.deprecation.moved_names`). The names resolve lazily, so
``shardkit.checkpoint`` imports no wrapper.
"""

from shardkit.deprecation import moved_names

# each name this old path still serves -> the canonical module to import it from (a
# literal dict: tools/api_table.py reads it without importing)
_TARGETS = {
    "fsdp_shard_path": "shardkit.nn.data_parallel.fully_sharded.sharded_checkpoint",
    "load_fsdp_sharded": "shardkit.nn.data_parallel.fully_sharded",
    "save_fsdp_sharded": "shardkit.nn.data_parallel.fully_sharded",
}

__all__ = sorted(_TARGETS)

__getattr__ = moved_names(__name__, _TARGETS)
