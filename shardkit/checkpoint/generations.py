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
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from shardkit.checkpoint.atomic import atomic_write

__all__ = [
    "ALIGN",
    "MANIFEST",
    "GenerationStore",
    "check_writable",
    "packed_offsets",
    "read_into",
    "write_tensor",
]

MANIFEST = "manifest.json"
ALIGN = 64  # bytes: every tensor of a packed file starts at a multiple of this


def packed_offsets(nbytes: list[int]) -> tuple[list[int], int]:
    """Byte offsets of tensors of ``nbytes`` bytes packed one after the other, each
    starting at a multiple of :data:`ALIGN`, and the file's size (no trailing padding)."""
    offsets, end = [], 0
    for n in nbytes:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + n
    return offsets, end


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
            hold other files); so may the temporary files of an interrupted write of
            one of them (``.<name>.<random>.tmp``).
        resume: False: the directory must hold no manifest yet. True: it must; open it
            with :meth:`open`.
        what: the argument naming the directory, for messages. Default ``"offload_dir"``.
        holds: what a manifest means there, for messages. Default ``"a model"``.

    Attributes:
        generation: the committed generation (0 until the first commit).
        files: entry -> kind -> file name of the current (committed or being written)
            generation; None for a kind not written yet.
        bytes_read / bytes_written: counters of payload bytes moved through this store.

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
    ) -> None:
        self.directory = Path(directory)
        self.fmt = fmt
        self.owned = owned
        self.what = what
        self.generation = 0
        self.files: dict[str, dict[str, str | None]] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        check_writable(self.directory, what)
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
        return manifest

    def path(self, entry: str, kind: str) -> Path | None:
        """The current file of ``entry``'s ``kind``, or None if never written."""
        name = self.files.get(entry, {}).get(kind)
        return None if name is None else self.directory / name

    def write(self, entry: str, kind: str, generation: int, flat: torch.Tensor) -> int:
        """Write contiguous ``flat`` as generation ``generation`` of ``entry``'s ``kind``
        (atomic file; not committed); returns the bytes written."""
        name = f"{entry}.{kind}.g{generation}"
        with atomic_write(self.directory / name) as handle:
            nbytes = write_tensor(handle, flat)
        self.files.setdefault(entry, {})[kind] = name
        self.bytes_written += nbytes
        return nbytes

    def write_packed(
        self, entry: str, kind: str, generation: int, tensors: list[torch.Tensor]
    ) -> int:
        """Write contiguous ``tensors`` into one file at :func:`packed_offsets` (read it
        back with :meth:`read` into a ``uint8`` buffer and view each at its offset);
        returns the file's size in bytes."""
        name = f"{entry}.{kind}.g{generation}"
        offsets, total = packed_offsets([t.numel() * t.element_size() for t in tensors])
        with atomic_write(self.directory / name) as handle:
            end = 0
            for offset, tensor in zip(offsets, tensors, strict=True):
                handle.write(bytes(offset - end))
                end = offset + write_tensor(handle, tensor)
        self.files.setdefault(entry, {})[kind] = name
        self.bytes_written += total
        return total

    def name(self, entry: str, kind: str, generation: int, suffix: str = "") -> str:
        """Record ``<entry>.<kind>.g<generation><suffix>`` as the current file of
        ``entry``'s ``kind`` (written by the caller) and return the name."""
        name = f"{entry}.{kind}.g{generation}{suffix}"
        self.files.setdefault(entry, {})[kind] = name
        return name

    def read(self, entry: str, kind: str, flat: torch.Tensor) -> int:
        """Fill contiguous ``flat`` from the current file of ``entry``'s ``kind``.

        Raises:
            KeyError: nothing was written for it.
            RuntimeError: the file is truncated.
        """
        path = self.path(entry, kind)
        if path is None:
            raise KeyError(f"{self.directory}: no {kind} file for {entry}")
        nbytes = read_into(path, flat)
        self.bytes_read += nbytes
        return nbytes

    def commit(self, generation: int, keep: set[str] | None = None, **extra: Any) -> None:
        """Make ``generation`` (the current files) the committed one with one atomic
        manifest rename, then delete the unreferenced files.

        Args:
            generation: the generation committed.
            keep: further file names (not in ``files``) to keep.
            extra: more JSON-able manifest fields (layouts, optimizer class, ...).
        """
        manifest = {"format": self.fmt, "generation": generation, "files": self.files, **extra}
        with atomic_write(self.directory / MANIFEST, "w") as handle:
            json.dump(manifest, handle, indent=1)
        self.generation = generation
        self.remove_unreferenced(keep or set())

    def remove_unreferenced(self, keep: set[str]) -> None:
        """Delete owned files that the current files and ``keep`` do not name."""
        wanted = {MANIFEST, *keep}
        for kinds in self.files.values():
            wanted.update(f for f in kinds.values() if f is not None)
        for entry in os.listdir(self.directory):
            temporary = entry.endswith(".tmp") and (
                entry.startswith(f".{MANIFEST}.") or bool(self.owned.match(entry[1:]))
            )
            if (temporary or self.owned.match(entry)) and entry not in wanted:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.directory / entry)
