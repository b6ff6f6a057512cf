"""Reading the previous release's tensor-parallel sharded files (``tp-<r>-of-<T>.pt``).

``shardkit.nn.tensor_parallel.save_sharded`` wrote, until it became a call to the
universal checkpoint, one file per tensor-parallel rank, in a plain directory (no
manifest, no format tag)::

    {"tensors": {state-dict key: this rank's tensor},
     "layout": {key of a split tensor: (partition_dim, partition_stride)}}

A split tensor's dim ``d`` is cut into ``stride * T`` equal blocks, rank ``p`` holding
blocks ``p, p + T, ...`` concatenated; the others are replicas (rank 0's is kept).
Only ``convert`` reads it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch

from shardkit.checkpoint.legacy.state import LegacyState, open_records, rank_files
from shardkit.checkpoint.universal.plan import assemble
from shardkit.checkpoint.universal.shardfile import SavedPiece, dtype_name
from shardkit.distributed.shard_descriptor import TensorView

__all__ = ["FILE", "FORMAT", "merge_parts", "read"]

FORMAT = "shardkit.tensor_parallel_files"
"""The name ``inspect`` gives the format (its files carry no tag)."""
FILE = re.compile(r"tp-(\d+)-of-(\d+)\.pt")


class _Parts:
    """The parts in memory, as the universal checkpoint's piece source."""

    def __init__(self, parts: Sequence[torch.Tensor]) -> None:
        self.parts = parts

    def read(self, piece: SavedPiece, lo: int, hi: int) -> torch.Tensor:
        return self.parts[int(piece.name)].reshape(-1)[lo:hi]


def merge_parts(key: str, parts: Sequence[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The full tensor ``key`` whose tensor-parallel parts (rank order) are ``parts``,
    put together by the universal checkpoint's view arithmetic
    (:class:`~shardkit.checkpoint.universal.layout.TensorView`)."""
    shape = list(parts[0].shape)
    shape[dim] *= len(parts)
    pieces = [
        SavedPiece(
            key,
            "",
            TensorView(tuple(shape), dim, rank, len(parts), stride),
            0,
            part.numel(),
            dtype_name(part.dtype),
            "",
            str(rank),
        )
        for rank, part in enumerate(parts)
    ]
    return assemble(pieces, _Parts(parts)).view(shape)


def read(ckpt: Path) -> LegacyState:
    """The full model state of the tensor-parallel files in directory ``ckpt``.

    Raises:
        ValueError: the files do not form one save (a degree mixed or a rank missing),
            or disagree on their keys.
    """
    files = rank_files(ckpt, FILE)
    records = open_records(files)
    first = records[0]
    for path, record in zip(files, records):
        if set(record["tensors"]) != set(first["tensors"]):
            raise ValueError(f"{path} holds other keys than {files[0]}: different saves")
    out = LegacyState(FORMAT, len(records))
    for key, value in first["tensors"].items():
        if key in first["layout"]:
            dim, stride = first["layout"][key]
            parts = [r["tensors"][key] for r in records]
            value = merge_parts(key, parts, int(dim), int(stride))
        out.buffers[key] = value.clone()
    return out
