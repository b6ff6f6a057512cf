"""Atomic file writes: a crash mid-save leaves the previous file intact.

The payload is written to a temporary file in the same directory, flushed and
``fsync``-ed, then moved over the destination with ``os.replace`` (atomic on POSIX and
Windows within one filesystem), and the directory entry is ``fsync``-ed. A reader sees
either the old file or the new one, never a half-written one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import torch

__all__ = ["atomic_save", "atomic_write", "atomic_write_bytes", "fsync_dir"]

PathLike = str | os.PathLike[str]


def fsync_dir(directory: PathLike) -> None:
    """``fsync`` the directory ``directory`` (POSIX; a no-op elsewhere), so that a
    rename inside it survives a power loss."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path``; on clean exit move it over ``path``.

    If the body raises, the temporary file is removed and ``path`` is untouched.

    Args:
        path: the destination file; its parent directory must exist.
        mode: ``"wb"`` (default) or ``"w"`` for text.

    Raises:
        FileNotFoundError: if the parent directory does not exist.
        PermissionError: if the directory is not writable.
    """
    dest = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write`)."""
    with atomic_write(path, "wb") as handle:
        handle.write(data)


def atomic_save(obj: Any, path: PathLike, *, save: Callable[[Any, Any], None] = torch.save) -> None:
    """``torch.save(obj, path)``, atomically: the old file survives a crash mid-save.

    Args:
        obj: anything ``torch.save`` accepts (state dicts, tensors, plain Python).
        path: destination file; its parent directory must exist.
        save: the serializer, called as ``save(obj, file_handle)``; default ``torch.save``.
    """
    with atomic_write(path, "wb") as handle:
        save(obj, handle)
