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

[Note: a view of several splits as a strided view]
With several splits (each on its own dimension: ``TensorView.inner_splits``), the local
tensor is still a strided view of the global one, but no longer rows of one stride.
Each split dimension ``d`` of size ``s x P x b`` becomes two dimensions ``(s, b)`` with
strides ``(P x b x c_d, c_d)`` (``c_d`` the global stride of ``d``) and offset
``p x b x c_d``; their row-major order is the local dimension's (block ``j``, row
``i``: local row ``j x b + i``). :func:`local_rows` returns that view, and
:func:`read_range` / :func:`write_range` take a flat range of it through one copy of
the local tensor (what a single split's run arithmetic avoids).
"""

from __future__ import annotations

import math

import torch

from shardkit.distributed.shard_descriptor import Split, TensorView

__all__ = ["check_view", "local_rows", "read_range", "run_length", "write_range"]


def check_view(view: TensorView) -> None:
    """Raise ``ValueError`` naming the values when ``view`` is not a valid split."""
    shape = view.global_shape
    if any(d < 0 for d in shape):
        raise ValueError(f"global shape {shape} has a negative size")
    if view.split_dim is None:
        if (view.part, view.parts, view.stride) != (0, 1, 1) or view.inner_splits:
            raise ValueError(
                f"{view}: a whole tensor has part 0 of 1 parts, stride 1 and no inner split"
            )
        return
    dims = [s.dim for s in view.splits]
    if len(set(dims)) != len(dims):
        raise ValueError(f"{view}: splits on dims {dims}; each split needs its own dimension")
    for split in view.splits:
        _check_split(view, split)


def _check_split(view: TensorView, split: Split) -> None:
    shape = view.global_shape
    if not 0 <= split.dim < len(shape):
        raise ValueError(f"{view}: split_dim {split.dim} outside a {len(shape)}-d shape")
    if split.parts < 1 or split.stride < 1 or not 0 <= split.part < split.parts:
        raise ValueError(f"{view}: need parts >= 1, stride >= 1 and 0 <= part < parts")
    size = shape[split.dim]
    if size % (split.parts * split.stride):
        raise ValueError(
            f"{view}: size {size} of dim {split.dim} is not divisible by "
            f"parts x stride = {split.parts} x {split.stride}"
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
    (the global tensor flattened, 1-D; a slice of a larger buffer too); writing into it
    writes the global tensor. A view
    of several splits: a strided view with two dimensions per split dimension (see
    ``[Note: a view of several splits as a strided view]``)."""
    if view.inner_splits:
        return _several_splits(global_flat, view)
    k = run_length(view)
    rows = view.local_numel // k
    if view.split_dim is None or rows == 0:
        return global_flat[: rows * k].view(rows, k)
    offset = global_flat.storage_offset() + view.part * k  # as_strided's is absolute
    return global_flat.as_strided((rows, k), (view.parts * k, 1), offset)


def _several_splits(global_flat: torch.Tensor, view: TensorView) -> torch.Tensor:
    by_dim = {s.dim: s for s in view.splits}
    shape = view.global_shape
    sizes: list[int] = []
    strides: list[int] = []
    offset = 0
    for d, n in enumerate(shape):
        c = math.prod(shape[d + 1 :])
        split = by_dim.get(d)
        if split is None:
            sizes.append(n)
            strides.append(c)
            continue
        b = n // (split.parts * split.stride)
        sizes += [split.stride, b]
        strides += [split.parts * b * c, c]
        offset += split.part * b * c
    return global_flat.as_strided(sizes, strides, global_flat.storage_offset() + offset)


def _is_rows(rows: torch.Tensor) -> bool:
    """Whether ``rows`` is a ``(R, K)`` view of runs (:func:`local_rows` of one split)
    rather than the strided view of several splits."""
    return rows.dim() <= 2  # several splits give at least two dimensions per split


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
    if not _is_rows(rows):
        return rows.reshape(-1)[start:stop].clone()
    k = rows.shape[1] if rows.dim() == 2 and rows.shape[0] else 1
    blocks = [rows[r : r + n, c : c + m].reshape(-1) for r, n, c, m in _runs(k, start, stop)]
    return torch.cat(blocks) if blocks else rows.new_empty(0)


def write_range(rows: torch.Tensor, start: int, src: torch.Tensor) -> None:
    """Copy the 1-D ``src`` into elements ``[start, start + len(src))`` of ``rows``."""
    if not _is_rows(rows):
        if start == 0 and src.numel() == rows.numel():
            rows.copy_(src.view(rows.shape))
            return
        local = rows.reshape(-1).clone()
        local[start : start + src.numel()] = src
        rows.copy_(local.view(rows.shape))
        return
    k = rows.shape[1] if rows.dim() == 2 and rows.shape[0] else 1
    done = 0
    for r, n, c, m in _runs(k, start, start + src.numel()):
        rows[r : r + n, c : c + m].copy_(src[done : done + n * m].view(n, m))
        done += n * m
