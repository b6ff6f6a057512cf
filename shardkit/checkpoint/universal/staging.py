"""Host copies of a shard file's tensors, in one buffer reused between saves.

[Note: the staging buffer]
An asynchronous save (:mod:`.asynchronous`) must not read the model's storage while
training goes on: the next optimizer step rewrites it in place. So at the step
boundary every piece a rank writes is copied into a :class:`StagingBuffer`: one
host-memory byte buffer holding every piece back to back (each at a 64-byte aligned
offset, so any dtype views it), and the shard file is written from those copies.

- **Bounded**: the buffer holds exactly the bytes of this rank's shard file (its
  parameters', buffers' and optimizer state's pieces), once; at most one save is in
  flight, so one buffer per checkpointer is enough.
- **Reused**: the piece offsets are keyed by the layout (each piece's dtype and
  element count); the next save of the same layout copies into the same storage, so
  no allocation (and no page fault) happens at a step boundary after the first save.
  A new layout (a changed trainable set, another optimizer state) recomputes the
  offsets and reuses the storage when it is large enough, else replaces it.
- **CPU first, GPU ready**: a piece on a CUDA device is copied into pinned host
  memory with ``non_blocking=True``, then the device is synchronised once, so the copy
  is complete when :meth:`StagingBuffer.stage` returns; on CPU it is a plain copy.

Source: the staging copy of torch.distributed.checkpoint's ``async_save`` (the state
dict copied to CPU before the background write) and torchtitan's async checkpointing
(pinned memory reused between saves).
"""

from __future__ import annotations

import torch

from shardkit.checkpoint.universal.shardfile import ShardFile

__all__ = ["ALIGN_BYTES", "StagingBuffer"]

ALIGN_BYTES = 64  # every piece starts at a multiple: any dtype views it, cache-line aligned
Layout = tuple[tuple[torch.dtype, int], ...]  # (dtype, elements) of each piece, in order


def _offsets(layout: Layout) -> tuple[list[int], int]:
    """Byte offset of each piece in the buffer, and the buffer's size in bytes."""
    offsets, end = [], 0
    for dtype, numel in layout:
        end += -end % ALIGN_BYTES
        offsets.append(end)
        end += numel * dtype.itemsize
    return offsets, end


def _host_bytes(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` bytes of host memory; page-locked when ``pin`` (a CUDA source)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class StagingBuffer:
    """Copies the pieces of shard files into one host buffer, reused between saves
    (see [Note: the staging buffer]).

    Example::

        staging = StagingBuffer()
        copy = staging.stage(shard)   # shard: a ShardFile reading the model's storage
        copy.write_to(handle)         # later, while training continues

    The copy returned by :meth:`stage` is valid until the next :meth:`stage` call.
    """

    def __init__(self) -> None:
        self._storage: torch.Tensor | None = None  # uint8, 1-D
        self._layout: Layout | None = None
        self._offsets: list[int] = []
        self.allocations = 0  # times a buffer was allocated (for tests and reports)

    @property
    def nbytes(self) -> int:
        """Bytes of host memory held (0 before the first :meth:`stage`)."""
        return 0 if self._storage is None else self._storage.numel()

    def stage(self, shard: ShardFile) -> ShardFile:
        """The same shard file with every piece's tensor replaced by a copy in this
        buffer (1-D, contiguous, on the CPU), complete when this returns.

        Args:
            shard: a shard file whose pieces may be any tensors (any device, shape or
                dtype with a safetensors code).

        Returns:
            A :class:`ShardFile` with the same records and scalars, reading this
            buffer; it stays valid until the next call.
        """
        tensors = [t.detach() for _, t in shard.pieces]
        layout: Layout = tuple((t.dtype, t.numel()) for t in tensors)
        pin = any(t.device.type == "cuda" for t in tensors)
        storage = self._reserve(layout, pin)
        copies = []
        for tensor, offset in zip(tensors, self._offsets, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            copy = storage[offset : offset + nbytes].view(tensor.dtype)
            copy.copy_(tensor.reshape(-1), non_blocking=pin)
            copies.append(copy)
        if pin:
            torch.cuda.synchronize()
        return ShardFile(
            [(record, c) for (record, _), c in zip(shard.pieces, copies, strict=True)],
            list(shard.scalars),
        )

    def _reserve(self, layout: Layout, pin: bool) -> torch.Tensor:
        """The storage, laid out for ``layout`` (reused when it is large enough and
        pinned as asked)."""
        if layout != self._layout:
            self._offsets, nbytes = _offsets(layout)
            pinned = self._storage is not None and self._storage.is_pinned()
            if self._storage is None or self.nbytes < nbytes or pinned != pin:
                self._storage = None  # free the old one before allocating the new
                self._storage = _host_bytes(nbytes, pin)
                self.allocations += 1
            self._layout = layout
        assert self._storage is not None
        return self._storage
