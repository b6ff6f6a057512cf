"""Sharded optimizers: :class:`OSS` shards the optimizer state across ranks (ZeRO stage 1);
:func:`reduce_to_owner_hook` makes torch DDP reduce each gradient to its OSS owner only."""

import shardkit.optim.universal_layout  # noqa: F401 (registers the universal-checkpoint adapter)
from shardkit.optim.oss import OSS
from shardkit.optim.oss_comm_hook import reduce_to_owner_hook, register_reduce_to_owner_hook

__all__ = ["OSS", "reduce_to_owner_hook", "register_reduce_to_owner_hook"]
