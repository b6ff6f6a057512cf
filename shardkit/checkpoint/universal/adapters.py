"""The layouts of a plain ``nn.Module`` and of torch's ``DistributedDataParallel``.

Every rank holds every tensor whole (identical copies). With a process group of N
ranks, each tensor is listed as N pieces (elements ``[j * n // N, (j + 1) * n // N)``
of the flattened tensor, ``write`` on rank j only), so a save spreads the bytes over
the ranks and a load fills every piece of every tensor. Under DDP the buffers are
written by rank 0 alone: they may differ between ranks after a forward (BatchNorm's
running statistics), and DDP's rule is that rank 0's win (``broadcast_buffers``).

A tensor-parallel part (a tensor carrying a shard descriptor, see
:mod:`shardkit.distributed.shard_descriptor`) is listed under its descriptor. In a
plain module every rank of the group holds a whole copy of the model, so a part is
one piece written by one holder (:func:`~shardkit.distributed.shard_descriptor.writes_part`:
the tensor-parallel group holding the group's lowest rank). Under DDP the DDP group
holds copies of the part, so its pieces are spread over that group; a tensor held
whole by every tensor-parallel rank (its descriptor's replica group) is written by the
DDP group holding the replica group's lowest rank
(:func:`~shardkit.distributed.shard_descriptor.writes_replica`). A part whose split
group lies (in part) inside the DDP group (an MoE layer's experts, split over ``ep``
inside ``dp`` and left out of DDP) is not a copy on the DDP group's ranks: it is
listed as in a plain module, one piece per part written by one holder. No
process-wide mesh is read: the descriptor and the adapter's own group decide.

:func:`layout_of` picks the adapter of a model (the registry is
:mod:`~shardkit.checkpoint.universal.layout`; this module's plain adapter is the
fallback).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.checkpoint.manifest import _rank_world
from shardkit.checkpoint.universal.layout import (
    LayoutAdapter,
    ParamEntry,
    factory_of,
    register_layout,
    strategy_name,
)
from shardkit.distributed.collectives import group_ranks
from shardkit.distributed.shard_descriptor import (
    TensorView,
    view_of,
    writes_part,
    writes_replica,
)

__all__ = ["DDPLayout", "PlainLayout", "layout_of", "model_tensors", "tied_aliases"]


def model_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """``(key, tensor, is_parameter)`` for every tensor of ``model.state_dict()``
    (persistent buffers included), a tied tensor once, under its first key."""
    seen: set[int] = set()
    params = {id(p) for p in model.parameters()}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        yield key, tensor, id(tensor) in params


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{key: first key}`` for every ``state_dict()`` key whose tensor is also under an
    earlier key (a tied weight)."""
    first: dict[int, str] = {}
    out = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            out[key] = first[id(tensor)]
        else:
            first[id(tensor)] = key
    return out


class PlainLayout:
    """Every rank holds everything (see the module docstring).

    Args:
        model: the module; its ``state_dict()`` keys are the checkpoint's keys.
        group: the process group whose ranks share the writing; default None: the
            world group when one is initialised, else one rank.
    """

    strategy = "plain"
    buffers_from_rank0 = False
    # nothing keeps a plain module's copies equal: the save compares them (DDP does)
    assumes_replicas = True

    def __init__(self, model: nn.Module, group: Any = None) -> None:
        self.model = model
        self.rank, self.world_size = _rank_world(group)
        self.holders: tuple[int, ...] = (
            tuple(group_ranks(group)) if dist.is_available() and dist.is_initialized() else (0,)
        )

    def entries(self) -> Iterator[ParamEntry]:
        """Every tensor's pieces; afterwards ``strategy`` says ``"+tp<T>"`` when some
        tensor is a tensor-parallel part of T."""
        views = []
        for key, tensor, is_param in model_tensors(self.model):
            view = view_of(tensor)
            views.append(view)
            yield from self._pieces(key, tensor, view, tensor if is_param else None)
        self.strategy = strategy_name(type(self).strategy, views)

    def _writes(self, view: TensorView) -> tuple[bool, bool]:
        """(this rank may write the tensor, its pieces are spread over the group)."""
        if view.split_dim is None:
            return writes_replica(view, self.holders), True
        return writes_part(view, self.holders), False

    def _pieces(
        self, key: str, tensor: torch.Tensor, view: TensorView, param: torch.Tensor | None
    ) -> Iterator[ParamEntry]:
        data = tensor.detach()
        n, parts = data.numel(), self.world_size
        writes, spread = self._writes(view)
        whole = (param is None and self.buffers_from_rank0) or not spread
        if whole or not data.is_contiguous() or n < parts:  # one piece, written by one rank
            yield ParamEntry(
                key, view, 0, n, data, param, writes and (self.rank == 0 or not spread), 0
            )
            return
        flat = data.view(-1)
        for j in range(parts):
            lo, hi = j * n // parts, (j + 1) * n // parts
            yield ParamEntry(key, view, lo, hi, flat[lo:hi], param, writes and j == self.rank, lo)

    def after_load(self) -> None:
        """Nothing: every rank read every piece itself."""

    def aliases(self) -> dict[str, str]:
        """Tied keys: ``{other key: first key}``."""
        return tied_aliases(self.model)


class DDPLayout(PlainLayout):
    """torch ``DistributedDataParallel``: the wrapped module's keys (no ``module.``);
    the ranks of the DDP process group share the writing."""

    strategy = "ddp"
    buffers_from_rank0 = True
    assumes_replicas = False

    def __init__(self, model: DistributedDataParallel, group: Any = None) -> None:
        super().__init__(model.module, group if group is not None else model.process_group)

    def _writes(self, view: TensorView) -> tuple[bool, bool]:
        holders = set(self.holders)
        if any(s.group is not None and len(set(s.group) & holders) > 1 for s in view.splits):
            return writes_part(view, self.holders), False  # other parts on DDP's ranks
        return writes_replica(view, self.holders), True


register_layout(DistributedDataParallel, lambda model, optimizer: DDPLayout(model))


def layout_of(model: Any, optimizer: Any = None, *, group: Any = None) -> LayoutAdapter:
    """The adapter registered for ``optimizer``'s type (OSS: ownership decides who
    writes), else for the most specific registered type ``model`` is an instance of
    (nearest in ``type(model).__mro__``); a :class:`PlainLayout` (every rank holds
    everything; with a process group ``group`` of N ranks, rank r writes the r-th 1/N
    of each tensor's elements) when none matches.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` and no adapter is registered for it.
    """
    factory = factory_of(model, optimizer)
    if factory is not None:
        return factory(model, optimizer)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"no universal-checkpoint layout for {type(model).__name__}: pass an "
            "nn.Module, or register_layout(type, factory) for it"
        )
    return PlainLayout(model, group=group)
