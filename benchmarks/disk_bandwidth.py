"""The disk's own sequential bandwidth, measured beside a disk tier in the same run.

The disk benches (``bench_fsdp_disk``, ``bench_offload``) compare the bytes per second
their tier moves with what the disk does on its own, measured here on the same file
system, with a file as large as one unit of the tier, just before and after the tier
runs (a shared machine's load changes from minute to minute).

How: the file is written sequentially in blocks of :data:`BLOCK` bytes from a
page-aligned buffer, opened with ``O_DIRECT`` (as ``dd oflag=direct``), then
``fsync``-ed; it is read back the same way (``iflag=direct``). Where the file system
refuses ``O_DIRECT`` (tmpfs), the file is written and ``fsync``-ed through the page
cache, then dropped from it (``posix_fadvise(POSIX_FADV_DONTNEED)``) before the read,
so the read still comes from the disk. The best of ``rounds`` is reported: the disk's
capability, the stricter reference for the tier.

This module knows nothing of shardkit: the reference does not share code with what it
measures.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BLOCK = 8 * 2**20
"""Bytes per ``write`` / ``read`` system call (``dd bs=8M``)."""


@dataclass(frozen=True)
class DiskBandwidth:
    """Sequential bandwidth of one file system, bytes per second.

    Attributes:
        read_bytes_per_s: best sequential read of ``rounds``.
        write_bytes_per_s: best sequential write (data on the disk: ``fsync`` included).
        file_bytes: size of the probe file.
        direct: True when ``O_DIRECT`` was used, False for page cache + ``fsync`` +
            ``posix_fadvise(DONTNEED)``.
        rounds: how many write-then-read rounds ran.
    """

    read_bytes_per_s: float
    write_bytes_per_s: float
    file_bytes: int
    direct: bool
    rounds: int

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON-able dict."""
        return asdict(self)


def _open(path: Path, flags: int) -> tuple[int, bool]:
    """Open ``path`` with ``O_DIRECT`` if the file system allows it; (fd, direct)."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o644), True
        except OSError:
            pass
    return os.open(path, flags, 0o644), False


def _write(path: Path, nbytes: int, buffer: mmap.mmap) -> tuple[float, bool]:
    fd, direct = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    view = memoryview(buffer)
    try:
        start = time.perf_counter()
        for offset in range(0, nbytes, BLOCK):
            os.pwrite(fd, view[: min(BLOCK, nbytes - offset)], offset)
        os.fsync(fd)
        seconds = time.perf_counter() - start
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        view.release()
        os.close(fd)
    return seconds, direct


def _read(path: Path, nbytes: int, buffer: mmap.mmap) -> float:
    fd, _ = _open(path, os.O_RDONLY)
    view = memoryview(buffer)
    try:
        start = time.perf_counter()
        for offset in range(0, nbytes, BLOCK):
            os.preadv(fd, [view[: min(BLOCK, nbytes - offset)]], offset)
        seconds = time.perf_counter() - start
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        view.release()
        os.close(fd)
    return seconds


def measure(directory: str | os.PathLike[str], nbytes: int, rounds: int = 2) -> DiskBandwidth:
    """Sequential write then read of an ``nbytes`` file in ``directory``, ``rounds`` times.

    Args:
        directory: a directory on the file system to measure (the tier's).
        nbytes: the probe file's size in bytes, rounded up to a multiple of 4096 (direct
            I/O needs whole blocks); say one unit of the tier.
        rounds: write-then-read rounds; the best of each is kept. Default 2.

    Returns:
        the :class:`DiskBandwidth`; the probe file is deleted.

    Raises:
        ValueError: ``nbytes`` or ``rounds`` below 1.
    """
    if nbytes < 1 or rounds < 1:
        raise ValueError(f"need nbytes >= 1 and rounds >= 1, got {nbytes} and {rounds}")
    nbytes = -(-nbytes // 4096) * 4096
    path = Path(directory) / ".disk-bandwidth-probe"
    buffer = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(BLOCK))  # incompressible
    writes, reads, direct = [], [], True
    try:
        for _ in range(rounds):
            seconds, direct = _write(path, nbytes, buffer)
            writes.append(seconds)
            reads.append(_read(path, nbytes, buffer))
    finally:
        buffer.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return DiskBandwidth(nbytes / min(reads), nbytes / min(writes), nbytes, direct, rounds)
