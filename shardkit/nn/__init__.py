"""Module wrappers: gradient and parameter sharding, wrapping policies, pipeline, offload.

Each wrapper is imported here as it lands; ``__all__`` lists the public names.
"""

from shardkit.nn.checkpoint import checkpoint_wrapper

__all__ = ["checkpoint_wrapper"]
