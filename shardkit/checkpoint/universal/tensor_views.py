"""The :class:`TensorView` a tensor carries, and which rank writes a tensor held whole.

A wrapper that splits a tensor across ranks and keeps one part per rank (tensor
parallelism, :mod:`shardkit.nn.tensor_parallel.universal_layout`) records the split on
the tensor itself, as the attribute ``universal_view`` (a :class:`TensorView`). Every
adapter, whichever wrapper it serves (plain, DDP, OSS, FSDP, Pipe, offload), reads it
through :func:`view_of`, so a data-parallel wrapper around a tensor-parallel model
saves each part under the original key without importing tensor parallelism (the
wrappers are independent layers; see ``docs/architecture.md``). An attribute, not a
table: it survives ``copy.deepcopy`` and travels with the parameter object.

[Note: tensor-parallel replicas]
A tensor that every tensor-parallel rank holds whole (a LayerNorm weight, a
row-parallel bias) is a replica across the tensor-parallel group: only tensor-parallel
rank 0 of the process-wide mesh (:mod:`shardkit.distributed.mpu`) writes it
(:func:`writes_replica`); the data-parallel wrapper de-duplicates its own replicas on
top. A tensor-parallel part is written by its holder.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shardkit.checkpoint.universal.layout import TensorView
from shardkit.distributed import mpu

__all__ = [
    "VIEW_ATTRIBUTE",
    "set_view",
    "strategy_name",
    "view_of",
    "writes_replica",
]

#: The tensor attribute holding a split tensor's :class:`TensorView`.
VIEW_ATTRIBUTE = "universal_view"


def set_view(tensor: torch.Tensor, view: TensorView) -> None:
    """Record that ``tensor`` is the local part ``view`` describes.

    Raises:
        ValueError: ``tensor``'s shape is not ``view.local_shape`` (both named).
    """
    if tuple(tensor.shape) != view.local_shape:
        raise ValueError(
            f"a tensor of shape {tuple(tensor.shape)} cannot be the local part {view} "
            f"(local shape {view.local_shape})"
        )
    setattr(tensor, VIEW_ATTRIBUTE, view)


def view_of(tensor: torch.Tensor) -> TensorView:
    """The view recorded on ``tensor`` by :func:`set_view`; else the whole tensor
    (``TensorView(tuple(tensor.shape))``)."""
    view = getattr(tensor, VIEW_ATTRIBUTE, None)
    if isinstance(view, TensorView):
        return view
    return TensorView(tuple(tensor.shape))


def writes_replica(view: TensorView) -> bool:
    """Whether this rank writes a tensor of ``view`` as far as tensor parallelism goes.

    A tensor-parallel part (``view.split_dim`` set): True, each part has one holder
    per data-parallel replica. A tensor held whole: True on tensor-parallel rank 0 of
    the process-wide mesh, or when none is set (see ``[Note: tensor-parallel
    replicas]``).
    """
    if view.split_dim is not None or not mpu.model_parallel_is_initialized():
        return True
    return mpu.get_model_parallel_rank() == 0


def strategy_name(base: str, views: Iterable[TensorView]) -> str:
    """``base`` (``"fsdp"``, ``"oss"``, ...), with ``"+tp<T>"`` when some view is a
    tensor-parallel part of ``T``: the ``strategy`` an adapter reports."""
    degrees = sorted({v.parts for v in views if v.split_dim is not None})
    return f"{base}+tp{degrees[-1]}" if degrees else base
