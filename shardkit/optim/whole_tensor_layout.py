"""WholeTensorOptimizer in the universal checkpoint: the owner writes each whole tensor.

The model's own adapter (FSDP's) lists every piece; for a parameter stepped by a
whole-tensor group, its pieces are replaced by

- on the owner: one whole entry (elements ``[0, numel)``) whose storage is the owner's
  whole copy and whose ``param`` is that copy, so the optimizer state, a whole tensor
  keyed by the parameter's name, is saved and loaded as OSS's is (written by the owner
  when some rank of the group would have written a piece of it: one replica under
  hybrid sharding);
- on the other ranks: their piece, ``param=None``, never written (loading fills it).

Saving first refreshes the owners' whole copies from the pieces (a collective in the
adapter's session). Loading fills the whole copy and the state on the owner; the
owner's own piece is copied from it in ``after_load`` (no collective). The checkpoint is
the model's plain keys, so it loads at any world size, with or without this wrapper:
element-wise state (Muon's momentum, AdamW's moments) anywhere; per-tensor state
(Adafactor's factored second moment, saved whole with a descriptor of its own shape,
see ``[Note: per-tensor optimizer state]`` in
:mod:`shardkit.checkpoint.universal.optim_state`) into any optimizer holding whole
tensors: this one's owners at any world size, OSS / ShardedDataParallel's owners, a
plain model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from shardkit.checkpoint.universal.layout import (
    ParamEntry,
    Purpose,
    aliases_of,
    register_layout,
    session_of,
)
from shardkit.distributed.shard_descriptor import TensorView
from shardkit.optim.whole_tensor import WholeTensorOptimizer, model_layout

__all__ = ["WholeTensorLayout"]


class WholeTensorLayout:
    """The universal-checkpoint adapter of a model stepped by a :class:`WholeTensorOptimizer`.

    Args:
        model: the model the optimizer was built over.
        optimizer: the ``WholeTensorOptimizer``.

    Raises:
        TypeError: ``optimizer`` is not a ``WholeTensorOptimizer``, or ``model`` is no
            ``nn.Module`` and has no registered layout.
    """

    def __init__(self, model: nn.Module, optimizer: Any) -> None:
        if not isinstance(optimizer, WholeTensorOptimizer):
            raise TypeError(f"WholeTensorLayout needs a WholeTensorOptimizer; got {optimizer!r}")
        self.optimizer = optimizer
        self.base = model_layout(model, optimizer, optimizer.process_group)
        self.strategy = self.base.strategy

    @contextlib.contextmanager
    def session(self, purpose: Purpose) -> Iterator[None]:
        """Around the save or load: the owners' whole copies are refreshed before a save."""
        with session_of(self.base, purpose):
            if purpose == "save" and self.optimizer.plan.params:
                self.optimizer.gather_to_owners(with_grads=False)
            yield

    def entries(self) -> Iterator[ParamEntry]:
        """The model's entries, whole-tensor parameters replaced (see the module)."""
        opt = self.optimizer
        plan = opt.plan
        keys = {p.key for p in plan.params}
        for entry in self.base.entries():
            if entry.key not in keys:
                yield entry
        for i, pieces in enumerate(plan.params):
            view = TensorView(pieces.shape)
            if plan.owners[i] == opt.rank:
                proxy = opt._proxies[i]
                write = opt.writes[pieces.key]
                yield ParamEntry(pieces.key, view, 0, pieces.numel, proxy.detach(), proxy, write, 0)
            elif pieces.length(opt.rank):
                start, stop = pieces.ranges[opt.rank]
                yield ParamEntry(
                    pieces.key, view, start, stop, opt._sharded[i].detach(), None, False
                )

    def aliases(self) -> dict[str, str]:
        """The model's tied keys."""
        return aliases_of(self.base)

    def after_load(self) -> None:
        """Copy each owner's loaded whole copy into its own piece, then the model's step."""
        opt = self.optimizer
        for i in opt.plan.owned(opt.rank):
            start, stop = opt.plan.params[i].ranges[opt.rank]
            piece = opt._proxies[i].detach().view(-1)[start:stop]
            opt._sharded[i].detach().copy_(piece.view_as(opt._sharded[i]))
        self.base.after_load()


def _layout(model: Any, optimizer: Any) -> WholeTensorLayout:
    return WholeTensorLayout(model, optimizer)


register_layout(WholeTensorOptimizer, _layout)
