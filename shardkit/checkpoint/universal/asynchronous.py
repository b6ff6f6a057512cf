"""Asynchronous universal checkpoints: copy at the step boundary, write in the background.

[Note: an asynchronous save]
:meth:`AsyncCheckpointer.save` is the first half of
:func:`~shardkit.checkpoint.universal.save_universal`, run in the caller's thread at a
step boundary (a collective over the training ``group``): the adapter lists this
rank's pieces, every piece is copied into the checkpointer's
:class:`~shardkit.checkpoint.universal.staging.StagingBuffer` (host memory, reused
between saves), the ranks all-gather and check what each will write (so a bad layout
or an ``extra`` that would not load fails there, on every rank, as in a synchronous
save), and the adapter's session is left. It then returns, and training continues:
the next optimizer step rewrites the parameters, never the copies.

A background thread does the second half (:func:`.writer.commit_save`, i.e.
:func:`~shardkit.checkpoint.manifest.save_checkpoint`): write the files atomically,
hash them (sha256), exchange the records, and let rank 0 write the manifest and move
``latest``: the same files, manifest, commit order and crash-safety as a synchronous
save. A SIGKILL at any point of it leaves ``latest`` naming the previous committed
checkpoint (the new one is only a staging directory ``ckpt-<step>.new``, deleted by
the next save).

[Note: the commit's agreement runs on a group of its own]
The commit is a collective (a broadcast of rank 0's staging directory, an all-gather
of the files' records, a broadcast of the outcome). Run on the training group from a
second thread, those would interleave with the training step's collectives in an
order that differs between ranks: a deadlock or a mismatched collective. So the
checkpointer creates, once, at construction, a gloo process group of the same ranks
(``dist.new_group(ranks, backend="gloo")``), used only by its background thread.
Each process group has its own connections and its own order of collectives, so the
training step's all-reduces (gloo or NCCL) neither wait for nor are ordered with the
commit; the commit group's collectives are issued by one thread, one save at a time,
in the same order on every rank. A store-based agreement (ranks polling keys) would
have been a second implementation of :mod:`shardkit.checkpoint.agreement`; the group
reuses it as it is. torchtitan's async checkpointing makes the same choice (a gloo
group for the background save).

[Note: one save in flight, errors at the next call]
A save requested while the previous one is still being written *waits* for it
(nothing is skipped: every requested step is committed; the wait is counted in the
caller's step, and :attr:`AsyncSave.waited_s` says how long it was). The staging
buffer is reused only after that. A background failure (a full disk on one rank, an
unwritable directory) ends the commit on every rank with the same
:class:`~shardkit.checkpoint.manifest.CheckpointError` (the agreement of
:func:`~shardkit.checkpoint.manifest.save_checkpoint`); it is raised by the next call
into the checkpointer (:meth:`AsyncCheckpointer.save`, :meth:`~AsyncCheckpointer.wait`,
:meth:`~AsyncCheckpointer.close`), which every rank makes at the same step, so every
rank raises there. At process exit, a save still in flight is waited for (an
``atexit`` hook; the thread is not a daemon either); call :meth:`close` before
``destroy_process_group``, since the commit needs its process group.

Source: torch.distributed.checkpoint ``async_save`` (a staging copy, then a
background write) and torchtitan's ``AsyncMode.ASYNC`` checkpointing.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardkit.checkpoint.manifest import checkpoint_name
from shardkit.checkpoint.universal.staging import StagingBuffer
from shardkit.checkpoint.universal.writer import PathLike, PreparedSave, commit_save, prepare_save
from shardkit.distributed.collectives import group_timeout, new_group

__all__ = ["AsyncCheckpointer", "AsyncSave"]


class AsyncSave:
    """The handle of one asynchronous save (see [Note: an asynchronous save]).

    Attributes:
        step: the training step saved.
        path: the checkpoint directory it commits, ``root/ckpt-<step>``.
        waited_s: seconds :meth:`AsyncCheckpointer.save` waited for the previous save
            to finish before this one started (0.0 when none was in flight).
        staged_s: seconds the caller was blocked building, copying and checking the
            pieces (the step boundary's cost, after the wait).
        written_s: seconds the background thread took to write, hash and commit;
            None until it finished.
    """

    def __init__(self, step: int, path: Path, waited_s: float, staged_s: float) -> None:
        self.step, self.path = step, path
        self.waited_s, self.staged_s = waited_s, staged_s
        self.written_s: float | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.reported = False  # its error was raised to the caller already

    def done(self) -> bool:
        """Whether the background write finished (committed or failed)."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Path:
        """Wait for the commit; the checkpoint directory.

        Args:
            timeout: seconds to wait; default None: until it finished.

        Raises:
            TimeoutError: still writing after ``timeout`` seconds.
            CheckpointError: the save failed (on every rank alike; see
                :func:`~shardkit.checkpoint.universal.save_universal`).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"the save of {self.path} is still being written after {timeout} s; "
                "call result() again or without a timeout"
            )
        if self._error is not None:
            self.reported = True
            raise self._error
        return self.path

    def _finish(self, error: BaseException | None, written_s: float) -> None:
        self._error, self.written_s = error, written_s
        self._done.set()


class AsyncCheckpointer:
    """Universal checkpoints written in the background while training continues.

    Example::

        checkpointer = AsyncCheckpointer()            # collective: every rank, once
        for step in range(1, steps + 1):
            train_step()
            if step % 10 == 0:                        # collective: every rank
                checkpointer.save(root, step, model, optimizer, extra=..., keep=2)
        checkpointer.close()                          # waits for the last commit

    :meth:`save` returns once this rank's pieces are copied to host memory (see
    [Note: an asynchronous save]); the checkpoint is the same as
    :func:`~shardkit.checkpoint.universal.save_universal`'s, committed by a background
    thread on a gloo group of its own (see [Note: the commit's agreement runs on a
    group of its own]). At most one save is in flight; a background error is raised by
    the next call on every rank (see [Note: one save in flight, errors at the next
    call]).

    Args:
        group: the training process group the saves are collectives over; default
            None: the world group (one rank when no process group is initialised).
        timeout: the commit group's collective timeout; default None: ``group``'s
            (the default group's when ``group`` is None).

    Construction is a collective over the *world* (``dist.new_group``: every process
    calls it, in the same order as its other ``new_group`` calls), when a process
    group is initialised.

    Memory: one host copy of the bytes this rank writes (its pieces of the parameters,
    buffers and optimizer state), kept between saves (:attr:`staging_bytes`).
    """

    def __init__(
        self, group: dist.ProcessGroup | None = None, *, timeout: timedelta | None = None
    ) -> None:
        self.group = group
        self.commit_group = _commit_group(group, timeout)
        self.staging = StagingBuffer()
        self._inflight: AsyncSave | None = None
        self._thread: threading.Thread | None = None
        _LIVE.add(self)

    @property
    def staging_bytes(self) -> int:
        """Bytes of host memory the staging buffer holds (0 before the first save)."""
        return self.staging.nbytes

    @property
    def in_flight(self) -> AsyncSave | None:
        """The save being written, or None."""
        save = self._inflight
        return None if save is None or save.done() else save

    def save(
        self,
        root: PathLike,
        step: int,
        model: Any,
        optimizer: Any = None,
        *,
        extra: Mapping[str, Any] | None = None,
        keep: int = 0,
    ) -> AsyncSave:
        """Start saving ``model`` (and ``optimizer``) as the universal checkpoint
        ``root/ckpt-<step>``; returns when this rank's state is copied.

        A collective over :attr:`group`: every rank calls it at the same step. Waits
        first for the previous save, if one is still in flight. Arguments as in
        :func:`~shardkit.checkpoint.universal.save_universal`; the model and optimizer
        may change as soon as this returns.

        Returns:
            The save's :class:`AsyncSave` (``result()`` waits for the commit).

        Raises:
            CheckpointError: the previous save failed in the background (on every
                rank, naming the failing rank; this save is not started).
            ValueError, TypeError, CheckpointError: this save's pieces or ``extra``
                are invalid, or copying them failed (on every rank, before anything
                is written; see ``save_universal``).
        """
        start = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - start
        with contextlib.ExitStack() as session:
            prepared = prepare_save(
                session,
                root,
                step,
                model,
                optimizer,
                extra=extra,
                group=self.group,
                stage=self.staging.stage,
            )
        handle = AsyncSave(step, Path(root) / checkpoint_name(step), waited, 0.0)
        handle.staged_s = time.perf_counter() - start - waited
        thread = threading.Thread(
            target=self._commit, args=(prepared, keep, handle), name=f"shardkit-save-{step}"
        )
        self._inflight, self._thread = handle, thread
        thread.start()
        return handle

    def _commit(self, prepared: PreparedSave, keep: int, handle: AsyncSave) -> None:
        """The background thread: write, hash, commit (see [Note: an asynchronous save])."""
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            commit_save(prepared, keep=keep, group=self.commit_group)
        except BaseException as err:  # kept for the next call on this rank
            error = err
        handle._finish(error, time.perf_counter() - start)

    def wait(self) -> Path | None:
        """Wait for the save in flight, if any; its checkpoint directory, or None.

        Raises:
            CheckpointError: that save failed in the background (raised once: by the
                first call that sees it, or by its ``AsyncSave.result()``).
        """
        thread, handle = self._thread, self._inflight
        if thread is not None:
            thread.join()
        self._thread = self._inflight = None
        if handle is None or handle.reported:
            return None
        return handle.result()

    def close(self) -> Path | None:
        """:meth:`wait`, then release the staging buffer; the checkpointer may save
        again (it allocates a new buffer). Call it before ``destroy_process_group``.

        Raises:
            CheckpointError: as :meth:`wait`.
        """
        try:
            return self.wait()
        finally:
            self.staging = StagingBuffer()


def _commit_group(
    group: dist.ProcessGroup | None, timeout: timedelta | None
) -> dist.ProcessGroup | None:
    """A gloo group of ``group``'s ranks for the background commit (see [Note: the
    commit's agreement runs on a group of its own]); None without a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    ranks = None if group is None else dist.get_process_group_ranks(group)
    # default: the timeout of the group it serves (torch's own default is 30 minutes)
    return new_group(ranks, backend="gloo", timeout=timeout or group_timeout(group))


_LIVE: weakref.WeakSet[AsyncCheckpointer] = weakref.WeakSet()


def _wait_at_exit() -> None:
    """Wait for every save in flight at interpreter exit; a failure is printed (one
    line per save) since no caller is left to raise it to."""
    for checkpointer in list(_LIVE):
        try:
            checkpointer.wait()
        except Exception as err:
            print(f"shardkit: asynchronous checkpoint failed at exit: {err}", file=sys.stderr)


atexit.register(_wait_at_exit)
