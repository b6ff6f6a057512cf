"""The layouts of a plain ``nn.Module`` and of torch's ``DistributedDataParallel``.

Every rank holds every tensor whole (identical copies). With a process group of N
ranks, each tensor is listed as N pieces (elements ``[j * n // N, (j + 1) * n // N)``
of the flattened tensor, ``write`` on rank j only), so a save spreads the bytes over
the ranks and a load fills every piece of every tensor. Under DDP the buffers are
written by rank 0 alone: they may differ between ranks after a forward (BatchNorm's
running statistics), and DDP's rule is that rank 0's win (``broadcast_buffers``).

A tensor-parallel part (a tensor carrying a view, see
:mod:`~shardkit.checkpoint.universal.tensor_views`) is listed under its view. In a
plain module its holders are the data-parallel replicas of the process-wide mesh:
data-parallel rank 0 writes it whole. Under DDP the DDP group holds replicas of it, so
its pieces are spread over that group; a tensor held whole by every tensor-parallel
rank is then written by tensor-parallel rank 0 only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.checkpoint.manifest import _rank_world
from shardkit.checkpoint.universal.layout import ParamEntry, TensorView, register_layout

__all__ = ["DDPLayout", "PlainLayout", "model_tensors", "tied_aliases"]


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

    def entries(self) -> Iterator[ParamEntry]:
        """Every tensor's pieces; afterwards ``strategy`` says ``"+tp<T>"`` when some
        tensor is a tensor-parallel part of T."""
        # tensor_views imports this module: imported here, not at the top
        from shardkit.checkpoint.universal.tensor_views import strategy_name, view_of

        views = []
        for key, tensor, is_param in model_tensors(self.model):
            view = view_of(tensor)
            views.append(view)
            yield from self._pieces(key, tensor, view, tensor if is_param else None)
        self.strategy = strategy_name(type(self).strategy, views)

    def _writes(self, view: TensorView) -> tuple[bool, bool]:
        """(this rank may write the tensor, its pieces are spread over the group)."""
        if view.split_dim is None:
            return True, True
        from shardkit.distributed import mpu

        first = not mpu.model_parallel_is_initialized() or mpu.get_data_parallel_rank() == 0
        return first, False

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
        from shardkit.checkpoint.universal.tensor_views import writes_replica

        return writes_replica(view), True


register_layout(DistributedDataParallel, lambda model, optimizer: DDPLayout(model))
