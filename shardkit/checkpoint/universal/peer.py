"""A universal checkpoint held in memory: sent by live ranks, loaded by others.

[Note: a checkpoint over the network]
A replica that rejoins a fault-tolerant job receives the state of a live replica that
may hold it in another layout (another strategy, another number of ranks). That is
exactly what a universal checkpoint moves between layouts, so the transfer *is* one,
never written to a shared disk:

1. Each rank of the live replica builds its part with :func:`universal_state`: the
   first half of :func:`~shardkit.checkpoint.universal.save_universal`
   (``prepare_save``: its shard file, described piece by piece by shard descriptors,
   its ``extra`` and the manifest's layout), serialised to bytes exactly as the save
   writes them. A collective over the live replica's ranks only.
2. The parts travel as plain byte payloads (the caller's transport, e.g.
   :mod:`shardkit.distributed.fault_tolerance`).
3. Each rank of the joiner, given every part, writes them as a committed checkpoint
   into a private temporary directory (the save's own file writer and manifest, with
   checksums) and loads it with
   :func:`~shardkit.checkpoint.universal.load_universal` (a collective over the
   joiner's ranks), which reads only the byte ranges its pieces need and reshards by
   the descriptors; the directory is deleted afterwards.

So there is one format and one resharding implementation; the memory cost on the
joiner is the live replica's whole state once per rank (in RAM or ``directory``'s
file system: ``/dev/shm`` by default when it exists), as when every rank reads a
whole checkpoint.

The same pieces tell replicas of different layouts which gradients each rank holds:
:func:`gradient_pieces` lists them for ``FaultTolerantReplicas(layout=...)``, which
averages them in the plain model's index space.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardkit.checkpoint.manifest import (
    CheckpointError,
    _commit,
    _prepare,
    _staging,
    _write_files,
    checkpoint_name,
)
from shardkit.checkpoint.universal.adapters import layout_of
from shardkit.checkpoint.universal.layout import ParamEntry, session_of
from shardkit.checkpoint.universal.loader import LoadedCheckpoint, load_universal
from shardkit.checkpoint.universal.optim_state import entry_offset
from shardkit.checkpoint.universal.shardfile import ShardFile
from shardkit.checkpoint.universal.writer import prepare_save

__all__ = ["gradient_pieces", "load_universal_states", "universal_state"]

_SHM = Path("/dev/shm")


def _file_bytes(obj: Any) -> bytes:
    """A file of a save as the save writes it (a shard file, or the extra's bytes)."""
    if isinstance(obj, ShardFile):
        buffer = io.BytesIO()
        obj.write_to(buffer)
        return buffer.getvalue()
    return bytes(obj)


def _write_bytes(data: bytes, handle: Any) -> None:
    handle.write(data)


def universal_state(
    model: Any,
    optimizer: Any = None,
    *,
    step: int,
    extra: Mapping[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """This rank's part of a universal checkpoint of ``model`` and ``optimizer``, in
    memory (see [Note: a checkpoint over the network]). A collective over ``group``.

    Args:
        model: the model as the training loop holds it (as for ``save_universal``).
        optimizer: the optimizer stepping it, or None (no optimizer state).
        step: the training step the state belongs to.
        extra: this rank's extra state (tensors and plain containers); default None.
        group: the saving ranks' process group; default None: the world group.

    Returns:
        ``{"step": int, "layout": dict, "rank": int, "files": {name: bytes}}``: plain
        data and bytes (picklable; ``torch.load(weights_only=True)`` reads it back).

    Raises:
        ValueError, TypeError, CheckpointError: as ``save_universal`` (on every rank).
    """
    with contextlib.ExitStack() as session:
        prepared = prepare_save(session, ".", step, model, optimizer, extra=extra, group=group)
        files = {name: _file_bytes(obj) for name, obj in prepared.files.items()}
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    return {"step": step, "layout": prepared.layout, "rank": rank, "files": files}


def gradient_pieces(
    model: Any, optimizer: Any = None, *, group: dist.ProcessGroup | None = None
) -> list[ParamEntry]:
    """This rank's pieces of ``model``'s parameters as the universal checkpoint lists
    them (``layout_of(model, optimizer, group=group).entries()``), each with its
    ``param_offset`` resolved: what ``FaultTolerantReplicas(layout=...)`` reads to
    average gradients between replicas of different layouts. No collective.

    Args:
        model: the model as the training loop holds it (as for ``save_universal``).
        optimizer: the optimizer stepping it (OSS: it decides which rank holds which
            gradient; FSDP: its flat shards), or None (a plain model or DDP: every
            parameter).
        group: the replica's process group for a plain module (its ranks split the
            pieces between them); default None: the world group. Wrappers use their own.

    Returns:
        The pieces, in the adapter's order (buffers and parameters this rank does not
        step have ``param`` None). Element ranges, in elements of the local tensor.

    Raises:
        TypeError: no layout is registered for ``model`` (as ``layout_of``).
        ValueError: a piece's offset in its parameter cannot be derived.
    """
    adapter = layout_of(model, optimizer, group=group)
    with session_of(adapter, "save"):
        entries = list(adapter.entries())
    return [
        dataclasses.replace(e, param_offset=entry_offset(e)) if e.param is not None else e
        for e in entries
    ]


def _commit_parts(root: Path, parts: Sequence[Mapping[str, Any]]) -> Path:
    """Write every rank's part under ``root`` as one committed checkpoint (one process)."""
    step = int(parts[0]["step"])
    reason, error = _prepare(root, step)
    if not reason:
        per_rank = [
            _write_files(_staging(root, step), part["files"], part["rank"], _write_bytes)
            for part in sorted(parts, key=lambda p: int(p["rank"]))
        ]
        reason, error = _commit(root, step, per_rank, parts[0]["layout"], keep=0)
    if reason:
        raise CheckpointError(root, "save", f"writing the received state failed: {reason}") from (
            error
        )
    return root / checkpoint_name(step)


def load_universal_states(
    parts: Sequence[Mapping[str, Any]],
    model: Any,
    optimizer: Any = None,
    *,
    group: dist.ProcessGroup | None = None,
    directory: str | Path | None = None,
) -> LoadedCheckpoint:
    """Load a universal checkpoint given as the parts :func:`universal_state` returned
    on every rank of the saving group, into ``model`` and ``optimizer`` in this
    group's layout. A collective over ``group`` (every rank passes all the parts).

    Args:
        parts: every saving rank's part, in any order (one per rank, all of one step).
        model: the model as the training loop holds it (as for ``load_universal``).
        optimizer: the optimizer to restore state into, or None.
        group: the loading ranks' process group; default None: the world group.
        directory: where the private temporary checkpoint goes; default None:
            ``/dev/shm`` when it exists (memory), else the system's temporary directory.

    Returns:
        The :class:`LoadedCheckpoint` (``step``, ``saved_world_size``, ``extra(r)``).

    Raises:
        ValueError: ``parts`` is empty, mixes steps, or misses a saving rank.
        CheckpointError: as ``load_universal``; problem ``save`` when the parts could
            not be written.
    """
    ranks = sorted(int(p["rank"]) for p in parts)
    steps = {int(p["step"]) for p in parts}
    if not parts or len(steps) != 1 or ranks != list(range(len(ranks))):
        raise ValueError(
            f"load_universal_states: parts of steps {sorted(steps)} from ranks {ranks}; "
            "pass one part per rank 0..N-1 of the saving group, all of one step"
        )
    if directory is None and _SHM.is_dir():
        directory = _SHM
    with tempfile.TemporaryDirectory(prefix="shardkit-peer-", dir=directory) as root:
        ckpt = _commit_parts(Path(root), parts)
        loaded = load_universal(ckpt, model, optimizer, group=group)
        for rank in ranks:  # read now: the directory is deleted on return
            loaded.extra(rank)
        return loaded
