"""Crash-safe generations of files in one directory, committed by one atomic manifest.

Used by every disk tier (``OffloadModel``'s and FSDP's): training state kept in files,
rewritten at every optimizer step without ever being at risk.

Directory layout (``<entry>`` names a group of tensors, ``<kind>`` a file of it,
``<g>`` the generation)::

    manifest.json          format, committed generation, files of every entry, extras
    <entry>.<kind>.g<g>    raw bytes of one tensor (or of several, laid out by the caller)

[Note: crash safety]
Committed files are never modified. A step writes generation ``g + 1`` of every file it
changes next to generation ``g`` (each through
:func:`~shardkit.checkpoint.atomic.atomic_write`: a temporary file, ``fsync``,
rename), then replaces ``manifest.json`` atomically: that rename is the commit point.
A crash before it leaves generation ``g`` complete and referenced; reopening the
directory deletes the unreferenced ``g + 1`` files. The cost is disk space: two
generations exist during a step. Files a step does not change keep their older
generation number (they are referenced, not copied).

[Note: write-behind]
With ``write_behind_bytes > 0``, :meth:`GenerationStore.write_async` returns at once
and background threads write the file (large aligned direct I/O, see
:mod:`~shardkit.checkpoint.direct_io`) while the caller goes on: the caller keeps the
tensors unchanged until the returned future is done, and the store never has more
than ``write_behind_bytes`` bytes of writes in flight (a new write waits for older
ones; one write alone may be larger), so the memory they pin is bounded and counted
(``inflight_bytes``, ``peak_inflight_bytes``). Ordering: a file's name is current
from the moment its write is submitted, and a read of a file whose write is in flight
waits for that write, so it sees the new bytes. Crash safety is unchanged:
:meth:`GenerationStore.commit` waits for every write (and raises the first error of
one) before the directory's ``fsync`` and the manifest's rename, so a crash while
writes are in flight leaves the committed generation and, at worst, unreferenced
files of the next one. Reads may run ahead on background threads too
(:meth:`GenerationStore.read_async`); such a read of a file whose write is in flight
waits for the write on the background thread, not on the caller's.

[Note: scratch files]
``write_async(..., scratch=True)`` writes ``<entry>.<kind>`` (no generation) the same
way (write-behind, direct I/O, ``write_behind_bytes`` counted) for data that is not
part of any generation, such as gradients accumulated between optimizer steps: its
name is current at once (:meth:`GenerationStore.path`, the reads find it) but no
manifest names it, so a crash leaves it unreferenced and a reopen deletes it; the
caller keeps it with ``keep`` at each commit and deletes it with
:meth:`GenerationStore.remove_scratch`.

[Note: per-entry commits]
Two generations of every file need twice the disk. ``commit(..., entries=[...])``
commits the new files of some entries only: it waits for their writes, ``fsync``-s
the directory and renames a manifest naming those entries' new files and every other
entry's committed ones, then deletes the files neither the manifest nor a write in
flight names, among them the entries' previous generation. Committing each entry as
soon as it is written keeps one generation plus the entries being written on the
disk. The guarantee is per entry: after a crash every file the manifest names is
whole, but entries committed since the last full commit are one generation ahead of
the others; the caller records which (a manifest field) and decides what resuming
from such a directory means.

Why this module is long: the store's writes, reads, commits and deletions share one
lock, one table of writes in flight and the crash-safety rules of the notes above.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import json
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from shardkit.checkpoint.atomic import atomic_write, fsync_dir
from shardkit.checkpoint.direct_io import (
    AlignedBufferPool,
    Segment,
    read_file,
    segments_of,
    write_file,
)

__all__ = [
    "ALIGN",
    "MANIFEST",
    "GenerationStore",
    "check_byte_count",
    "check_writable",
    "packed_offsets",
    "read_into",
    "write_tensor",
]

MANIFEST = "manifest.json"
ALIGN = 64  # bytes: every tensor of a packed file starts at a multiple of this
BUSY_PERIODS = 4096
"""How many periods of I/O a store remembers in ``busy_periods`` (the oldest go first)."""


def packed_offsets(nbytes: list[int]) -> tuple[list[int], int]:
    """Byte offsets of tensors of ``nbytes`` bytes packed one after the other, each
    starting at a multiple of :data:`ALIGN`, and the file's size (no trailing padding)."""
    offsets, end = [], 0
    for n in nbytes:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + n
    return offsets, end


def wait_for_commit(directory: Path) -> None:
    """Wait until no background commit is in flight in ``directory`` (a store holds an
    exclusive ``flock`` of the directory from submitting one until it landed or failed;
    released by the kernel if its process dies), in this process or another: a store
    opened meanwhile would read the manifest before it and delete the files the commit
    is about to name."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)  # and the shared lock with it


def check_byte_count(name: str, nbytes: object) -> None:
    """A disk tier's byte budget argument (write-behind, read-ahead) must be an int >= 0.

    Raises:
        ValueError: ``nbytes`` is not an int (a bool, a float, None) or is negative,
            naming ``name`` and the value.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"{name} must be an int >= 0 (bytes; 0 turns it off), got {nbytes!r}")


def check_writable(directory: Path, what: str = "offload_dir") -> None:
    """Create ``directory`` if needed and prove it is writable.

    Args:
        directory: the directory.
        what: the argument's name, for messages. Default ``"offload_dir"``.

    Raises:
        ValueError: if the path exists and is not a directory, or cannot be written,
            naming the path and the fix.
    """
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{what} {str(directory)!r} exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".shardkit-write-probe"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise ValueError(
            f"{what} {str(directory)!r} is not writable ({exc.strerror}); choose a "
            "directory you can write to, on a disk with room for two copies of the model "
            "state"
        ) from exc


def bytes_view(flat: torch.Tensor) -> memoryview:
    """A writable byte view of the contiguous CPU tensor ``flat`` (no copy).

    Through ``ctypes``, not ``Tensor.numpy()``: the latter marks the storage as not
    resizable for good, which would break freeing it with ``resize_(0)``.
    """
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    if not flat.is_contiguous() or flat.device.type != "cpu":
        raise ValueError(f"need a contiguous CPU tensor, got {flat.device} {tuple(flat.stride())}")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(flat.data_ptr())).cast("B")


def write_tensor(handle: Any, flat: torch.Tensor) -> int:
    """Write the bytes of contiguous ``flat`` to the open binary ``handle``; returns the count."""
    flat = flat if flat.device.type == "cpu" else flat.cpu()
    handle.write(bytes_view(flat))
    return flat.numel() * flat.element_size()


def read_into(path: Path, flat: torch.Tensor) -> int:
    """Fill contiguous ``flat`` with the bytes of ``path`` (same size); returns the count.

    Raises:
        RuntimeError: the file holds fewer bytes than ``flat`` (a truncated file).
    """
    nbytes = flat.numel() * flat.element_size()
    if flat.device.type == "cpu":
        with open(path, "rb") as handle:
            got = handle.readinto(bytes_view(flat)) if nbytes else 0
    else:
        staged = torch.from_file(str(path), shared=False, size=nbytes, dtype=torch.uint8)
        flat.view(torch.uint8).copy_(staged)
        got = nbytes
    if got != nbytes:
        raise RuntimeError(f"{path} holds {got} bytes, expected {nbytes}: truncated file")
    return nbytes


class GenerationStore:
    """A directory of files in generations; ``manifest.json`` names the committed one.

    Args:
        directory: the directory (created if missing).
        fmt: the format string written to and checked in the manifest.
        owned: file names this store may delete when unreferenced (a directory may
            hold other files), matched against the final names (it may end with ``$``);
            the temporary files of an interrupted write of one of them or of the
            manifest (``.<name>.<random>.tmp``) are deleted too (see [Note: temporary
            files]).
        resume: False: the directory must hold no manifest yet. True: it must; open it
            with :meth:`open`.
        what: the argument naming the directory, for messages. Default ``"offload_dir"``.
        holds: what a manifest means there, for messages. Default ``"a model"``.
        write_behind_bytes: the most bytes of writes in flight on background threads
            (see [Note: write-behind]); 0 (default): :meth:`write_async` still returns
            a future, but each write waits for the previous one.
        io_threads: background threads for writes, and as many for reads. Default 2.
        direct_io: try ``O_DIRECT`` for the payload files (default True; the store
            falls back to the page cache where the file system refuses it).
        commits_in_flight: background commits that may be queued at once (see [Note:
            background commits]); the disk holds that many commits' stale files at
            most. Default 1.

    Attributes:
        generation: the committed generation (0 until the first commit).
        scratch: entry -> kind -> file name of the scratch files written (see [Note:
            scratch files]); never in a manifest.
        files: entry -> kind -> file name of the current (committed or being written)
            generation; None for a kind not written yet.
        bytes_read / bytes_written: counters of payload bytes moved through this store.
        inflight_bytes / peak_inflight_bytes: bytes of writes in flight now / at most.
        io_seconds: wall-clock seconds during which at least one read or write of
            this store was running (its bytes over this: the rate of its I/O).
        busy_periods: the last :data:`BUSY_PERIODS` such periods as ``(start, end)``
            in ``time.time()`` seconds (comparable across processes: a benchmark joins
            the ranks' periods to see when the disk idled); see
            :meth:`take_busy_periods`.
        buffers: page-aligned read buffers kept warm for reuse, up to
            ``write_behind_bytes`` of free ones (none when it is 0).
        direct: False once the file system refused direct I/O.

    Raises:
        ValueError: for an unwritable directory, a directory that already holds a
            manifest when ``resume`` is False, or none when it is True.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        fmt: str,
        owned: re.Pattern[str],
        resume: bool,
        what: str = "offload_dir",
        holds: str = "a model",
        write_behind_bytes: int = 0,
        io_threads: int = 2,
        direct_io: bool = True,
        commits_in_flight: int = 1,
    ) -> None:
        if write_behind_bytes < 0 or io_threads < 1 or commits_in_flight < 1:
            raise ValueError(
                f"need write_behind_bytes >= 0, io_threads >= 1 and commits_in_flight >= 1, "
                f"got {write_behind_bytes}, {io_threads} and {commits_in_flight}"
            )
        self.directory = Path(directory)
        self.fmt = fmt
        self.owned = owned
        self.what = what
        self.generation = 0
        self.files: dict[str, dict[str, str | None]] = {}
        self.committed: dict[str, dict[str, str | None]] = {}
        # what the manifest on the disk names (committed runs ahead of it while a
        # background commit is in flight): never deleted, restored if that commit fails.
        # committed and durable are replaced, never changed in place (unlike files, which
        # name() edits), so they share their dicts
        self.durable_generation = 0
        self.durable: dict[str, dict[str, str | None]] = {}
        self.scratch: dict[str, dict[str, str]] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        self.write_behind_bytes = write_behind_bytes
        self.io_threads = io_threads
        self.direct = direct_io
        self.inflight_bytes = 0
        self.peak_inflight_bytes = 0
        self.io_seconds = 0.0
        self.buffers = AlignedBufferPool(write_behind_bytes)
        self._active = 0  # reads and writes running
        self._busy_since = 0.0
        self._busy_since_wall = 0.0
        self.busy_periods: deque[tuple[float, float]] = deque(maxlen=BUSY_PERIODS)
        self._pending: dict[str, Future[int]] = {}  # file name -> its write in flight
        self._commits: list[Future[None]] = []  # background commits, in order
        self._commit_failed = False  # sticky: later background commits refuse
        self._errors: list[BaseException] = []
        self._lock = threading.Condition()
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._directory_fd = -1  # flock-ed while a background commit is in flight
        self.commits_in_flight = commits_in_flight
        self._queued = 0  # background commits submitted and not ended (under _lock)
        check_writable(self.directory, what)
        wait_for_commit(self.directory)  # another model's (this or another process)
        has_manifest = (self.directory / MANIFEST).exists()
        if has_manifest and not resume:
            raise ValueError(
                f"{what} {str(self.directory)!r} already holds {holds}; pass "
                "resume=True to continue from it, or choose an empty directory"
            )
        if resume and not has_manifest:
            raise ValueError(
                f"resume=True but {what} {str(self.directory)!r} has no {MANIFEST}; "
                f"pass resume=False to start {holds} there"
            )

    def open(self) -> dict[str, Any]:
        """Read the committed manifest (generation and files); returns it whole, so the
        caller can check its own fields.

        Raises:
            ValueError: the manifest has another format.
        """
        manifest: dict[str, Any] = json.loads((self.directory / MANIFEST).read_text())
        if manifest.get("format") != self.fmt:
            raise ValueError(
                f"{MANIFEST} in {str(self.directory)!r} has format {manifest.get('format')!r}, "
                f"not {self.fmt!r}"
            )
        self.generation = int(manifest["generation"])
        self.files = manifest["files"]
        self.committed = {entry: dict(kinds) for entry, kinds in self.files.items()}
        self.durable_generation, self.durable = self.generation, self.committed
        return manifest

    def path(self, entry: str, kind: str) -> Path | None:
        """The current file of ``entry``'s ``kind`` (a generation's or a scratch file),
        or None if never written."""
        name = self.files.get(entry, {}).get(kind) or self.scratch.get(entry, {}).get(kind)
        return None if name is None else self.directory / name

    def write(self, entry: str, kind: str, generation: int, flat: torch.Tensor) -> int:
        """Write contiguous ``flat`` as generation ``generation`` of ``entry``'s ``kind``
        (atomic file; not committed) and wait for it; returns the bytes written."""
        return self._wait(self.write_async(entry, kind, generation, [flat]))

    def write_packed(
        self, entry: str, kind: str, generation: int, tensors: list[torch.Tensor]
    ) -> int:
        """Write contiguous ``tensors`` into one file at :func:`packed_offsets` (read it
        back with :meth:`read` into a ``uint8`` buffer and view each at its offset) and
        wait for it; returns the file's size in bytes."""
        return self._wait(self.write_async(entry, kind, generation, tensors))

    def _wait(self, future: Future[int]) -> int:
        """The result of a write waited for by its caller (its error raised there)."""
        try:
            return future.result()
        except BaseException:
            self._errors.clear()
            raise

    def write_async(
        self,
        entry: str,
        kind: str,
        generation: int,
        tensors: list[torch.Tensor],
        segments: tuple[list[Segment], int] | None = None,
        *,
        scratch: bool = False,
    ) -> Future[int]:
        """Start writing ``tensors`` (contiguous; packed at :func:`packed_offsets`) as
        generation ``generation`` of ``entry``'s ``kind`` on a background thread; the
        name is current at once (see [Note: write-behind]). Keep the tensors unchanged
        until the future is done.

        Args:
            entry, kind, generation: the file.
            tensors: its contents (device tensors are copied to the CPU first).
            segments: ``(segments, size)`` of the file instead of packing ``tensors``
                (then ``tensors`` only keeps their memory alive).
            scratch: write the scratch file ``<entry>.<kind>`` instead (``generation``
                ignored; see [Note: scratch files]). Default False.

        Returns:
            a future of the file's size in bytes.

        Raises:
            OSError: an earlier background write failed (its error, raised once: here or
                by :meth:`flush`).
        """
        self._raise_failed()
        name = f"{entry}.{kind}" if scratch else f"{entry}.{kind}.g{generation}"
        held = [t if t.device.type == "cpu" else t.cpu() for t in tensors]
        if segments is None:
            offsets, total = packed_offsets([t.numel() * t.element_size() for t in held])
            runs = segments_of([t.contiguous() for t in held], offsets)
        else:
            runs, total = segments
        with self._lock:
            while self.inflight_bytes and self.inflight_bytes + total > self.write_behind_bytes:
                self._lock.wait()
            self.inflight_bytes += total
            self.peak_inflight_bytes = max(self.peak_inflight_bytes, self.inflight_bytes)
        previous = self._pending.get(name)
        if previous is not None:
            previous.result()  # the same file rewritten: in order
        future = self._pool("write").submit(self._write_file, name, runs, total, held)
        self._pending[name] = future
        (self.scratch if scratch else self.files).setdefault(entry, {})[kind] = name
        self.bytes_written += total
        return future

    def _write_file(self, name: str, runs: list[Segment], total: int, held: object) -> int:
        self._io_started()
        try:
            used = write_file(self.directory / name, runs, total, direct=self.direct)
            self.direct = self.direct and used
            return total
        except BaseException as exc:
            self._errors.append(self._explained(exc, f"writing {name}"))
            raise
        finally:
            with self._lock:
                self.inflight_bytes -= total
                self._lock.notify_all()
            self._io_ended()

    def _io_started(self) -> None:
        with self._lock:
            if self._active == 0:
                self._busy_since, self._busy_since_wall = time.perf_counter(), time.time()
            self._active += 1

    def _io_ended(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self.io_seconds += time.perf_counter() - self._busy_since
                self.busy_periods.append((self._busy_since_wall, time.time()))

    def take_busy_periods(self) -> tuple[tuple[float, float], ...]:
        """The periods of I/O finished since the last call (``busy_periods``, emptied)."""
        with self._lock:
            periods = tuple(self.busy_periods)
            self.busy_periods.clear()
        return periods

    def _read_file(self, path: Path, flat: torch.Tensor) -> int:
        self._io_started()
        try:
            return read_file(path, flat, direct=self.direct)
        finally:
            self._io_ended()

    def _pool(self, which: str, threads: int | None = None) -> ThreadPoolExecutor:
        if which not in self._pools:
            self._pools[which] = ThreadPoolExecutor(
                threads or self.io_threads, thread_name_prefix=f"shardkit-{which}"
            )
        return self._pools[which]

    def _raise_failed(self) -> None:
        """Raise the first error of a background write (once), the committed generation
        being intact; the others are dropped with it."""
        if self._errors:
            error, self._errors = self._errors[0], []
            if self._commit_failed:  # the manifest on the disk is the committed one
                self.generation = self.durable_generation
                self.committed = self.durable
            raise error

    def flush(self) -> None:
        """Wait for every write in flight.

        Raises:
            OSError: a background write failed (its error, raised once).
        """
        for future in list(self._pending.values()):
            with contextlib.suppress(BaseException):
                future.result()
        self._pending.clear()
        self._drain_commits()
        self._raise_failed()

    def close(self) -> None:
        """Wait for the writes in flight and stop the background threads (idempotent)."""
        try:
            self.flush()
        finally:
            for pool in self._pools.values():
                pool.shutdown(wait=True)
            self._pools.clear()
            if self._directory_fd >= 0:
                os.close(self._directory_fd)
                self._directory_fd = -1

    def name(self, entry: str, kind: str, generation: int, suffix: str = "") -> str:
        """Record ``<entry>.<kind>.g<generation><suffix>`` as the current file of
        ``entry``'s ``kind`` (written by the caller) and return the name."""
        name = f"{entry}.{kind}.g{generation}{suffix}"
        self.files.setdefault(entry, {})[kind] = name
        return name

    def read(self, entry: str, kind: str, flat: torch.Tensor) -> int:
        """Fill contiguous ``flat`` from the current file of ``entry``'s ``kind`` (after
        its write, if one is in flight).

        Raises:
            KeyError: nothing was written for it.
            RuntimeError: the file is truncated.
        """
        path = self._readable(entry, kind)
        nbytes = self._read_file(path, flat)
        self.bytes_read += nbytes
        return nbytes

    def read_async(
        self, entry: str, kind: str, flat: torch.Tensor, then: Callable[[], Any] | None = None
    ) -> Future[int]:
        """Start filling ``flat`` from the current file of ``entry``'s ``kind`` on a
        background thread (the caller leaves ``flat`` alone until the future is done);
        ``then`` runs on that thread after the read.

        Raises:
            KeyError: nothing was written for it.
        """
        path = self.path(entry, kind)
        if path is None:
            raise KeyError(f"{self.directory}: no {kind} file for {entry}")
        pending = self._pending.get(path.name)  # waited for on the reading thread
        nbytes = flat.numel() * flat.element_size()
        self.bytes_read += nbytes

        def job() -> int:
            if pending is not None:
                pending.result()
            self._read_file(path, flat)
            if then is not None:
                then()
            return nbytes

        return self._pool("read").submit(job)

    def _readable(self, entry: str, kind: str) -> Path:
        """The current file of ``entry``'s ``kind``, its write (if in flight) waited."""
        path = self.path(entry, kind)
        if path is None:
            raise KeyError(f"{self.directory}: no {kind} file for {entry}")
        pending = self._pending.get(path.name)
        if pending is not None:
            pending.result()
        return path

    def remove_scratch(self, entry: str, kind: str) -> None:
        """Delete the scratch file of ``entry``'s ``kind`` (after its write, if one is in
        flight; see [Note: scratch files]); nothing if there is none.

        Raises:
            OSError: its write failed (the error raised here, once).
        """
        name = self.scratch.get(entry, {}).pop(kind, None)
        if name is None:
            return
        pending = self._pending.pop(name, None)
        if pending is not None:
            self._wait(pending)
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.directory / name)

    def written(self, entry: str) -> bool:
        """No write of ``entry``'s current files is in flight (a finished one's error is
        raised by :meth:`flush` or :meth:`commit`)."""
        kinds = self.files.get(entry, {}).values()
        return all(
            (f := self._pending.get(name)) is None or f.done() for name in kinds if name is not None
        )

    def commit(
        self,
        generation: int,
        keep: set[str] | None = None,
        entries: list[str] | None = None,
        background: bool = False,
        **extra: Any,
    ) -> None:
        """Make ``generation`` (the current files) the committed one with one atomic
        manifest rename, then delete the unreferenced files.

        Args:
            generation: the generation committed.
            keep: further file names (not in ``files``) to keep.
            entries: commit only these entries' current files (waiting for their
                writes), the others keeping their committed files: the per-entry
                commit of [Note: per-entry commits]. Default None: every entry.
            background: with ``entries``, do the waiting, the ``fsync``-s, the rename and
                the deletion of the entries' previous files on a background thread and
                return at once (see [Note: background commits]). Default False.
            extra: more JSON-able manifest fields (layouts, optimizer class, ...).

        Raises:
            OSError: a write of a committed file failed (nothing is committed), or an
                earlier background commit failed.
        """
        if entries is None:
            self._drain_commits()  # in order: the background commits first
            self.flush()  # every file of the generation is on the disk before the commit
            files = {entry: dict(kinds) for entry, kinds in self.files.items()}
            self._commit_text(generation, files, self._manifest_text(generation, files, extra))
            self.remove_unreferenced(keep or set())
            return
        # a background commit leaves the writes in the table, so that a read of the
        # entry waits for its write (flush clears the table)
        take = self._pending.get if background else self._pending.pop
        writes = [
            pending
            for entry in entries
            for name in self.files.get(entry, {}).values()
            if name is not None and (pending := take(name, None))
        ]
        self._raise_failed()
        files = {entry: dict(kinds) for entry, kinds in self.committed.items()}
        files.update({entry: dict(self.files[entry]) for entry in entries})
        stale = {
            name
            for entry in entries
            for kind, name in self.committed.get(entry, {}).items()
            if name is not None and name != files[entry].get(kind)
        } - (keep or set())
        text = self._manifest_text(generation, files, extra)  # a snapshot of the fields
        if not background:
            self._drain_commits()
            for write in writes:
                write.result()
            self._raise_failed()
            self._commit_text(generation, files, text)
            self.remove_unreferenced(keep or set())
            return
        self.generation, self.committed = generation, files
        # at most commits_in_flight queued: the disk holds that many commits' stale files
        self._drain_commits(keep=self.commits_in_flight - 1)
        # finished writes need no waiting: forget them (a caller that never flushes, the
        # tier committing every step in the background, would keep every step's)
        self._pending = {
            name: write
            for name, write in self._pending.items()
            if not write.done() or write.exception() is not None
        }
        if self._directory_fd < 0:
            self._directory_fd = os.open(self.directory, os.O_RDONLY)
        with self._lock:  # held from the first queued commit to the end of the last
            if self._queued == 0:
                fcntl.flock(self._directory_fd, fcntl.LOCK_EX)
            self._queued += 1
        job = functools.partial(self._commit_entries, writes, text, stale, generation, files)
        self._commits.append(self._pool("commit", threads=1).submit(job))

    # [Note: background commits]
    # A per-entry commit costs two directory fsyncs, a manifest fsync and the unlinks of
    # the entries' previous files: on the training thread, tenths of a second per entry
    # on a virtual disk, every unit of every step. With ``background=True`` one thread
    # does them, in submission order (each manifest names a superset of the previous
    # one's new files, so the last rename wins with the newest state), after waiting
    # for the entries' writes; at most ``commits_in_flight`` are queued (the next waits
    # for the oldest), so the files they have yet to delete are that many commits'. A
    # queued commit holds an exclusive ``flock`` of the directory (see
    # :func:`wait_for_commit`) until the last one queued ended. The manifest's text is
    # made on the caller's thread (a snapshot of fields the caller goes on changing).
    # What a crash leaves is unchanged:
    # a file is deleted only after a manifest not naming it was renamed into place. An
    # error is raised by the next write, flush or commit; a full commit, a flush and
    # ``close`` wait for the commits in flight.
    def _commit_entries(
        self,
        writes: list[Future[int]],
        text: str,
        stale: set[str],
        generation: int,
        files: dict[str, dict[str, str | None]],
    ) -> None:
        try:
            if self._commit_failed:  # its manifest would name files an earlier one lost
                raise RuntimeError(f"{self.directory}: an earlier background commit failed")
            for write in writes:
                write.result()
            self._rename_manifest(text)
            self.durable_generation, self.durable = generation, files
            for name in stale:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.directory / name)
        except BaseException as exc:
            self._commit_failed = True
            self._errors.append(self._explained(exc, f"committing generation {generation}"))
            raise
        finally:
            with self._lock:
                self._queued -= 1
                if self._queued == 0:
                    fcntl.flock(self._directory_fd, fcntl.LOCK_UN)

    def _explained(self, exc: BaseException, doing: str) -> BaseException:
        """A background ``OSError`` (a full disk) with where it happened and what survives
        (the same errno, ``exc`` its cause); other errors as they are."""
        if not isinstance(exc, OSError) or exc.errno is None:
            return exc
        explained = OSError(
            exc.errno,
            f"{exc.strerror} ({self.directory}: {doing} on a background thread; the "
            f"manifest on the disk names generation {self.durable_generation}, whole: "
            "reopen with resume=True)",
        )
        explained.__cause__ = exc
        return explained

    def _drain_commits(self, keep: int = 0) -> None:
        """Wait for the background commits but the last ``keep`` (their errors are
        raised by the caller)."""
        waited = self._commits[: max(len(self._commits) - keep, 0)]
        for commit in waited:
            with contextlib.suppress(BaseException):
                commit.result()
        self._commits = self._commits[len(waited) :]

    def _manifest_text(self, generation: int, files: dict[str, Any], extra: dict[str, Any]) -> str:
        manifest = {"format": self.fmt, "generation": generation, "files": files, **extra}
        return json.dumps(manifest, indent=1)

    def _rename_manifest(self, text: str) -> None:
        """The commit point: the files' renames on the disk, then ``text`` as the manifest."""
        fsync_dir(self.directory)
        with atomic_write(self.directory / MANIFEST, "w") as handle:
            handle.write(text)

    def _commit_text(self, generation: int, files: dict[str, Any], text: str) -> None:
        self._rename_manifest(text)
        self.generation = self.durable_generation = generation
        self.committed = self.durable = files

    def remove_unreferenced(self, keep: set[str]) -> None:
        """Delete owned files that the current files, the committed ones, the scratch
        files and ``keep`` do not name, and the temporary files of interrupted writes
        (``.<name>.<random>.tmp`` of an owned name or of the manifest; see [Note:
        temporary files]), except those of a write or commit still in flight."""
        wanted = {MANIFEST, *keep}
        for kinds in [*self.files.values(), *self.committed.values(), *self.durable.values()]:
            wanted.update(f for f in kinds.values() if f is not None)
        for scratch in self.scratch.values():
            wanted.update(scratch.values())
        for entry in os.listdir(self.directory):
            temporary = _TEMPORARY.match(entry)
            if temporary is not None:
                remove = self._abandoned(temporary["name"])
            else:
                remove = bool(self.owned.match(entry)) and entry not in wanted
            if remove:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.directory / entry)

    # [Note: temporary files]
    # Every file is written to ``.<name>.<random>.tmp`` beside ``<name>`` and renamed
    # over it (atomic_write, direct_io.write_file); a write that fails removes its
    # temporary file, but a killed process leaves it. The owned pattern describes the
    # final names (it may end with ``$``), so a temporary file is matched by the name
    # inside it. It is left alone while its write is in flight (the name has a pending
    # write, or for the manifest a background commit runs): the rename would fail.
    def _abandoned(self, name: str) -> bool:
        """Whether a temporary file of ``name`` belongs to no write in flight."""
        if name == MANIFEST:
            return all(commit.done() for commit in self._commits)
        pending = self._pending.get(name)
        return bool(self.owned.match(name)) and (pending is None or pending.done())


_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.[^.]+\.tmp$")  # tempfile.mkstemp's names
