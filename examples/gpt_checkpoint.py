"""Checkpoints of the main job in the universal format: any world size, any strategy.

Layout in ``--out-dir`` (:mod:`shardkit.checkpoint.universal`, on top of
:mod:`shardkit.checkpoint.manifest`)::

    ckpt-000100/...            the universal checkpoint: pieces of every plain GPT
                               tensor and of its optimizer state (which slice of which
                               parameter each file holds), and each rank's ``extra``
                               (LR scheduler, samples consumed, global batch, RNG
                               states, loss history, loss scaler; plain data and tensors)
    ckpt-000100/manifest.json  step, world size, strategy, bytes + sha256 per file
    latest                     the name of the newest complete checkpoint (rank 0)

A checkpoint written by any strategy at any world size loads into any other (the
layout adapters of the wrappers say which piece each rank holds); what must match is
the model's shape (``--model-size``, ``--seq-len``), checked before loading.

[Note: crash safety]
Every file is written atomically (temporary file, fsync, rename). The order is: every
rank writes its own files; the ranks exchange the files' sizes and checksums; rank 0
writes the manifest, then the ``latest`` pointer. A crash at any point leaves
``latest`` naming the previous complete checkpoint. ``--resume`` verifies the
checksums and, if the newest checkpoint is damaged (a truncated or corrupted file),
falls back to the previous one with a one-line warning. Files are read as tensors and
plain containers only: a file naming any other object is refused (it could run code).
With several nodes, ``--out-dir`` must be on a shared filesystem.

[Note: --async-checkpoint]
With ``--async-checkpoint`` a save copies each rank's pieces to host memory at the
step boundary and returns; a background thread writes, hashes and commits them
(:class:`shardkit.checkpoint.universal.AsyncCheckpointer`): the same checkpoint, the
same crash safety (a kill during the background write leaves ``latest`` on the
previous one). A save due while the previous one is still being written waits for it;
a failure in the background ends the job at the next save (or at the end of the run)
on every rank. The run waits for the last commit before it writes ``metrics.json``.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gpt_data import InputError

from shardkit.checkpoint import manifest
from shardkit.checkpoint.manifest import CheckpointError, CheckpointFallbackWarning
from shardkit.checkpoint.universal import (
    AsyncCheckpointer,
    LoadedCheckpoint,
    load_universal,
    save_universal,
)

__all__ = [
    "JobCheckpointer",
    "check_model_flags",
    "check_resumable",
    "find_resume_checkpoint",
    "load_checkpoint",
    "reseed",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]


def save_checkpoint(
    out_dir: Path,
    step: int,
    model: Any,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write ``step``'s universal checkpoint; collective (call it on every rank).

    Args:
        model: the wrapped model (``Strategy.checkpoint_module()``).
        optimizer: the optimizer it steps with.
        extra: this rank's plain data and tensors; it must hold ``"model"``, the flags
            that fix the model's shapes, so that :func:`check_model_flags` can refuse a
            resume with other shapes before loading.
        keep: complete checkpoints to keep, the newest; older ones are deleted (by rank
            0, after ``latest`` moved on). 0 keeps all. Default 2.

    Returns:
        The checkpoint directory.
    """
    return Path(save_universal(out_dir, step, model, optimizer, extra=extra, keep=keep))


class JobCheckpointer:
    """Writes the main job's checkpoints: synchronously (every rank waits for the
    commit), or, with ``--async-checkpoint``, in the background (see [Note:
    --async-checkpoint]).

    Args:
        asynchronous: ``--async-checkpoint``. Creating the checkpointer is then a
            collective over the world (it creates the commit's process group).
    """

    def __init__(self, asynchronous: bool) -> None:
        self.background = AsyncCheckpointer() if asynchronous else None

    def save(
        self,
        out_dir: Path,
        step: int,
        model: Any,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, Any],
        keep: int = 2,
    ) -> Path:
        """:func:`save_checkpoint`, or its asynchronous start (returns once the state is
        copied; the previous background save is waited for first). Collective.

        Returns:
            The checkpoint directory (being written, when asynchronous).

        Raises:
            CheckpointError: the previous background save failed (every rank).
        """
        if self.background is None:
            return save_checkpoint(out_dir, step, model, optimizer, extra, keep)
        return self.background.save(out_dir, step, model, optimizer, extra=extra, keep=keep).path

    def close(self) -> None:
        """Wait for the save in flight (asynchronous); a no-op otherwise.

        Raises:
            CheckpointError: that save failed (every rank).
        """
        if self.background is not None:
            self.background.close()

    def __enter__(self) -> JobCheckpointer:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """:meth:`close`; when the block raised, that error is the one that travels
        (a failure of the save in flight then only ends its own thread's work)."""
        if kind is None:
            self.close()
            return
        with suppress(Exception):
            self.close()


@contextmanager
def _as_input_error() -> Iterator[None]:
    try:
        yield
    except CheckpointError as err:
        raise InputError(f"--resume: {err}") from err


def find_resume_checkpoint(out_dir: Path, warn: Callable[[str], None]) -> Path | None:
    """The newest intact checkpoint in ``out_dir``, or None if none was saved.

    A damaged newer checkpoint is skipped; ``warn`` gets one line saying so.

    Raises:
        InputError: every checkpoint is damaged (the message names the files).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointFallbackWarning)
        try:
            ckpt = manifest.find_valid_checkpoint(out_dir)
        except CheckpointError as err:
            raise InputError(f"--resume: {err}; use another --out-dir") from err
    for item in caught:
        warn(str(item.message))
    return ckpt


def check_model_flags(saved: dict[str, Any], flags: dict[str, Any], ckpt: Path) -> None:
    """Refuse a checkpoint whose model flags (``--model-size``, ``--seq-len``, ...)
    differ from this run's.

    Raises:
        InputError: the message names each differing flag, both values and the fix.
    """
    differ = {k: (saved[k], v) for k, v in flags.items() if k in saved and saved[k] != v}
    if differ:
        names = ", ".join(
            f"--{k.replace('_', '-')} {a} (this run: {b})" for k, (a, b) in differ.items()
        )
        raise InputError(
            f"--resume: {ckpt} was written with {names}; resume with the same model "
            "flags, or use another --out-dir"
        )


def _agree(error: str | None) -> None:
    """Raise the first rank's error on every rank (a collective when a group is up)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise InputError(error)


def check_resumable(
    ckpt: Path,
    rank: int,
    flags: dict[str, Any],
    check: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Check ``ckpt`` before loading it: rank 0's ``extra`` is the main job's and has
    this run's model flags; this rank's ``extra`` (if it saved one) is tensors and
    plain containers only; ``check(rank 0's extra)`` passes.

    Raises:
        InputError: a check failed (:class:`CheckpointError` turned into one line).
    """
    with _as_input_error():
        saved = manifest.read_manifest(ckpt)
        strategy = str(saved.layout.get("strategy"))
        peek = LoadedCheckpoint(ckpt, saved.step, saved.world_size, strategy, saved)
        first = peek.extra(0)
        if not isinstance(first, dict) or "sampler" not in first:
            raise InputError(
                f"--resume: {ckpt} holds no main-job state (not a universal checkpoint of "
                "train_gpt.py); use another --out-dir"
            )
        check_model_flags(first.get("model", {}), flags, ckpt)
        peek.extra(rank)
        if check is not None:
            check(first)


def load_checkpoint(
    ckpt: Path,
    model: Any,
    optimizer: torch.optim.Optimizer,
    flags: dict[str, Any],
    check: Callable[[dict[str, Any]], None] | None = None,
) -> LoadedCheckpoint:
    """Load ``ckpt`` into ``model`` and ``optimizer`` at this run's world size and
    strategy (a collective); the loaded checkpoint (``.step``, ``.saved_world_size``,
    ``.saved_strategy``, ``.extra(rank)``).

    Raises:
        InputError: on every rank, with the first failing rank's message: the
            checkpoint is damaged or not the main job's, was written with other model
            flags (:func:`check_model_flags`), ``check`` refused rank 0's ``extra``
            (all before loading), or an ``extra`` file holds an object other than
            tensors and plain containers (refused unloaded: it could run code); or
            loading failed (e.g. a layout that cannot be resharded).
    """
    error: str | None = None
    try:
        check_resumable(ckpt, dist.get_rank() if dist.is_initialized() else 0, flags, check)
    except InputError as err:
        error = str(err)
    _agree(error)
    with _as_input_error():
        return load_universal(ckpt, model, optimizer)


def rng_state(device: torch.device) -> dict[str, Any]:
    """The random-number generator states a resumed run needs (torch, Python, CUDA)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned (tensors may have been mapped to ``device``)."""
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def reseed(seed: int, step: int, rank: int, device: torch.device) -> None:
    """Fresh generator states for ``rank`` at ``step``, a function of ``(seed, step,
    rank)``: a resume at another world size cannot continue each rank's own stream
    (ranks are renumbered), so every rank restarts from a deterministic seed instead."""
    key = (seed * 1_000_003 + step) * 1_000_033 + rank
    torch.manual_seed(key)
    random.seed(key)
    if device.type == "cuda":
        torch.cuda.manual_seed(key)
