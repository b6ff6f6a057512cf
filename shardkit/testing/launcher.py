"""Run a function on N spawned ranks with a process group, and get each rank's result.

Two entry points:

- :func:`run_distributed` spawns a group, runs one function on every rank, returns the
  per-rank results and tears the group down.
- :class:`RankPool` keeps a spawned group alive so that many functions (many test
  configurations) run inside it: start-up (``import torch`` and process-group
  initialisation) costs seconds per spawn on a 2-core machine, so tests share one
  pool per world size.

[Note: failure handling]
Each rank reports through a queue: its status ("ok" or the formatted traceback), and
its result is written with ``torch.save`` to a per-rank file (results may hold
tensors; a file outlives the sender, a shared-memory tensor on a queue does not).
The parent waits on the queue until every rank has reported or the deadline passes.
A rank that raised fails the call with :class:`RankError` naming the rank and its
traceback; ranks still waiting in a collective are then given ``grace_s`` seconds and
killed, and the pool restarts on its next use. A deadline that passes with ranks
silent kills every rank and raises :class:`RankTimeoutError` naming the silent ranks.
A rank that dies without reporting (a signal, ``os._exit``) is detected from its exit
code. No child outlives the call that failed.

[Note: prompt rank exit]
A rank told to stop leaves its process group, runs its ``atexit`` handlers, flushes its
report queue and standard streams, and ends with ``os._exit``: the interpreter's own
teardown with torch loaded (freeing every module, C++ static destructors) took 0.7 to
2.5 s per group on the 2-core CI machine, paid by every :func:`run_distributed` call and
every pool closed, and it does nothing a finished rank needs. Threads a task left running
end with the rank, as they would at any other exit of a daemon process.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue as queue_mod
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankError", "RankPool", "RankTimeoutError", "run_distributed"]

_POLL_S = 0.05
_START_TIMEOUT_S = 120.0


class RankError(RuntimeError):
    """A rank raised (or died) while running a distributed function.

    Attributes:
        rank: the first rank that failed.
        remote_traceback: the rank's formatted traceback (or its exit code).
        all_reported: True when every rank finished (so the pool stays usable).
    """

    def __init__(
        self, rank: int, remote_traceback: str, what: str = "", all_reported: bool = False
    ) -> None:
        self.rank = rank
        self.all_reported = all_reported
        self.remote_traceback = remote_traceback
        label = f" in {what}" if what else ""
        super().__init__(f"rank {rank} failed{label}:\n{remote_traceback}")


class RankTimeoutError(TimeoutError):
    """Some ranks did not finish within the timeout (a hang); they were killed.

    Attributes:
        ranks: the ranks that had not reported.
        timeout_s: the timeout that passed, in seconds.
    """

    def __init__(self, ranks: Sequence[int], timeout_s: float, what: str = "") -> None:
        self.ranks = list(ranks)
        self.timeout_s = timeout_s
        label = f" running {what}" if what else ""
        super().__init__(
            f"ranks {self.ranks} did not finish within {timeout_s:.1f} s{label} "
            "(a hang: a collective one rank skipped, or a dead peer); all ranks were killed"
        )


def _seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional
        pass


def _set_collective_timeout(seconds: float) -> None:
    """Give the default group's collectives their own timeout after start-up."""
    from torch.distributed import distributed_c10d

    setter = getattr(distributed_c10d, "_set_pg_timeout", None)
    if setter is not None:  # private in torch 2.13; without it the start-up timeout stays
        setter(timedelta(seconds=seconds))


def _bind_device(backend: str, rank: int) -> torch.device | None:
    """With NCCL, make ``cuda:(rank % device count)`` this rank's current device (NCCL
    needs one device per rank, chosen before the group's first collective); with other
    backends change nothing. Returns the device bound, or None.

    Raises:
        RuntimeError: NCCL was asked for where CUDA is not available.
    """
    if "nccl" not in backend.lower():
        return None
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"backend {backend!r} needs CUDA, which is not available on this machine; "
            'use backend="gloo" (CPU)'
        )
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _worker_main(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str,
    pg_timeout_s: float,
    num_threads: int | None,
    tasks: Any,
    reports: Any,
    result_dir: str,
) -> None:
    """Body of one rank: init the process group, run tasks until told to stop, then end
    the process at once (see [Note: prompt rank exit])."""
    exit_code = 0
    try:
        _serve(
            rank,
            world_size,
            init_method,
            backend,
            pg_timeout_s,
            num_threads,
            tasks,
            reports,
            result_dir,
        )
    except BaseException:  # e.g. the parent went away while this rank waited for a task
        traceback.print_exc()
        exit_code = 1
    _exit_now(reports, exit_code)


def _exit_now(reports: Any, exit_code: int) -> None:
    """End this rank's process without the interpreter's teardown: run the ``atexit``
    handlers, deliver every report still buffered, flush the streams, ``os._exit``."""
    try:
        atexit._run_exitfuncs()
        reports.close()
        reports.join_thread()  # the queue's feeder thread has written every report
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(exit_code)


def _serve(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str,
    pg_timeout_s: float,
    num_threads: int | None,
    tasks: Any,
    reports: Any,
    result_dir: str,
) -> None:
    """Init the process group, then run tasks until a ``None`` task arrives."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    try:
        _bind_device(backend, rank)
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            # Start-up on a loaded machine may take longer than a short task timeout.
            timeout=timedelta(seconds=max(_START_TIMEOUT_S, pg_timeout_s)),
        )
        _set_collective_timeout(pg_timeout_s)
    except BaseException:
        reports.put((rank, -1, "error", traceback.format_exc()))
        return
    reports.put((rank, -1, "ready", ""))
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            task_id, fn, args, kwargs, seed = task
            _seed_everything(seed)
            try:
                result = fn(*args, **kwargs)
                path = os.path.join(result_dir, f"task{task_id}-rank{rank}.pt")
                torch.save(result, path + ".tmp")
                os.replace(path + ".tmp", path)
                reports.put((rank, task_id, "ok", path))
            except BaseException:
                reports.put((rank, task_id, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankPool:
    """A group of ``world_size`` spawned ranks that runs functions on demand.

    Example:
        >>> def total(x):
        ...     t = torch.tensor([float(x + dist.get_rank())])
        ...     dist.all_reduce(t)
        ...     return t.item()
        >>> with RankPool(2) as pool:          # doctest: +SKIP
        ...     pool.run(total, 1)             # [3.0, 3.0]

    Args:
        world_size: number of ranks (>= 1).
        backend: process-group backend; default ``"gloo"`` (CPU). With ``"nccl"``
            (CUDA), rank r's current device is ``cuda:(r % torch.cuda.device_count())``
            before the group starts; NCCL needs as many GPUs as ranks.
        timeout_s: the process group's collective timeout, in seconds: a collective
            that waits longer fails on its rank with an error naming the operation. A
            :meth:`run` still silent after ``timeout_s + grace_s`` is declared a hang and
            every rank is killed. Start-up is not counted. Default 120.
        num_threads: ``torch.set_num_threads`` in each rank; default 1 so ranks do not
            fight over cores. None leaves torch's default.
        grace_s: after one rank fails, seconds to wait for the others before killing
            them. Default 5.

    Functions passed to :meth:`run` must be picklable (defined at module top level).
    Each rank sees ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` in its environment and a
    default process group (``torch.distributed`` is initialised).
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout_s: float = 120.0,
        num_threads: int | None = 1,
        grace_s: float = 5.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1; got {world_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds; got {timeout_s}")
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.num_threads = num_threads
        self.grace_s = grace_s
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._reports: Any = None
        self._tmpdir: str | None = None
        self._next_task = 0

    # lifecycle -----------------------------------------------------------------
    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.mkdtemp(prefix="shardkit-ranks-")
        init_method = "file://" + os.path.join(self._tmpdir, "store")
        self._reports = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = []
        for rank in range(self.world_size):
            proc = ctx.Process(
                target=_worker_main,
                args=(
                    rank,
                    self.world_size,
                    init_method,
                    self.backend,
                    self.timeout_s,
                    self.num_threads,
                    self._tasks[rank],
                    self._reports,
                    self._tmpdir,
                ),
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
        try:
            self._wait_ready()
        except BaseException:
            self._kill()
            raise

    def _wait_ready(self) -> None:
        """Wait for every rank to join the process group (start-up is not charged to a
        task's timeout: it takes seconds per rank on a loaded 2-core machine)."""
        ready: set[int] = set()
        deadline = time.monotonic() + max(_START_TIMEOUT_S, self.timeout_s)
        while len(ready) < self.world_size:
            if time.monotonic() > deadline:
                silent = [r for r in range(self.world_size) if r not in ready]
                raise RankTimeoutError(silent, _START_TIMEOUT_S, "process-group start-up")
            try:
                rank, _, status, payload = self._reports.get(timeout=_POLL_S)
            except queue_mod.Empty:
                died = self._dead_rank(dict.fromkeys(ready, ""))
                if died is not None:
                    raise RankError(*died, what="process-group start-up") from None
                continue
            if status != "ready":
                raise RankError(rank, payload, what="process-group start-up")
            ready.add(rank)

    def close(self) -> None:
        """Stop every rank (politely, then by force) and remove the temporary files."""
        for q in self._tasks:
            with contextlib.suppress(OSError, ValueError):
                q.put(None)
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5.0)
        for q in [*self._tasks, self._reports]:
            if q is not None:
                q.cancel_join_thread()
                q.close()
        self._procs, self._tasks, self._reports = [], [], None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # running -------------------------------------------------------------------
    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        seed: int = 0,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Args:
            fn: a picklable (top-level) function; its return value must be picklable
                by ``torch.save``.
            seed: every rank seeds ``random``, numpy and torch with this value before
                ``fn`` runs (the same on every rank, so models built inside ``fn`` start
                identical). Default 0.
            timeout_s: override the pool's timeout for this call, in seconds.

        Raises:
            RankError: a rank raised or died; names the rank and has its traceback.
            RankTimeoutError: ranks were silent past the timeout; names them.
        """
        if not self._procs:
            self._start()
        what = getattr(fn, "__qualname__", repr(fn))
        task_id = self._next_task
        self._next_task += 1
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs, seed))
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            paths = self._collect(task_id, limit, what)
        except RankError as err:
            if not err.all_reported:
                self._kill()
            raise
        except BaseException:
            self._kill()
            raise
        results = [torch.load(p, weights_only=False) for p in paths]
        for p in paths:
            os.remove(p)
        return results

    def _collect(self, task_id: int, limit: float, what: str) -> list[str]:
        paths: dict[int, str] = {}
        errors: dict[int, str] = {}
        dead: list[int] = []
        # The process group's own timeout (``limit``) fires first in a stuck collective
        # and names the operation; the harness deadline is the backstop for other hangs.
        deadline = time.monotonic() + limit + self.grace_s
        while len(paths) + len(errors) < self.world_size:
            if time.monotonic() > deadline:
                if errors:
                    raise _first_failure(errors, dead, what, all_reported=False)
                silent = [r for r in range(self.world_size) if r not in paths]
                raise RankTimeoutError(silent, limit, what)
            try:
                rank, tid, status, payload = self._reports.get(timeout=_POLL_S)
            except queue_mod.Empty:
                died = self._dead_rank({**paths, **errors})
                if died is not None:
                    dead.append(died[0])
                    errors[died[0]] = died[1]
                    deadline = min(deadline, time.monotonic() + self.grace_s)
                continue
            if tid not in (task_id, -1):
                continue  # a stale report from an earlier, abandoned task
            if status == "ok":
                paths[rank] = payload
            else:
                errors[rank] = payload
                deadline = min(deadline, time.monotonic() + self.grace_s)
        if errors:
            for p in paths.values():
                os.remove(p)
            # Every rank reported: the group is consistent and can run the next task.
            raise _first_failure(errors, dead, what, all_reported=not dead)
        return [paths[r] for r in range(self.world_size)]

    def _dead_rank(self, reported: dict[int, str]) -> tuple[int, str] | None:
        for rank, proc in enumerate(self._procs):
            if rank not in reported and not proc.is_alive():
                return rank, f"process exited with code {proc.exitcode} without reporting"
        return None


def _first_failure(
    errors: dict[int, str], dead: list[int], what: str, all_reported: bool
) -> RankError:
    """The likely root cause: a rank that died (its peers' errors follow from it), else
    the first rank to report an error."""
    rank = dead[0] if dead else next(iter(errors))
    others = sorted(set(errors) - {rank})
    text = errors[rank] + (f"\n(ranks {others} also failed)" if others else "")
    return RankError(rank, text, what=what, all_reported=all_reported)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    num_threads: int | None = 1,
    seed: int = 0,
    **kwargs: Any,
) -> list[Any]:
    """Spawn ``world_size`` ranks, run ``fn(*args, **kwargs)`` on each, return the results.

    A one-shot :class:`RankPool`: see there for the arguments, the errors raised
    (:class:`RankError`, :class:`RankTimeoutError`) and the environment each rank sees.
    To run many configurations without paying start-up each time, keep a
    :class:`RankPool` or loop over the configurations inside ``fn``.
    """
    with RankPool(
        world_size, backend=backend, timeout_s=timeout_s, num_threads=num_threads
    ) as pool:
        return pool.run(fn, *args, seed=seed, **kwargs)
