"""The rank side of the harness (:mod:`shardkit.testing.launcher` is the parent side):
join the process group, run the tasks the parent sends, report each result, exit.

[Note: prompt rank exit]
A rank told to stop leaves its process group, runs its ``atexit`` handlers, flushes its
report queue and streams, and ends with ``os._exit``: the interpreter's teardown with
torch loaded took 0.7 to 2.5 s per group on the 2-core CI machine, paid by every
``run_distributed`` call and pool closed. Threads a task left running end with it.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import random
import signal
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardkit.testing._isolation import snapshot

_START_TIMEOUT_S = 120.0
# SIGUSR1 makes a rank write every thread's Python stack here (see launcher's [Note:
# a hang shows its stacks]); the file object lives as long as the rank.
_STACKS: list[Any] = []


def stacks_path(result_dir: str, rank: int) -> str:
    """Where rank ``rank`` writes its thread stacks on SIGUSR1."""
    return os.path.join(result_dir, f"stacks-rank{rank}.txt")


def _dump_stacks_on_signal(result_dir: str, rank: int) -> None:
    """On SIGUSR1, write all threads' stacks to :func:`stacks_path` (faulthandler writes
    from the signal handler itself, so a rank blocked in a collective's C++ wait still
    answers)."""
    if not hasattr(signal, "SIGUSR1"):  # not on Windows
        return
    out = open(stacks_path(result_dir, rank), "w")  # noqa: SIM115 (open for the rank's life)
    _STACKS.append(out)
    faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)


def _seed_everything(seed: int) -> None:
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
    environ: dict[str, str],
) -> None:
    """Body of one rank: take the parent's environment, init the process group, run
    tasks until told to stop, then end the process at once (see [Note: prompt rank
    exit])."""
    os.environ.clear()
    os.environ.update(environ)
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
    _dump_stacks_on_signal(result_dir, rank)
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
    # each task starts from the state the rank had here (see _isolation)
    start = snapshot(lambda: _set_collective_timeout(pg_timeout_s))
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
            start.restore()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
