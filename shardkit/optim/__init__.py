"""Sharded optimizers: :class:`OSS` shards the optimizer state across ranks (ZeRO stage 1);
:func:`reduce_to_owner_hook` makes torch DDP reduce each gradient to its OSS owner only;
:class:`WholeTensorOptimizer` steps FSDP's shards with optimizers that need whole
tensors (Muon, Adafactor, LAMB), each parameter on one owner rank."""

import shardkit.optim.universal_layout  # registers the universal-checkpoint adapter
import shardkit.optim.whole_tensor_layout  # noqa: F401 (registers the universal-checkpoint adapter)
from shardkit.optim.oss import OSS
from shardkit.optim.oss_comm_hook import reduce_to_owner_hook, register_reduce_to_owner_hook
from shardkit.optim.whole_tensor import WholeTensorOptimizer, needs_whole_tensors

__all__ = [
    "OSS",
    "WholeTensorOptimizer",
    "needs_whole_tensors",
    "reduce_to_owner_hook",
    "register_reduce_to_owner_hook",
]
