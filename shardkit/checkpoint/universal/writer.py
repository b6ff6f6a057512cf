"""``save_universal``: every rank writes its pieces; the manifest commits them.

[Note: what a save writes]
``root/ckpt-<step>/``: per rank ``shard-<r>-of-<N>.safetensors`` (see [Note: the
shard file]: the pieces with ``write=True`` of every parameter and buffer, and of
their optimizer state) and ``extra-<r>.pt`` (the rank's ``extra``, ``torch.save``,
checked to load with ``weights_only=True``), committed by
:func:`shardkit.checkpoint.manifest.save_checkpoint` (atomic files, sha256, manifest,
``latest``, ``keep``). The manifest's ``layout`` (:mod:`.meta`) holds the format
version, strategy, world size, per key the global shape and dtype, and the
optimizer's param groups (hyperparameters and the keys of their parameters).

Before anything is written, the ranks all-gather what they will write and check
that every element of every key (and of each optimizer state) is written exactly
once: an adapter bug fails the save on every rank, naming the keys, instead of
leaving a checkpoint that cannot load. Any exception a rank raises while building
what it writes travels in that same all-gather (see [Note: one failure, every rank]
in :mod:`shardkit.checkpoint.agreement`), so every rank raises at once.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from shardkit.checkpoint.agreement import RankFailure, describe_failures
from shardkit.checkpoint.manifest import (
    _rank_world,
    _save_failed,
    checkpoint_name,
    load_tensors_only,
    save_checkpoint,
)
from shardkit.checkpoint.universal.adapters import layout_of
from shardkit.checkpoint.universal.layout import ParamEntry, aliases_of, session_of
from shardkit.checkpoint.universal.meta import KeyMeta, build_layout, extra_file_name
from shardkit.checkpoint.universal.optim_state import (
    PerTensorState,
    group_keys,
    group_records,
    optimizer_class,
    state_slices,
)
from shardkit.checkpoint.universal.shardfile import (
    SavedPiece,
    SavedScalar,
    ShardFile,
    dtype_name,
    shard_file_name,
)
from shardkit.distributed.shard_descriptor import TensorView
from shardkit.distributed.shard_elements import check_view

__all__ = ["PreparedSave", "check_entry", "commit_save", "prepare_save", "save_universal"]

PathLike = str | os.PathLike[str]
_INPUT_ERRORS = ("ValueError", "TypeError")  # raised as such on every rank (bad input)


def check_entry(entry: ParamEntry) -> None:
    """Raise ``ValueError`` naming the key when ``entry``'s view, range or tensor size
    is inconsistent."""
    check_view(entry.view)
    n = entry.stop - entry.start
    if not 0 <= entry.start <= entry.stop <= entry.view.local_numel:
        raise ValueError(
            f"{entry.key!r}: piece [{entry.start}, {entry.stop}) outside the local tensor "
            f"of {entry.view.local_numel} elements ({entry.view})"
        )
    if entry.tensor.numel() != n:
        raise ValueError(
            f"{entry.key!r}: piece [{entry.start}, {entry.stop}) has {n} elements, its "
            f"tensor {entry.tensor.numel()}"
        )


def _shard_file(
    entries: list[ParamEntry], optimizer: Any, file: str
) -> tuple[ShardFile, list[tuple[Any, ...]]]:
    """This rank's shard file and what it writes ``(key, state, view, start, stop)``."""
    pieces: list[tuple[SavedPiece, torch.Tensor]] = []
    scalars: list[SavedScalar] = []

    def add(
        key: str, state: str, view: TensorView, start: int, stop: int, tensor: torch.Tensor
    ) -> None:
        record = SavedPiece(
            key,
            state,
            view,
            start,
            stop,
            dtype_name(tensor.dtype),
            file,
            str(len(pieces)),
        )
        pieces.append((record, tensor))

    for entry in entries:
        check_entry(entry)
        if not entry.write or entry.start == entry.stop < entry.view.local_numel:
            continue  # (an empty tensor is written: its optimizer state's scalars)
        add(entry.key, "", entry.view, entry.start, entry.stop, entry.tensor)
        if optimizer is None or entry.param is None:
            continue
        for name, value in state_slices(entry, optimizer.state.get(entry.param, {})):
            if isinstance(value, SavedScalar):
                scalars.append(value)
            elif isinstance(value, PerTensorState):  # its own descriptor, written whole
                add(entry.key, name, value.view, 0, value.tensor.numel(), value.tensor)
            else:
                add(entry.key, name, entry.view, entry.start, entry.stop, value)
    written = [(r.key, r.state, r.view, r.start, r.stop) for r, _ in pieces]
    return ShardFile(pieces, _unique_scalars(scalars)), written


def _unique_scalars(scalars: list[SavedScalar]) -> list[SavedScalar]:
    """One scalar per (key, state): a key split into several pieces on this rank
    (all stepped together) stores its ``step`` once."""
    seen: dict[tuple[str, str], SavedScalar] = {}
    for s in scalars:
        seen.setdefault((s.key, s.state), s)
    return list(seen.values())


def _extra_bytes(extra: Any, rank: int) -> bytes:
    """``torch.save(extra)``, refused unless it loads back with ``weights_only=True``."""
    buffer = io.BytesIO()
    torch.save({} if extra is None else extra, buffer)
    data = buffer.getvalue()
    try:
        load_tensors_only(io.BytesIO(data))  # type: ignore[arg-type]
    except Exception as err:
        raise TypeError(
            f"extra of rank {rank} holds something other than tensors, numbers, strings "
            f"and lists / tuples / dicts of them, which loading refuses ({err}); convert "
            "it first (e.g. numpy arrays to tensors, objects to their state dicts)"
        ) from err
    return data


def _write(obj: Any, handle: IO[bytes]) -> None:
    if isinstance(obj, ShardFile):
        obj.write_to(handle)
    else:
        handle.write(obj)


def _local_summary(
    entries: list[ParamEntry], optimizer: Any, written: list[tuple[Any, ...]]
) -> dict[str, Any]:
    keys: dict[str, KeyMeta] = {}
    for e in entries:
        keys.setdefault(e.key, KeyMeta(list(e.view.global_shape), dtype_name(e.tensor.dtype)))
    groups = group_keys(entries, optimizer) if optimizer is not None else {}
    return {"keys": keys, "written": written, "groups": groups}


def save_universal(
    root: PathLike,
    step: int,
    model: Any,
    optimizer: Any = None,
    *,
    extra: Mapping[str, Any] | None = None,
    keep: int = 0,
    group: dist.ProcessGroup | None = None,
) -> Path:
    """Save ``model`` (and ``optimizer``) as a universal checkpoint ``root/ckpt-<step>``.

    A collective over ``group``: every rank calls it. Each rank writes only its own
    pieces (see [Note: what a save writes]); the checkpoint loads with
    :func:`~shardkit.checkpoint.universal.load_universal` into any strategy at any
    world size.

    Args:
        root: the checkpoint root directory, shared by all ranks (created if missing).
        step: the training step (directory name, manifest, ``LoadedCheckpoint.step``).
        model: the model as the training loop holds it (plain, DDP, or any wrapper
            with a registered layout, see ``register_layout``).
        optimizer: the optimizer stepping it (plain torch, OSS, WholeTensorOptimizer),
            or None (no optimizer state saved). State shaped like the parameter (Adam,
            AdamW, SGD with momentum, Adagrad, RMSprop, Muon), scalars, and state of
            another shape where the optimizer holds whole tensors (Adafactor's factored
            moments; see ``[Note: per-tensor optimizer state]`` in
            :mod:`.optim_state`).
        extra: this rank's extra state (LR scheduler, RNG states, data position):
            tensors and plain containers; default None: ``{}``.
        keep: committed checkpoints to keep, the newest (0: all). Default 0.
        group: the process group; default None: the world group (one rank when no
            process group is initialised).

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: (on every rank) an adapter's pieces are invalid or do not write
            every element of a key exactly once (the keys are named), or optimizer
            state of another shape than a parameter of which it holds a piece. The failing rank raises its own error, the
            others ``"rank <r>: <its message>"``.
        TypeError: (on every rank, likewise) a rank's ``extra`` would not load with
            ``weights_only=True``.
        CheckpointError: (problem ``save``, on every rank, within seconds: no rank
            waits for the process group's timeout) any other exception on a rank while
            it builds its pieces (e.g. a ``RuntimeError`` of the model's state) or
            writes its files (an ``OSError``: disk full, permission denied), or rank 0
            failed to commit; see ``save_checkpoint``. The message names each failing
            rank with the exception's type and message ("not committed": ``latest``
            and the committed checkpoints are unchanged); on the failing rank the
            original exception is chained (``__cause__``). A failure after rank 0's
            commit point is reported on every rank alike, saying the checkpoint was
            committed. The adapter's ``session`` is left after the commit: an error
            there is raised on its own rank only (the checkpoint is committed).
    """
    with contextlib.ExitStack() as session:  # the adapter's session(), left at the end
        prepared = prepare_save(session, root, step, model, optimizer, extra=extra, group=group)
        return commit_save(prepared, keep=keep, group=group)


@dataclass(frozen=True)
class PreparedSave:
    """What a rank writes for one universal save, checked by every rank (see [Note:
    what a save writes]): ``files`` (its shard file and extra bytes, by file name) and
    the manifest's ``layout``, for :func:`commit_save`."""

    root: Path
    step: int
    files: dict[str, Any]
    layout: dict[str, Any]


Stage = Callable[[ShardFile], ShardFile]


def prepare_save(
    session: contextlib.ExitStack,
    root: PathLike,
    step: int,
    model: Any,
    optimizer: Any = None,
    *,
    extra: Mapping[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
    stage: Stage | None = None,
) -> PreparedSave:
    """The first half of :func:`save_universal`, a collective over ``group``: build this
    rank's pieces inside the adapter's session (entered on ``session``), all-gather
    what every rank will write and check it. ``stage`` (default None: the shard file
    reads the model's own storage while it is written) replaces the shard file by one
    holding copies (:class:`~shardkit.checkpoint.universal.staging.StagingBuffer`),
    before the all-gather, so a failure to copy travels in it like any other.

    Raises:
        ValueError, TypeError, CheckpointError: see :func:`save_universal`.
    """
    rank, world_size = _rank_world(group)
    summary: Any
    error: Exception | None = None
    try:
        adapter = layout_of(model, optimizer, group=group)
        session.enter_context(session_of(adapter, "save"))
        entries = list(adapter.entries())
        file = shard_file_name(rank, world_size)
        shard, written = _shard_file(entries, optimizer, file)
        if stage is not None:
            shard = stage(shard)
        extra_data = _extra_bytes(extra, rank)
        summary = _local_summary(entries, optimizer, written)
        summary["aliases"] = aliases_of(adapter)
        if getattr(adapter, "assumes_replicas", False) and world_size > 1:
            summary["fingerprints"] = {_piece_id(e): _fingerprint(e.tensor) for e in entries}
        hyper = group_records(optimizer, {}) if optimizer is not None else None
        optimizer_name = optimizer_class(optimizer)
    except Exception as err:  # every rank raises below (no rank left waiting)
        summary, error = RankFailure.of(rank, err), err
    summaries = _all_gather(summary, group, world_size)
    _raise_failures(summaries, error, Path(root) / checkpoint_name(step))
    problems = _replica_problems(summaries)
    if problems:
        raise ValueError(
            f"the ranks hold different values of {len(problems)} tensors that the "
            f"{adapter.strategy!r} layout saves as identical replicas (each rank writes 1/"
            f"{world_size} of every tensor, so the checkpoint would mix them): "
            + "; ".join(problems[:5])
            + ". Save a model the ranks hold differently through its wrapper (DDP, FSDP, "
            "...), mark tensor-parallel parts (shardkit.distributed.shard_descriptor.set_view), or save each "
            "rank's model with a process group of its own (group=)"
        )
    layout = build_layout(summaries, adapter.strategy, world_size, hyper, optimizer_name)
    files = {file: shard, extra_file_name(rank): extra_data}
    return PreparedSave(Path(root), step, files, layout)


def commit_save(
    prepared: PreparedSave, *, keep: int = 0, group: dist.ProcessGroup | None = None
) -> Path:
    """The second half of :func:`save_universal`, a collective over ``group`` (the same
    ranks, in the same order, as the :func:`prepare_save` that made ``prepared``):
    write, checksum and commit the files through
    :func:`shardkit.checkpoint.manifest.save_checkpoint`.

    Raises:
        CheckpointError: see :func:`save_universal`.
    """
    return save_checkpoint(
        prepared.root,
        prepared.step,
        prepared.files,
        layout=prepared.layout,
        keep=keep,
        group=group,
        save=_write,
    )


def _raise_failures(summaries: list[Any], error: Exception | None, ckpt: Path) -> None:
    """After the all-gather of the summaries: raise on every rank if a rank failed.

    A ``ValueError`` / ``TypeError`` (bad input) is raised as such: the failing rank's
    own, on the others the first failure's type with ``"rank <r>: <message>"``. Any
    other failure raises ``CheckpointError`` naming every failing rank, chained to
    this rank's own exception."""
    failures = [s for s in summaries if isinstance(s, RankFailure)]
    if not failures:
        return
    if isinstance(error, (ValueError, TypeError)):
        raise error
    first = failures[0]
    kind = next((k for k in _INPUT_ERRORS if k in first.builtins), None)
    if error is None and kind is not None:
        raise getattr(builtins, kind)(f"rank {first.rank}: {first.message}")
    raise _save_failed(ckpt, f"not committed: {describe_failures(summaries)}") from error


def _piece_id(entry: ParamEntry) -> tuple[Any, ...]:
    v = entry.view
    return (
        entry.key,
        v.global_shape,
        v.split_dim,
        v.part,
        v.parts,
        v.stride,
        v.inner_splits,
        entry.start,
        entry.stop,
    )


def _fingerprint(tensor: torch.Tensor, chunk: int = 1 << 22) -> tuple[float, float]:
    """(sum, sum of absolute values) of ``tensor``'s elements in float64, read in chunks
    (no copy of the tensor)."""
    flat = tensor.detach().reshape(-1)
    total = absolute = 0.0
    for i in range(0, flat.numel(), chunk):
        part = flat[i : i + chunk]
        if part.dtype == torch.bool:
            part = part.to(torch.uint8)
        total += float(part.sum(dtype=torch.float64))
        absolute += float(part.abs().sum(dtype=torch.float64))
    return total, absolute


def _replica_problems(summaries: list[dict[str, Any]], rtol: float = 1e-6) -> list[str]:
    """The pieces that ranks assumed to be replicas hold with different values
    (fingerprints differing by more than ``rtol`` of the sum of absolute values)."""
    first: dict[tuple[Any, ...], tuple[int, tuple[float, float]]] = {}
    problems: dict[str, str] = {}
    for rank, summary in enumerate(summaries):
        for piece, (total, absolute) in summary.get("fingerprints", {}).items():
            if piece not in first:
                first[piece] = (rank, (total, absolute))
                continue
            other, (total0, absolute0) = first[piece]
            scale = rtol * max(absolute, absolute0)
            same = all(
                (a != a and b != b) or abs(a - b) <= scale  # NaN == NaN here
                for a, b in ((total, total0), (absolute, absolute0))
            )
            if not same and piece[0] not in problems:
                problems[piece[0]] = (
                    f"{piece[0]!r}: rank {other} sum {total0:.6g}, rank {rank} sum {total:.6g}"
                )
    return list(problems.values())


def _all_gather(obj: Any, group: dist.ProcessGroup | None, world_size: int) -> list[Any]:
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out
