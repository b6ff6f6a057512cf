"""Persistent full-size buffers of FSDP units whose memory is given back between uses.

A unit's full (unsharded) parameters and its full gradient each live in one
:class:`UnitBuffer` for the life of the unit: one tensor, one storage object, one
address. :meth:`UnitBuffer.acquire` makes its memory resident, :meth:`UnitBuffer.release`
gives the memory back; nothing is allocated or freed per unit per step.

[Note: keep the storage, give back the pages]
Autograd saves views of the full parameters for backward (``weight.t()`` of a linear
layer), bound to the storage object. A buffer handed from one unit to another, or a
``param.data`` swapped between pool slots, would silently corrupt those saved views, so
each unit keeps its own buffer and only its *memory* comes and goes:

- CPU: the buffer is an anonymous private mapping (``mmap``; 2 MiB aligned and advised
  ``MADV_HUGEPAGE`` from 2 MiB up, so refilling it costs few page faults). Release is
  ``madvise(MADV_DONTNEED)``: the pages go back to the operating system at once (the
  resident set drops), the address and every view stay valid, and the next write
  faults in zero pages. A plain ``free`` would leave the memory in glibc's heap (only
  allocations above a threshold that grows to 32 MiB are unmapped), so a freed unit
  buffer lowered the allocated bytes but not the resident set.
- Other devices (CUDA): the storage is resized to 0 and back (``resize_``), as torch's
  FSDP does; the caching allocator serves the same sizes every step from the blocks the
  previous step freed, so the churn does not fragment. Views follow the storage.

While released, a CPU buffer reads as zeros (a CUDA buffer raises on access). The unit
runtime re-gathers before any use (the pre-forward and pre-backward hooks), so nothing
reads a released parameter buffer.

How many buffers are resident at once is counted per kind in
:func:`shardkit.memory.buffer_pools` (now and peak, count and bytes).
"""

from __future__ import annotations

import mmap
import weakref

import torch

from shardkit.memory import BufferAccount, buffer_account

__all__ = ["GRADIENTS", "PARAMETERS", "SHARDS", "UnitBuffer"]

PARAMETERS = "fsdp unit parameters"
"""The pool name of full parameter buffers in :func:`shardkit.memory.buffer_pools`."""
GRADIENTS = "fsdp unit gradients"
"""The pool name of full gradient buffers in :func:`shardkit.memory.buffer_pools`."""
SHARDS = "fsdp disk shards"
"""The pool name of the local shards of units on the disk tier (resident only while
the unit runs, steps or is written) in :func:`shardkit.memory.buffer_pools`."""

_HUGE_PAGE = 2 * 2**20  # bytes; transparent huge pages on x86-64 and arm64 (4 KiB base)


class _Residency:
    """The accounting of one buffer, apart from the buffer (a finalizer holds it)."""

    def __init__(self, account: BufferAccount, nbytes: int) -> None:
        self.account, self.nbytes, self.resident = account, nbytes, False
        account.add(nbytes)

    def set(self, resident: bool) -> None:
        if resident != self.resident:
            self.resident = resident
            (self.account.acquired if resident else self.account.released)(self.nbytes)

    def close(self) -> None:
        self.set(False)
        self.account.remove(self.nbytes)


class UnitBuffer:
    """A flat tensor ``(numel,)`` at a fixed storage whose memory is resident only
    between :meth:`acquire` and :meth:`release` (see [Note: keep the storage, give back
    the pages]).

    Args:
        numel: elements (>= 0).
        dtype: element type.
        device: where it lives; CPU: an anonymous mapping, else a torch allocation.
        pool: the pool name it is counted under in :func:`shardkit.memory.buffer_pools`.

    Starts released. Contents after :meth:`acquire` are zeros on CPU when the buffer was
    released (always for gradients: ``acquire(zero=True)`` also zeroes other devices).
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, pool: str) -> None:
        if numel < 0:
            raise ValueError(f"a unit buffer needs numel >= 0; got {numel}")
        self.nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self._map: mmap.mmap | None = None
        self._offset = 0
        if device.type == "cpu" and self.nbytes:
            self.tensor = self._mapped(numel, dtype)
        else:
            self.tensor = torch.empty(numel, dtype=dtype, device=device)
            self.tensor.untyped_storage().resize_(0)
        self._residency = _Residency(buffer_account(pool), self.nbytes)
        weakref.finalize(self, self._residency.close)

    def _mapped(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        huge = self.nbytes >= _HUGE_PAGE
        slack = _HUGE_PAGE if huge else 0  # to start on a huge-page boundary
        self._map = mmap.mmap(-1, self.nbytes + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge:
            address = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
            self._offset = -address % _HUGE_PAGE
            if hasattr(mmap, "MADV_HUGEPAGE"):
                self._map.madvise(mmap.MADV_HUGEPAGE, self._offset, self.nbytes)
        return torch.frombuffer(self._map, dtype=dtype, count=numel, offset=self._offset)

    @property
    def resident(self) -> bool:
        """True between :meth:`acquire` and :meth:`release`."""
        return self._residency.resident

    def acquire(self, zero: bool = False) -> None:
        """Make the memory resident (a no-op if it is). Contents: as left by the last
        writes if resident; else zeros on CPU, undefined elsewhere unless ``zero``."""
        if self._residency.resident:
            return
        if self._map is None and self.nbytes:
            self.tensor.untyped_storage().resize_(self.nbytes)
            if zero:
                self.tensor.zero_()
        self._residency.set(True)

    def release(self) -> None:
        """Give the memory back (CPU: at once, to the OS); the tensor stays valid."""
        if not self._residency.resident:
            return
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED, self._offset, self.nbytes)
        elif self.nbytes:
            self.tensor.untyped_storage().resize_(0)
        self._residency.set(False)
