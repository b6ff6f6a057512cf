"""OSS in the universal checkpoint: every rank holds every parameter, one rank owns each.

With :class:`~shardkit.optim.OSS` (ZeRO-1; also under
``shardkit.nn.ShardedDataParallel``, ZeRO-2) every rank of the group holds every
parameter whole, and the local optimizer ``OSS.optim`` holds the state of the
parameters this rank owns (``OSS.param_to_rank``). So each tensor is one entry, whole:

- a trainable parameter is written by its owner, with its optimizer state; on the
  other ranks the entry has ``param=None``, so loading fills the parameter but
  creates no optimizer state there, and the owner's ``OSS.state`` (its local
  optimizer's) receives the state. A checkpoint saved by any strategy thus loads its
  optimizer state onto the current owners;
- a frozen parameter (no owner) and a persistent buffer are written by rank 0 of the
  group;
- a tensor-parallel part (a model with tensor-parallel layers inside each OSS group)
  is written by its owner in each tensor-parallel rank's group; a tensor that every
  tensor-parallel rank holds whole (its shard descriptor's replica group) only by the
  OSS group holding the replica group's lowest rank
  (:func:`~shardkit.distributed.shard_descriptor.writes_replica`).

Every rank reads every parameter at load time, so no broadcast follows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.checkpoint.universal.adapters import tied_aliases
from shardkit.checkpoint.universal.layout import ParamEntry, register_layout, strategy_name
from shardkit.checkpoint.universal.whole import whole_entries
from shardkit.distributed.shard_descriptor import ranks_of, view_of
from shardkit.optim.oss import OSS

__all__ = ["OSSLayout"]


class OSSLayout:
    """The universal-checkpoint adapter of a model stepped by an :class:`OSS`.

    Args:
        model: the module; a torch ``DistributedDataParallel`` or a
            ``shardkit.nn.ShardedDataParallel`` (known by its ``sharded_optimizers``,
            since ``shardkit.optim`` does not import ``shardkit.nn``) is unwrapped: keys
            have no ``module.``.
        optimizer: the ``OSS`` stepping ``model``'s parameters.
        base: the strategy name; default ``"oss"`` (``"sdp"`` under ShardedDataParallel).

    Raises:
        TypeError: ``optimizer`` is not an ``OSS``.
    """

    def __init__(self, model: nn.Module, optimizer: Any, base: str = "oss") -> None:
        if not isinstance(optimizer, OSS):
            raise TypeError(f"OSSLayout needs an OSS optimizer; got {type(optimizer).__name__}")
        if hasattr(model, "sharded_optimizers"):  # ShardedDataParallel (shardkit.nn)
            base = "sdp"
        wrapped = isinstance(model, DistributedDataParallel) or base == "sdp"
        self.model: nn.Module = model.module if wrapped else model  # type: ignore[assignment]
        self.optimizer = optimizer
        self.strategy = strategy_name(base, (view_of(p) for p in self.model.parameters()))

    def entries(self) -> Iterator[ParamEntry]:
        """One whole-tensor entry per parameter and persistent buffer (see the module)."""
        owners, rank = self.optimizer.param_to_rank, self.optimizer.rank
        owned = {id(p) for p, r in owners.items() if r == rank}

        def writes(tensor: torch.Tensor, is_param: bool) -> bool:
            owner = owners.get(tensor) if is_param else None
            return owner == rank if owner is not None else rank == 0

        return whole_entries(self.model, owned, writes, holders=ranks_of(self.optimizer.group))

    def aliases(self) -> dict[str, str]:
        """Tied keys, ``{other key: first key}``, for the manifest."""
        return tied_aliases(self.model)

    def after_load(self) -> None:
        """Drop the consolidated state cached by ``consolidate_state_dict`` (stale now)."""
        self.optimizer._consolidated = None


def _layout(model: Any, optimizer: Any) -> OSSLayout:
    return OSSLayout(model, optimizer)


register_layout(OSS, _layout)
