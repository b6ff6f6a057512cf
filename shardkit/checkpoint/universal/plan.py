"""Which saved bytes fill a target piece: range intersection, or assemble and cut.

[Note: two ways to fill a piece]
A target piece (a local tensor ``view``, elements ``[start, stop)``) is filled from
the saved pieces of the same key and state:

- the saved pieces with the *same* view cover it: intersect the element ranges and
  copy exactly those elements (:func:`direct_copies`); a reader that reads ranges
  lazily (safetensors slices) reads exactly these bytes;
- otherwise (another tensor-parallel degree or stride, a whole tensor from parts or
  parts from a whole tensor): put together that one global tensor from every saved
  piece of it (:func:`assemble`), then cut the target out (:mod:`.views`). The extra
  memory is one original tensor; :class:`Filler` keeps the last one assembled, so a
  key's next pieces reuse it.

The saved pieces of a key are checked first (:func:`cover_problem`): one split (same
``split_dim``, ``parts``, ``stride``; the same of every split for a view of several),
the checkpoint's global shape, and every element of every part (every combination of
the splits' parts) exactly once. Pure functions of the index, except the reads,
which go through a :class:`PieceSource` (the shard files; a dict in tests).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from shardkit.checkpoint.universal.shardfile import SavedPiece, dtype_from_name
from shardkit.distributed.shard_descriptor import TensorView
from shardkit.distributed.shard_elements import local_rows, read_range, write_range

__all__ = [
    "Copy",
    "Filler",
    "PieceSource",
    "assemble",
    "cover_problem",
    "direct_copies",
]


class PieceSource(Protocol):
    """Reads saved pieces."""

    def read(self, piece: SavedPiece, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``piece``'s saved 1-D tensor (in its saved dtype)."""
        ...


@dataclass(frozen=True)
class Copy:
    """Copy elements ``[src, src + numel)`` of ``piece``'s tensor to elements
    ``[dst, dst + numel)`` of the target piece (relative to its ``start``)."""

    piece: SavedPiece
    src: int
    dst: int
    numel: int


def cover_problem(pieces: Sequence[SavedPiece], global_shape: tuple[int, ...]) -> str | None:
    """Why ``pieces`` (one key and state) do not hold every element of a tensor of
    ``global_shape`` exactly once, or None when they do."""
    if not pieces:
        return "no saved piece"
    splits = sorted({_split_key(p.view) for p in pieces}, key=str)
    if len(splits) > 1:
        return f"pieces in different splits (split_dim, parts, stride): {splits}"
    shapes = sorted({p.view.global_shape for p in pieces})
    if shapes != [tuple(global_shape)]:
        return f"pieces of global shapes {shapes}, the checkpoint says {list(global_shape)}"
    view = pieces[0].view
    several = bool(view.inner_splits)
    counts = [s.parts for s in view.splits] if several else [view.parts]
    for index in itertools.product(*(range(n) for n in counts)):
        ranges = sorted((p.start, p.stop) for p in pieces if _part(p.view) == index)
        name = f"part {index if several else index[0]} of {tuple(counts) if several else counts[0]}"
        end, numel = 0, view.local_numel
        for lo, hi in ranges:
            if lo < end:
                return f"{name}: elements [{lo}, {min(hi, end)}) saved twice"
            if lo > end:
                return f"{name}: elements [{end}, {lo}) missing"
            end = hi
        if end != numel:
            return f"{name}: elements [{end}, {numel}) missing"
    return None


def _split_key(view: TensorView) -> tuple[int | None, int, int] | tuple[tuple[int, int, int], ...]:
    """What pieces of one split share: ``(split_dim, parts, stride)``, or that of every
    split for a view of several."""
    if not view.inner_splits:
        return (view.split_dim, view.parts, view.stride)
    return tuple((s.dim, s.parts, s.stride) for s in view.splits)


def _part(view: TensorView) -> tuple[int, ...]:
    """The part of each split (``(part,)`` for one split or none)."""
    if not view.inner_splits:
        return (view.part,)
    return tuple(s.part for s in view.splits)


def direct_copies(
    pieces: Sequence[SavedPiece], view: TensorView, start: int, stop: int
) -> list[Copy] | None:
    """The copies filling ``[start, stop)`` of ``view`` from the pieces of the same
    view, or None when those do not cover it (then :func:`assemble`). Assumes the
    pieces passed :func:`cover_problem` (no element twice)."""
    copies, covered = [], 0
    for p in pieces:
        if p.view != view:
            continue
        lo, hi = max(start, p.start), min(stop, p.stop)
        if lo < hi:
            copies.append(Copy(p, lo - p.start, lo - start, hi - lo))
            covered += hi - lo
    return copies if covered == stop - start else None


def assemble(pieces: Sequence[SavedPiece], source: PieceSource) -> torch.Tensor:
    """The global tensor (flattened, 1-D, the saved dtype) from every piece of it."""
    first = pieces[0]
    out = torch.empty(math.prod(first.view.global_shape), dtype=dtype_from_name(first.dtype))
    for p in pieces:
        if p.stop > p.start:
            write_range(local_rows(out, p.view), p.start, source.read(p, 0, p.stop - p.start))
    return out


class Filler:
    """Fills target pieces from a :class:`PieceSource` (see [Note: two ways to fill a
    piece]); keeps the last assembled global tensor for the key's next pieces."""

    def __init__(self, source: PieceSource) -> None:
        self.source = source
        self._cached: tuple[tuple[str, str], torch.Tensor] | None = None
        self.assembled = 0  # global tensors put together (for tests and reports)

    def fill(
        self,
        dst: torch.Tensor,
        pieces: Sequence[SavedPiece],
        view: TensorView,
        start: int,
        stop: int,
    ) -> None:
        """Copy elements ``[start, stop)`` of local tensor ``view`` into ``dst`` (any
        shape with ``stop - start`` elements; converted to ``dst``'s dtype)."""
        if stop <= start:
            return
        copies = direct_copies(pieces, view, start, stop)
        if copies is not None:
            self._copy(dst, copies)
            return
        whole = self._global(pieces)
        data = read_range(local_rows(whole, view), start, stop)
        dst.copy_(data.view(dst.shape))

    def _copy(self, dst: torch.Tensor, copies: list[Copy]) -> None:
        flat = dst.view(-1) if dst.is_contiguous() else torch.empty(dst.numel(), dtype=dst.dtype)
        for c in copies:
            data = self.source.read(c.piece, c.src, c.src + c.numel)
            flat[c.dst : c.dst + c.numel].copy_(data)
        if not dst.is_contiguous():
            dst.copy_(flat.view(dst.shape))

    def _global(self, pieces: Sequence[SavedPiece]) -> torch.Tensor:
        tag = (pieces[0].key, pieces[0].state)
        if self._cached is not None and self._cached[0] == tag:
            return self._cached[1]
        self._cached = None  # drop the previous one before assembling the next
        whole = assemble(pieces, self.source)
        self.assembled += 1
        self._cached = (tag, whole)
        return whole

    def release(self) -> None:
        """Drop the cached global tensor."""
        self._cached = None
