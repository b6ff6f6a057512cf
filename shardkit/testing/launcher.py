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

[Note: a hang shows its stacks]
Each rank registers ``faulthandler`` on SIGUSR1 at start-up, writing every thread's
Python stack to a file of its own. Before the ranks of a timed-out call are killed, the
parent signals the silent ones and puts what they wrote in the
:class:`RankTimeoutError` (``.stacks``, and its message): the line each rank is stuck
on, also inside a collective's C++ wait. A call whose ranks have partly reported and
partly stayed silent for ``straggler_s`` seconds (a rank that skipped a collective
returns while its peer waits in it) warns once, with the silent ranks' stacks, long
before the timeout.

[Note: ranks forked from a server with torch imported]
Ranks start from multiprocessing's fork server (spawned where there is none), which
imports ``_PRELOAD`` (torch; shardkit's wrappers, by name only: this module still
imports no wrapper) once and forks a fresh single-threaded process per rank: a group
starts in about 0.1 s instead of paying those imports in every rank (3 to 6 s per group).
As with spawn, a rank gets the parent's working directory, ``sys.path``, main module
and environment as they are when the group starts (the environment is passed along:
the server's is that of its own start, which is also when torch read the variables it
reads at import). ``set_forkserver_preload`` is one list per process: it replaces one
set before and does not change a server already running.
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_mod
import shutil
import signal
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from shardkit.testing._rank import _START_TIMEOUT_S, _worker_main, stacks_path

__all__ = ["RankError", "RankPool", "RankTimeoutError", "run_distributed"]

_POLL_S = 0.05
_STACK_WAIT_S = 2.0  # how long a signalled rank gets to write its stacks
# imported once by the fork server, not by every rank ([Note: ranks forked from a server]):
# torch, torch._dynamo (as long again as torch itself; FSDP imports it at its first
# construction, torch.compile at its first call) and shardkit's wrappers; none of them
# starts a thread.
_PRELOAD = [
    "__main__",
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "shardkit.testing",
    "shardkit.nn",
    "shardkit.compose",
    "shardkit.models",
]


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
        stacks: rank -> every thread's Python stack as the rank hung (faulthandler's
            text, see [Note: a hang shows its stacks]); empty where none could be read.
            They also end the message.
    """

    def __init__(
        self,
        ranks: Sequence[int],
        timeout_s: float,
        what: str = "",
        stacks: dict[int, str] | None = None,
    ) -> None:
        self.ranks = list(ranks)
        self.timeout_s = timeout_s
        self.stacks = dict(stacks or {})
        label = f" running {what}" if what else ""
        super().__init__(
            f"ranks {self.ranks} did not finish within {timeout_s:.1f} s{label} "
            "(a hang: a collective one rank skipped, or a dead peer); all ranks were killed"
            + _format_stacks(self.stacks)
        )


def _format_stacks(stacks: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} stacks ---\n{text.rstrip()}" for r, text in stacks.items())


def _context() -> Any:
    """The fork server's context with torch preloaded, or spawn's where the platform has
    no fork server (see [Note: ranks forked from a server with torch imported])."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


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
        straggler_s: when some ranks finished a :meth:`run` and the others are still
            silent this many seconds later, warn (``RuntimeWarning``) with their
            stacks; None never warns. Default 30.

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
        straggler_s: float | None = 30.0,
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
        self.straggler_s = straggler_s
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._reports: Any = None
        self._tmpdir: str | None = None
        self._next_task = 0

    # lifecycle -----------------------------------------------------------------
    def _start(self) -> None:
        ctx = _context()
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
                    dict(os.environ),
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
            ValueError: ``timeout_s`` <= 0 (before any rank starts the task).
        """
        limit = self.timeout_s if timeout_s is None else timeout_s
        if limit <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds; got {limit}")
        if not self._procs:
            self._start()
        what = getattr(fn, "__qualname__", repr(fn))
        task_id = self._next_task
        self._next_task += 1
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs, seed))
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
        straggling_since: float | None = None  # when the first rank reported ok
        while len(paths) + len(errors) < self.world_size:
            now = time.monotonic()
            if now > deadline:
                if errors:
                    raise _first_failure(errors, dead, what, all_reported=False)
                silent = [r for r in range(self.world_size) if r not in paths]
                raise RankTimeoutError(silent, limit, what, self._stacks(silent))
            if (
                straggling_since is not None
                and self.straggler_s is not None
                and now - straggling_since > self.straggler_s
            ):
                straggling_since = None  # warn once per call
                self._warn_stragglers(sorted(paths), what)
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
                if len(paths) == 1 and not errors:
                    straggling_since = time.monotonic()
            else:
                errors[rank] = payload
                deadline = min(deadline, time.monotonic() + self.grace_s)
        if errors:
            for p in paths.values():
                os.remove(p)
            # Every rank reported: the group is consistent and can run the next task.
            raise _first_failure(errors, dead, what, all_reported=not dead)
        return [paths[r] for r in range(self.world_size)]

    def _warn_stragglers(self, finished: list[int], what: str) -> None:
        silent = [r for r in range(self.world_size) if r not in finished]
        warnings.warn(
            f"ranks {silent} still running {what} {self.straggler_s:.0f} s after ranks "
            f"{finished} finished (a collective they wait in that the others skipped?)"
            + _format_stacks(self._stacks(silent)),
            RuntimeWarning,
            stacklevel=4,
        )

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """Signal ``ranks`` to write their stacks and return what each wrote (see [Note:
        a hang shows its stacks]); a rank gone or not answering within
        ``_STACK_WAIT_S`` is left out."""
        if self._tmpdir is None or not hasattr(signal, "SIGUSR1"):
            return {}
        paths = {r: stacks_path(self._tmpdir, r) for r in ranks if self._procs[r].is_alive()}
        start = {r: _size(p) for r, p in paths.items()}
        for r in paths:
            with contextlib.suppress(OSError):
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        deadline = time.monotonic() + _STACK_WAIT_S
        while time.monotonic() < deadline and any(_size(p) <= start[r] for r, p in paths.items()):
            time.sleep(_POLL_S)
        time.sleep(_POLL_S)  # let a dump in progress finish
        stacks = {}
        for r, p in paths.items():
            with contextlib.suppress(OSError), open(p) as f:
                f.seek(start[r])
                if text := f.read():
                    stacks[r] = text
        return stacks

    def _dead_rank(self, reported: dict[int, str]) -> tuple[int, str] | None:
        for rank, proc in enumerate(self._procs):
            if rank not in reported and not proc.is_alive():
                return rank, f"process exited with code {proc.exitcode} without reporting"
        return None


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


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
