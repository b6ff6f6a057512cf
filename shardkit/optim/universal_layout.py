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

Without a model (``save_universal(root, step, None, oss)``, what
:meth:`OSS.save_sharded` calls) the keys are ``"params.<i>"``, ``i`` the parameter's
index in a plain ``torch.optim`` state dict (its position in the concatenated param
groups), and the parameters are saved with their state; loading without a model
restores the optimizer state and hyperparameters only (the saved parameter values are
read into scratch tensors and dropped: the model is loaded on its own).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.checkpoint.universal.adapters import tied_aliases
from shardkit.checkpoint.universal.layout import (
    ParamEntry,
    Purpose,
    register_layout,
    strategy_name,
)
from shardkit.checkpoint.universal.optim_state import optimizer_param_key
from shardkit.checkpoint.universal.whole import whole_entries
from shardkit.distributed.shard_descriptor import ranks_of, view_of, writes_replica
from shardkit.optim.oss import OSS

__all__ = ["OSSLayout"]


class OSSLayout:
    """The universal-checkpoint adapter of a model stepped by an :class:`OSS`.

    Args:
        model: the module, or None (the optimizer's parameters under
            :func:`~shardkit.checkpoint.universal.optim_state.optimizer_param_key`, see the module docstring); a torch ``DistributedDataParallel`` or a
            ``shardkit.nn.ShardedDataParallel`` (known by its ``sharded_optimizers``,
            since ``shardkit.optim`` does not import ``shardkit.nn``) is unwrapped: keys
            have no ``module.``.
        optimizer: the ``OSS`` stepping ``model``'s parameters.
        base: the strategy name; default ``"oss"`` (``"sdp"`` under ShardedDataParallel).

    Raises:
        TypeError: ``optimizer`` is not an ``OSS``.
    """

    def __init__(self, model: nn.Module | None, optimizer: Any, base: str = "oss") -> None:
        if not isinstance(optimizer, OSS):
            raise TypeError(f"OSSLayout needs an OSS optimizer; got {type(optimizer).__name__}")
        if hasattr(model, "sharded_optimizers"):  # ShardedDataParallel (shardkit.nn)
            base = "sdp"
        wrapped = isinstance(model, DistributedDataParallel) or base == "sdp"
        self.model: nn.Module | None = model.module if wrapped else model  # type: ignore[assignment,union-attr]
        self.optimizer = optimizer
        params = optimizer._all_params() if self.model is None else self.model.parameters()
        self.strategy = strategy_name(base, (view_of(p) for p in params))
        self.purpose: Purpose = "save"

    @contextlib.contextmanager
    def session(self, purpose: Purpose) -> Iterator[None]:
        """Records whether entries are for a save or a load (a load without a model
        reads the parameters into scratch tensors)."""
        self.purpose = purpose
        yield

    def _writes(self, tensor: torch.Tensor, is_param: bool) -> bool:
        owner = self.optimizer.param_to_rank.get(tensor) if is_param else None
        return owner == self.optimizer.rank if owner is not None else self.optimizer.rank == 0

    def entries(self) -> Iterator[ParamEntry]:
        """One whole-tensor entry per parameter and persistent buffer (see the module)."""
        owners, rank = self.optimizer.param_to_rank, self.optimizer.rank
        owned = {id(p) for p, r in owners.items() if r == rank}
        if self.model is not None:
            holders = ranks_of(self.optimizer.group)
            return whole_entries(self.model, owned, self._writes, holders=holders)
        return self._param_entries(owned)

    def _param_entries(self, owned: set[int]) -> Iterator[ParamEntry]:
        for index, param in enumerate(self.optimizer._all_params()):
            view = view_of(param)
            scratch = self.purpose == "load"
            yield ParamEntry(
                key=optimizer_param_key(index),
                view=view,
                start=0,
                stop=param.numel(),
                tensor=torch.empty_like(param.detach()) if scratch else param.detach(),
                param=param if id(param) in owned else None,
                write=self._writes(param, True)
                and writes_replica(view, ranks_of(self.optimizer.group)),
            )

    def aliases(self) -> dict[str, str]:
        """Tied keys, ``{other key: first key}``, for the manifest."""
        return {} if self.model is None else tied_aliases(self.model)

    def after_load(self) -> None:
        """Drop the consolidated state cached by ``consolidate_state_dict`` (stale now)."""
        self.optimizer._consolidated = None


def _layout(model: Any, optimizer: Any) -> OSSLayout:
    return OSSLayout(model, optimizer)


register_layout(OSS, _layout)
