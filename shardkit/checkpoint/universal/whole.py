"""Whole-tensor entries: the layout of wrappers whose ranks hold whole tensors.

OSS, Pipe stages and OffloadModel keep every tensor whole (or a tensor-parallel part of
it); their adapters differ only in who writes and in the key. :func:`whole_entries`
lists a module's tensors that way.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterator

import torch

from shardkit.checkpoint.universal.adapters import model_tensors
from shardkit.checkpoint.universal.layout import ParamEntry
from shardkit.distributed.shard_descriptor import view_of, writes_replica

__all__ = ["whole_entries"]


def whole_entries(
    module: torch.nn.Module,
    held: Container[int],
    writes: Callable[[torch.Tensor, bool], bool],
    rename: Callable[[str], str] | None = None,
    holders: Collection[int] | None = None,
) -> Iterator[ParamEntry]:
    """One entry per tensor of ``module.state_dict()`` (a tied tensor once), whole: for
    wrappers whose ranks hold whole tensors (or tensor-parallel parts of them).

    Args:
        held: ids of the parameters the optimizer holds on this rank (``param`` of the
            entry; None for the others and for buffers).
        writes: ``writes(tensor, is_parameter)``: this rank writes the tensor, as far as
            the wrapper goes; a tensor whose shard descriptor records a replica group
            (one every tensor-parallel rank holds whole) is also left to the holders
            of the replica group's lowest rank (:func:`writes_replica`).
        rename: maps the module's state-dict key to the unwrapped model's; default None:
            the key as it is.
        holders: the global ranks among which ``writes`` picks one writer (the
            wrapper's process group); default None: this rank alone.
    """
    for key, tensor, is_param in model_tensors(module):
        view = view_of(tensor)
        yield ParamEntry(
            key=key if rename is None else rename(key),
            view=view,
            start=0,
            stop=tensor.numel(),
            tensor=tensor.detach(),
            param=tensor if id(tensor) in held else None,
            write=writes(tensor, is_param) and writes_replica(view, holders),
        )
