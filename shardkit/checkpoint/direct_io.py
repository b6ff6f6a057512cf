"""Large aligned file I/O for the disk tiers: ``O_DIRECT`` where the file system allows.

The disk tiers read every byte they write exactly once per step, so the page cache
only costs: a buffered write is copied into it and written back by the kernel later
(``fsync`` then waits for that writeback, a fraction of the disk's speed on this kind
of machine), and a buffered read leaves a second copy of what the process already
holds. ZeRO-Infinity (Rajbhandari et al. 2021, section 6.2) reaches the NVMe's peak
with large aligned asynchronous I/O that bypasses it; so does this module.

[Note: direct I/O and alignment]
``O_DIRECT`` needs the memory address, the file offset and the length of each call
aligned to the device's block (:data:`PAGE` bytes covers every common one). Memory
that is page-aligned (from :func:`aligned_empty` or an :class:`AlignedBufferPool`: the
optimizer-state buffers of the file-backed optimizer) is read and written in place, in
calls of up to :data:`IN_PLACE` bytes; any other tensor goes through a page-aligned
bounce buffer of :data:`CHUNK` bytes per I/O thread (one ``memmove`` per call, a
fraction of the disk's time). A file's last partial block is written padded and the file truncated
to its size. Where the file system refuses ``O_DIRECT`` (tmpfs, some network file
systems), at ``open`` or at the first call (``EINVAL``), the same calls go through the
page cache, followed by ``posix_fadvise(POSIX_FADV_DONTNEED)`` so that what is read
or written once is not kept twice.

Writes go to a temporary file beside the destination, are ``fsync``-ed and renamed
over it (as :func:`~shardkit.checkpoint.atomic.atomic_write`); the directory's
``fsync`` is left to the caller, once per commit (see
:meth:`~shardkit.checkpoint.generations.GenerationStore.commit`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = [
    "CHUNK",
    "IN_PLACE",
    "PAGE",
    "AlignedBufferPool",
    "Segment",
    "aligned_empty",
    "read_file",
    "segments_of",
    "write_file",
    "write_payload",
]

PAGE = 4096
"""Alignment of addresses, offsets and lengths of direct I/O calls, in bytes."""

CHUNK = 4 * 2**20
"""Bytes per read or write call through the bounce buffer (its size: resident memory
of each thread that ever moved misaligned memory)."""

IN_PLACE = 256 * 2**20
"""Bytes per read or write call from page-aligned memory: few calls, so an I/O thread
rarely needs the GIL back (each return from a call waits for it, up to the
interpreter's switch interval, while the training thread runs Python)."""

Segment = tuple[int, int, int]
"""``(file offset, memory address, bytes)``: a run of bytes of a file and where it is."""

_DIRECT = getattr(os, "O_DIRECT", 0)
_local = threading.local()


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised ``uint8`` CPU tensor of ``nbytes`` bytes starting on a page
    boundary (an anonymous memory map, freed with the tensor), which direct I/O reads
    and writes in place. Its storage cannot be resized."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(_anonymous(nbytes), dtype=torch.uint8)


def _anonymous(nbytes: int) -> mmap.mmap:
    """Anonymous memory of ``nbytes``, in huge pages where the kernel allows (2 MiB
    page faults instead of 4 KiB ones: a fresh buffer's first touch is most of the
    CPU time of reading a file into it)."""
    memory = mmap.mmap(-1, nbytes)
    if nbytes >= 2**21 and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            memory.madvise(mmap.MADV_HUGEPAGE)
    return memory


class AlignedBufferPool:
    """Page-aligned buffers kept warm between uses, up to ``limit_bytes`` of free ones.

    Host memory for O_DIRECT file I/O (not :class:`shardkit.distributed.BufferPool`,
    whose flat buffers of one dtype serve collectives and are handed back by ``put``).

    Reading a file into memory touched for the first time costs a page fault per page
    (the kernel zeroes each): on a loaded machine that is most of the read's time, so
    buffers of the sizes a tier reads again and again (each unit's optimizer state)
    are reused. A buffer is free again once no tensor views it (its reference count),
    so a caller simply drops its tensors.

    Args:
        limit_bytes: free buffers kept beyond those in use; 0 keeps none (every
            :meth:`take` allocates, as :func:`aligned_empty`).
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._buffers: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A page-aligned ``uint8`` tensor of ``nbytes`` (contents undefined)."""
        if nbytes == 0 or self.limit_bytes == 0:
            return aligned_empty(nbytes)
        with self._lock:
            free = [m for m in self._buffers if sys.getrefcount(m) <= _UNUSED]
            chosen = next((m for m in free if len(m) == nbytes), None)
            if chosen is None:
                chosen = _anonymous(nbytes)
                self._buffers.append(chosen)
            else:
                free.remove(chosen)
            spare = sum(len(m) for m in free)
            for m in free:  # beyond the limit: unmapped once unreferenced here
                if spare <= self.limit_bytes:
                    break
                self._buffers.remove(m)
                spare -= len(m)
            del free
            return torch.frombuffer(chosen, dtype=torch.uint8)


_UNUSED = 3  # references to a free pooled buffer: the pool's list, the list ``free``
# is built from while testing (the comprehension's variable), getrefcount's argument


def segments_of(tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> list[Segment]:
    """The segments of contiguous CPU ``tensors`` placed at file ``offsets``.

    Raises:
        ValueError: a tensor is not a contiguous CPU tensor.
    """
    out = []
    for tensor, offset in zip(tensors, offsets, strict=True):
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"need contiguous CPU tensors, got {tensor.device} {tensor.stride()}")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            out.append((offset, tensor.data_ptr(), nbytes))
    return out


def _bounce() -> tuple[mmap.mmap, int]:
    """This thread's page-aligned bounce buffer and its address."""
    if not hasattr(_local, "buffer"):
        buffer = _anonymous(CHUNK)
        _local.buffer = (buffer, ctypes.addressof(ctypes.c_char.from_buffer(buffer)))
    pair: tuple[mmap.mmap, int] = _local.buffer
    return pair


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _fill(address: int, start: int, length: int, segments: Sequence[Segment]) -> None:
    """Copy the bytes of file range ``[start, start + length)`` from ``segments`` (in
    file order, not overlapping) to ``address``; the gaps between them become zeros."""
    end = start  # filled up to here
    for offset, source, nbytes in segments:
        lo, hi = max(start, offset), min(start + length, offset + nbytes)
        if lo < hi:
            if lo > end:
                ctypes.memset(address + end - start, 0, lo - end)
            ctypes.memmove(address + lo - start, source + lo - offset, hi - lo)
            end = hi
    if end < start + length:
        ctypes.memset(address + end - start, 0, start + length - end)


def _write_direct(fd: int, segments: Sequence[Segment], size: int) -> None:
    buffer, bounce = _bounce()
    view = memoryview(buffer)
    try:
        in_place = len(segments) == 1 and segments[0][0] == 0 and segments[0][1] % PAGE == 0
        body = size // PAGE * PAGE if in_place else 0
        for start in range(0, body, IN_PLACE):
            length = min(IN_PLACE, body - start)
            chunk = (ctypes.c_char * length).from_address(segments[0][1] + start)
            _pwrite_all(fd, memoryview(chunk).cast("B"), start)
        for start in range(body, size, CHUNK):
            length = min(CHUNK, size - start)
            _fill(bounce, start, length, segments)
            _pwrite_all(fd, view[: _round_up(length)], start)
    finally:
        view.release()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def _write_buffered(fd: int, segments: Sequence[Segment], size: int) -> None:
    buffer, bounce = _bounce()
    view = memoryview(buffer)
    try:
        for start in range(0, size, CHUNK):
            length = min(CHUNK, size - start)
            _fill(bounce, start, length, segments)
            _pwrite_all(fd, view[:length], start)
    finally:
        view.release()


def write_payload(fd: int, segments: Sequence[Segment], size: int, *, aligned: bool) -> None:
    """Write the ``size`` bytes of a file made of ``segments`` to the open ``fd`` from
    offset 0; ``aligned``: ``fd`` is open with ``O_DIRECT`` (whole blocks per call)."""
    if aligned:
        _write_direct(fd, segments, size)
    else:
        _write_buffered(fd, segments, size)


def write_file(path: Path, segments: Sequence[Segment], size: int, *, direct: bool = True) -> bool:
    """Write a file of ``size`` bytes made of ``segments`` (zeros elsewhere) to a
    temporary file beside ``path``, ``fsync`` it and rename it over ``path``.

    The caller keeps the segments' memory alive and unchanged until this returns, and
    ``fsync``-s the directory before relying on the rename (see the module docstring).

    Args:
        path: the destination.
        segments: ``(file offset, address, bytes)`` runs, inside ``[0, size)``.
        size: the file's size in bytes.
        direct: try ``O_DIRECT`` first (default True).

    Returns:
        whether the file was written with direct I/O.

    Raises:
        OSError: the write failed; the temporary file is removed and ``path`` untouched.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    used = False
    try:
        if direct and _DIRECT:
            used = _try_direct(tmp, segments, size)
        if not used:
            write_payload(fd, segments, size, aligned=False)
        os.ftruncate(fd, size)
        os.fsync(fd)
        if not used:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    return used


def _try_direct(tmp: str, segments: Sequence[Segment], size: int) -> bool:
    """Write ``tmp`` with ``O_DIRECT``; False (nothing kept) where it is refused."""
    try:
        fd = os.open(tmp, os.O_WRONLY | _DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    try:
        write_payload(fd, segments, size, aligned=True)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    finally:
        os.close(fd)
    return True


def read_file(path: Path, flat: torch.Tensor, *, direct: bool = True) -> int:
    """Fill contiguous ``flat`` (any device) with the first bytes of ``path``; returns
    the count. Page-aligned CPU memory is read in place, any other through the bounce
    buffer (a device tensor through a page-aligned CPU copy).

    Raises:
        RuntimeError: the file holds fewer bytes than ``flat`` (a truncated file).
    """
    nbytes = flat.numel() * flat.element_size()
    size = os.stat(path).st_size
    if size < nbytes:
        raise RuntimeError(f"{path} holds {size} bytes, expected {nbytes}: truncated file")
    if nbytes == 0:
        return 0
    if flat.device.type != "cpu":
        staged = aligned_empty(nbytes)
        read_file(path, staged, direct=direct)
        flat.view(-1).view(torch.uint8).copy_(staged)
        return nbytes
    if not flat.is_contiguous():
        raise ValueError(f"need a contiguous tensor, got strides {flat.stride()}")
    fd = -1
    if direct and _DIRECT:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY | _DIRECT)
    if fd >= 0:
        try:
            _read_direct(fd, flat.data_ptr(), nbytes)
            return nbytes
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        finally:
            os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        _read_chunks(fd, flat.data_ptr(), nbytes, aligned_io=False)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return nbytes


def _read_direct(fd: int, address: int, nbytes: int) -> None:
    body = nbytes // PAGE * PAGE if address % PAGE == 0 else 0
    for start in range(0, body, IN_PLACE):
        length = min(IN_PLACE, body - start)
        chunk = (ctypes.c_char * length).from_address(address + start)
        _pread_all(fd, memoryview(chunk).cast("B"), start, length)
    _read_chunks(fd, address + body, nbytes - body, aligned_io=True, first=body)


def _read_chunks(fd: int, address: int, nbytes: int, *, aligned_io: bool, first: int = 0) -> None:
    """Read file bytes ``[first, first + nbytes)`` to ``address`` through the bounce
    buffer (whole blocks per call when ``aligned_io``)."""
    buffer, bounce = _bounce()
    view = memoryview(buffer)
    try:
        for start in range(0, nbytes, CHUNK):
            length = min(CHUNK, nbytes - start)
            want = _round_up(length) if aligned_io else length
            _pread_all(fd, view[:want], first + start, length)
            ctypes.memmove(address + start, bounce, length)
    finally:
        view.release()


def _pread_all(fd: int, into: memoryview, offset: int, needed: int) -> None:
    """Read into ``into`` from ``offset`` until ``needed`` bytes came (a short read at
    the end of the file is fine past ``needed``)."""
    got = 0
    while got < needed:
        n = os.preadv(fd, [into[got:]], offset + got)
        if n == 0:
            raise RuntimeError(f"unexpected end of file at byte {offset + got}")
        got += n
