"""shardkit: composable PyTorch wrappers that shard training state across ranks.

Each wrapper takes ordinary torch objects and returns ordinary torch objects, so a
user adopts exactly the pieces needed: ``shardkit.optim`` (optimizer state sharding,
ZeRO-1), ``shardkit.nn`` (gradient and parameter sharding, pipeline, offload),
``shardkit.memory`` (bytes held per rank) and ``shardkit.testing`` (a multi-rank
test harness).
"""

from shardkit.version import __version__

__all__ = ["__version__"]
