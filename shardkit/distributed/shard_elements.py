"""Element arithmetic of shard descriptors: where a local tensor's elements sit in the
global one.

[Note: a view as rows of the global tensor]
A :class:`~shardkit.distributed.shard_descriptor.TensorView` with ``split_dim`` d,
``parts`` P, ``part`` p and ``stride`` s cuts dim d of the global tensor into s x P
blocks of ``b`` rows and keeps blocks ``p, p + P, ...``. Write the global shape as
``(pre, s, P, b, post)``: the local tensor is ``global[:, :, p]`` of shape
``(pre, s, b, post)``, so its row-major elements come in runs of ``K = b * post``
contiguous global elements, run r starting at global element ``r * P * K + p * K``.
Local element i is therefore global element ``(i // K) * P * K + p * K + i % K``; a
whole tensor (``split_dim`` None) is one run of all its elements. A flat range of the
local tensor is at most a partial run, whole runs, and a partial run: three copies.
"""

from __future__ import annotations

import math

import torch

from shardkit.distributed.shard_descriptor import TensorView

__all__ = ["check_view", "local_rows", "read_range", "run_length", "write_range"]


def check_view(view: TensorView) -> None:
    """Raise ``ValueError`` naming the values when ``view`` is not a valid split."""
    shape = view.global_shape
    if any(d < 0 for d in shape):
        raise ValueError(f"global shape {shape} has a negative size")
    if view.split_dim is None:
        if (view.part, view.parts, view.stride) != (0, 1, 1):
            raise ValueError(f"{view}: a whole tensor has part 0 of 1 parts, stride 1")
        return
    if not 0 <= view.split_dim < len(shape):
        raise ValueError(f"{view}: split_dim {view.split_dim} outside a {len(shape)}-d shape")
    if view.parts < 1 or view.stride < 1 or not 0 <= view.part < view.parts:
        raise ValueError(f"{view}: need parts >= 1, stride >= 1 and 0 <= part < parts")
    size = shape[view.split_dim]
    if size % (view.parts * view.stride):
        raise ValueError(
            f"{view}: size {size} of dim {view.split_dim} is not divisible by "
            f"parts x stride = {view.parts} x {view.stride}"
        )


def run_length(view: TensorView) -> int:
    """K: the local tensor's elements come in runs of K contiguous global elements."""
    if view.split_dim is None:
        return max(math.prod(view.global_shape), 1)
    shape = view.global_shape
    block = shape[view.split_dim] // (view.parts * view.stride)
    return max(block * math.prod(shape[view.split_dim + 1 :]), 1)


def local_rows(global_flat: torch.Tensor, view: TensorView) -> torch.Tensor:
    """The local tensor of ``view`` as a ``(R, K)`` strided view of ``global_flat``
    (the global tensor flattened, 1-D); writing into it writes the global tensor."""
    k = run_length(view)
    rows = view.local_numel // k
    if view.split_dim is None or rows == 0:
        return global_flat[: rows * k].view(rows, k)
    return global_flat.as_strided((rows, k), (view.parts * k, 1), view.part * k)


def _runs(k: int, start: int, stop: int) -> list[tuple[int, int, int, int]]:
    """``[start, stop)`` of a ``(R, K)`` row-major matrix as blocks
    ``(row0, rows, col0, cols)``: a partial row, whole rows, a partial row."""
    out = []
    if start % k and start < stop:
        n = min(k - start % k, stop - start)
        out.append((start // k, 1, start % k, n))
        start += n
    whole = (stop - start) // k
    if whole:
        out.append((start // k, whole, 0, k))
        start += whole * k
    if start < stop:
        out.append((start // k, 1, 0, stop - start))
    return out


def read_range(rows: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of the row-major flattened ``rows`` (a copy, 1-D)."""
    k = rows.shape[1] if rows.dim() == 2 and rows.shape[0] else 1
    blocks = [rows[r : r + n, c : c + m].reshape(-1) for r, n, c, m in _runs(k, start, stop)]
    return torch.cat(blocks) if blocks else rows.new_empty(0)


def write_range(rows: torch.Tensor, start: int, src: torch.Tensor) -> None:
    """Copy the 1-D ``src`` into elements ``[start, start + len(src))`` of ``rows``."""
    k = rows.shape[1] if rows.dim() == 2 and rows.shape[0] else 1
    done = 0
    for r, n, c, m in _runs(k, start, start + src.numel()):
        rows[r : r + n, c : c + m].copy_(src[done : done + n * m].view(n, m))
        done += n * m
