"""Fixed-size buckets: many small tensors packed into one flat buffer for one collective.

A collective per tensor costs a fixed latency per call (a few tens of microseconds on
gloo, more across nodes); a model has hundreds of small tensors (biases, norms). Packing
them into flat buffers of a fixed byte size bounds the number of collectives by
``total bytes / bucket bytes + (number of buckets that had to be closed early)``,
whatever the parameter count: the constant-buffer idea of DeepSpeed (CBO, Rasley et al.
2020) and the gradient buckets of torch DDP (Li et al. 2020, "PyTorch Distributed",
section 3.2.3).

Three pieces, usable alone:

- :func:`plan_buckets`: split a sequence of tensor sizes into consecutive buckets of at
  most ``bucket_bytes`` (a tensor larger than that gets a bucket of its own). Pure.
- :func:`pack` / :func:`unpack`: copy tensors into / out of a flat 1-D buffer.
- :class:`BufferPool`: reuse flat buffers across steps so that a training loop does not
  allocate (and page-fault) a fresh buffer per bucket per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "BufferPool",
    "copy_scaled",
    "pack",
    "plan_buckets",
    "unpack",
]

DEFAULT_BUCKET_BYTES = 2**24
"""Default bucket size: 16 MiB (4 Mi fp32 elements)."""


def plan_buckets(nbytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Group consecutive items into buckets holding at most ``bucket_bytes`` each.

    Items keep their order; a bucket is closed when the next item would overflow it.
    An item larger than ``bucket_bytes`` is placed alone in its own bucket. With
    ``bucket_bytes <= 0`` every item gets its own bucket (no packing).

    Args:
        nbytes: size of each item, in bytes (>= 0).
        bucket_bytes: capacity of a bucket, in bytes.

    Returns:
        Buckets as lists of item indices; their concatenation is ``range(len(nbytes))``.

    Example:
        >>> plan_buckets([4, 4, 4, 16, 4], bucket_bytes=8)
        [[0, 1], [2], [3], [4]]
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, size in enumerate(nbytes):
        if current and (bucket_bytes <= 0 or filled + size > bucket_bytes):
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += size
    if current:
        buckets.append(current)
    return buckets


def pack(
    tensors: Sequence[torch.Tensor], buffer: torch.Tensor, divide_by: float | None = None
) -> None:
    """Copy ``tensors`` (any shapes) one after another into the 1-D ``buffer``.

    Casts to ``buffer.dtype`` on the way.

    Args:
        tensors: tensors whose total number of elements is at most ``buffer.numel()``.
        buffer: a contiguous 1-D tensor, written from element offset 0.
        divide_by: if given, each tensor is divided by it while copying (callers pass the
            world size to average, rounding like torch DDP's ``bucket.div_(world_size)``).
            Default None: plain copy.

    Raises:
        ValueError: if the tensors do not fit in ``buffer``.
    """
    total = sum(t.numel() for t in tensors)
    if total > buffer.numel():
        raise ValueError(
            f"{len(tensors)} tensors with {total} elements do not fit a buffer of "
            f"{buffer.numel()} elements; plan the buckets with plan_buckets first"
        )
    offset = 0
    for tensor in tensors:
        n = tensor.numel()
        copy_scaled(tensor, buffer[offset : offset + n].view_as(tensor), divide_by)
        offset += n


def copy_scaled(tensor: torch.Tensor, out: torch.Tensor, divide_by: float | None = None) -> None:
    """``out.copy_(tensor)``, or ``out.copy_(tensor / divide_by)`` (cast to ``out.dtype``).

    Same shape required; the division happens in ``tensor``'s dtype when ``out`` has
    another dtype (a gradient averaged in fp32, then cast to a half-precision bucket).
    """
    if divide_by is None:
        out.copy_(tensor)
    elif tensor.dtype == out.dtype:
        torch.div(tensor, divide_by, out=out)
    else:
        out.copy_(tensor / divide_by)


def unpack(buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of the 1-D ``buffer`` back into ``tensors`` (in place).

    The inverse of :func:`pack` (with ``scale=1``); casts back to each tensor's dtype.
    """
    offset = 0
    for tensor in tensors:
        n = tensor.numel()
        tensor.copy_(buffer[offset : offset + n].view_as(tensor))
        offset += n


class BufferPool:
    """Flat 1-D buffers reused across collectives, at most ``max_free`` kept per dtype.

    ``get(numel, dtype)`` returns a view of ``numel`` elements of a pooled buffer of at
    least that size (allocating one if none is free); ``put`` hands it back. Buffers
    larger than every pooled one are allocated on demand and pooled after use.

    Args:
        device: where the buffers live.
        max_free: free buffers kept per dtype (the rest are released); default 4.
    """

    def __init__(self, device: torch.device, max_free: int = 4) -> None:
        self.device = device
        self.max_free = max_free
        self._free: dict[torch.dtype, list[torch.Tensor]] = {}
        self._views: dict[int, torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous 1-D tensor of ``numel`` elements (uninitialised contents)."""
        free = self._free.setdefault(dtype, [])
        fits = [i for i, b in enumerate(free) if b.numel() >= numel]
        if fits:
            base = free.pop(min(fits, key=lambda i: free[i].numel()))
        else:
            base = torch.empty(numel, dtype=dtype, device=self.device)
        view = base[:numel]
        self._views[id(view)] = base
        return view

    def put(self, view: torch.Tensor) -> None:
        """Return a buffer obtained from :meth:`get` to the pool."""
        base = self._views.pop(id(view), None)
        if base is None:
            return
        free = self._free.setdefault(base.dtype, [])
        free.append(base)
        if len(free) > self.max_free:
            free.pop(min(range(len(free)), key=lambda i: free[i].numel()))

    def clear(self) -> None:
        """Release every pooled buffer."""
        self._free.clear()
        self._views.clear()
