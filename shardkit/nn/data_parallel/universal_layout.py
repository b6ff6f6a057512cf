"""Registers the data-parallel wrappers' universal-checkpoint adapters.

- :class:`FullyShardedDataParallel` (every sharding strategy, hybrid included):
  :class:`~shardkit.nn.data_parallel.fully_sharded.universal_layout.FSDPLayout`.
- :class:`ShardedDataParallel` (ZeRO-2): the parameters are whole on every rank and
  its :class:`~shardkit.optim.OSS` owns each, so it is OSS's layout
  (:class:`~shardkit.optim.universal_layout.OSSLayout`) over the inner module,
  reported as ``"sdp"``.
"""

from __future__ import annotations

from typing import Any

from shardkit.checkpoint.universal.layout import register_layout
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel
from shardkit.nn.data_parallel.fully_sharded.universal_layout import FSDPLayout
from shardkit.nn.data_parallel.sharded_ddp import ShardedDataParallel
from shardkit.optim.universal_layout import OSSLayout

__all__ = ["sdp_layout"]


def sdp_layout(model: ShardedDataParallel, optimizer: Any = None) -> OSSLayout:
    """The adapter of ``model`` stepped by ``optimizer`` (default: its only OSS).

    Raises:
        ValueError: ``optimizer`` is None and ``model`` has several sharded optimizers.
    """
    if optimizer is None:
        if len(model.sharded_optimizers) != 1:
            raise ValueError(
                f"ShardedDataParallel has {len(model.sharded_optimizers)} sharded "
                "optimizers; pass the one to checkpoint"
            )
        optimizer = model.sharded_optimizers[0]
    return OSSLayout(model, optimizer)


register_layout(FullyShardedDataParallel, FSDPLayout)
register_layout(ShardedDataParallel, sdp_layout)
