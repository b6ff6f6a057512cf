"""A checkpoint directory of per-rank files, with a manifest and a ``latest`` pointer.

Layout under a root directory::

    ckpt-000100/rank0.pt        the files each rank wrote (any names, any serializer)
    ckpt-000100/rank1.pt
    ckpt-000100/manifest.json   format, step, world size, creation time, the caller's
                                layout metadata, and per file: rank, bytes, sha256
    latest                      the name of the newest committed checkpoint
    ckpt-000100.new/            where a save writes before it is swapped in (see
                                [Note: commit order]); left only by a crash

[Note: commit order]
:func:`save_checkpoint` is a collective. Rank 0 prepares a staging directory
``ckpt-<step>.new`` beside the checkpoints (first finishing a swap that a crash
interrupted, and deleting staging directories that a crash left) and tells every rank
it is ready (a broadcast). Every rank writes its own files into it atomically
(:func:`shardkit.checkpoint.atomic.atomic_save`: temporary file, fsync, rename) and
hashes them; the records are all-gathered (this is the barrier); rank 0 writes
``manifest.json`` into the staging directory, then swaps it in:

1. ``latest`` := ``ckpt-<step>.new`` (atomic): the commit point;
2. the previous ``ckpt-<step>``, if any (a re-save at a step already saved), is deleted;
3. ``ckpt-<step>.new`` is renamed to ``ckpt-<step>`` (atomic);
4. ``latest`` := ``ckpt-<step>``; older checkpoints beyond ``keep`` are pruned.

Rank 0's outcome is broadcast, so a failure on any rank raises on every rank instead
of leaving the others waiting (see [Note: one failure, every rank] in
:mod:`shardkit.checkpoint.agreement`); a save that fails before the commit point
deletes its staging directory. A committed checkpoint's files are never rewritten in
place, so a crash at any point leaves ``latest`` naming a complete checkpoint: the
previous one before step 1, the new one from step 1 on (:func:`list_checkpoints`
reads a ``latest`` naming ``ckpt-<step>.new`` as that directory while it exists, else
as ``ckpt-<step>``, where step 3 put it). A directory newer than ``latest`` was never
committed and is ignored by :func:`find_valid_checkpoint`.

[Note: what loading checks]
:func:`verify_checkpoint` reads the manifest and checks every file's size and sha256
(a truncated file is shorter than recorded; a corrupted one hashes differently), and,
when the caller's state cannot be resharded, the world size. Damage (a missing,
truncated or corrupted file, an unreadable manifest) raises
:class:`CheckpointCorruptError`: :func:`find_valid_checkpoint` then falls back to the
previous checkpoint with a :class:`CheckpointFallbackWarning`. A checkpoint that is
intact but does not fit this run (another world size, another format version) raises
:class:`CheckpointMismatchError` and is not skipped: an older checkpoint would not fit
either, and silently training from an old state loses work.

[Note: tensors and plain containers only]
Every shardkit checkpoint file is read with :func:`load_tensors_only`: ``torch.load``
with ``weights_only=True`` (tensors, numbers, strings, and lists, tuples, dicts and
sets of them), so a file from an untrusted source cannot run code when loaded (a
pickle can name any callable; unpickling calls it). A file holding anything else is
refused with :class:`CheckpointUnsafeError`, naming the file and the object. The
checksums do not protect against that: they sit in the same directory and are as easy
to rewrite as the file.

The same ideas as DeepSpeed's ``latest`` tag file and torch.distributed.checkpoint's
``.metadata`` file; the checksums are shardkit's addition.

Why this module is long: save, verify, load and find of a checkpoint directory are one
protocol whose crash-safety rules (commit order, the latest pointer, staging
directories, checksums) span all of it; every function is under 75 lines.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardkit.checkpoint.agreement import RankFailure, broadcast_outcome, describe_failures
from shardkit.checkpoint.atomic import atomic_save, atomic_write, fsync_dir
from shardkit.distributed.collectives import group_rank, group_size

__all__ = [
    "CHECKPOINT_FORMAT",
    "LATEST_NAME",
    "MANIFEST_NAME",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFallbackWarning",
    "CheckpointMismatchError",
    "CheckpointUnsafeError",
    "FileRecord",
    "Manifest",
    "checkpoint_name",
    "find_valid_checkpoint",
    "list_checkpoints",
    "load_checkpoint_file",
    "load_tensors_only",
    "not_the_committed_save",
    "read_manifest",
    "save_checkpoint",
    "verify_checkpoint",
]

CHECKPOINT_FORMAT = "shardkit.checkpoint/1"
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
PathLike = str | os.PathLike[str]
_DIR = re.compile(r"ckpt-(\d+)")
_STAGING_SUFFIX = ".new"
_POINTER = re.compile(r"ckpt-(\d+)(\.new)?")  # what ``latest`` may name
_CHUNK_BYTES = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used. ``path``: the file or directory; ``problem``: a word."""

    def __init__(self, path: PathLike, problem: str, message: str) -> None:
        super().__init__(message)
        self.path, self.problem = Path(path), problem

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.problem, str(self)))


class CheckpointCorruptError(CheckpointError):
    """Damage: a file ``missing``, ``truncated`` or ``corrupted``; a ``manifest`` unreadable."""


class CheckpointMismatchError(CheckpointError):
    """Intact, but not for this run: another ``world size`` or ``format``."""


class CheckpointUnsafeError(CheckpointError):
    """A file holds an object other than tensors and plain containers (problem ``unsafe``):
    loading it could run code, so it is refused (see [Note: tensors and plain
    containers only]). Not damage: an older checkpoint is not tried instead."""


class CheckpointFallbackWarning(UserWarning):
    """The newest checkpoint was damaged; an older one is used."""


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint: its name in the directory, writer rank, bytes, sha256."""

    name: str
    rank: int
    size_bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """The content of ``manifest.json``.

    Attributes:
        step: the training step the checkpoint holds.
        world_size: ranks that wrote it.
        files: every file, in rank order.
        layout: the caller's shard-layout metadata (JSON-serializable), e.g. the
            strategy and how parameters were partitioned; stored as given.
        created_unix_s: seconds since the epoch when rank 0 wrote the manifest.
        format: :data:`CHECKPOINT_FORMAT`.
    """

    step: int
    world_size: int
    files: tuple[FileRecord, ...]
    layout: dict[str, Any] = field(default_factory=dict)
    created_unix_s: float = 0.0
    format: str = CHECKPOINT_FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Manifest:
        """Inverse of ``asdict``; raises ``ValueError``/``TypeError`` on a malformed one."""
        files = tuple(FileRecord(**f) for f in raw.pop("files"))
        manifest = cls(files=files, **raw)
        numbers = [manifest.step, manifest.world_size] + [f.size_bytes for f in files]
        if not all(isinstance(n, int) and n >= 0 for n in numbers):
            raise ValueError(f"step, world size and file sizes must be integers >= 0: {numbers}")
        return manifest


def checkpoint_name(step: int) -> str:
    """The directory name of ``step``'s checkpoint: ``ckpt-000100``."""
    return f"ckpt-{step:06d}"


def _step_of(name: str) -> int | None:
    match = _DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def _saved_step(name: str) -> int | None:
    """The step of a checkpoint directory's name, committed or not: ``ckpt-<step>`` or
    its staging directory ``ckpt-<step>.new`` (see [Note: commit order])."""
    match = _POINTER.fullmatch(name)
    return int(match.group(1)) if match else None


def _staging(root: Path, step: int) -> Path:
    """Where a save of ``step`` writes before it is swapped in: ``ckpt-<step>.new``."""
    return root / (checkpoint_name(step) + _STAGING_SUFFIX)


def _pointed(root: Path) -> tuple[int, Path] | None:
    """The step and directory ``latest`` names, or None (no ``latest``, or not a
    checkpoint name). A staging name (see [Note: commit order]) is read as the staging
    directory while it exists, else as ``ckpt-<step>``."""
    match = _pointer(root)
    if match is None:
        return None
    step = int(match.group(1))
    staged = _staging(root, step)
    if match.group(2) and staged.is_dir():
        return step, staged
    return step, root / checkpoint_name(step)


def not_the_committed_save(path: PathLike) -> str | None:
    """Why ``path`` must not be read as its step's checkpoint, or None.

    Two directories of a re-save (see [Note: commit order]) are not the committed save
    of their step: a staging directory ``ckpt-<step>.new`` that the root's ``latest``
    does not name (a crash before the commit point, or one a newer save left), and a
    ``ckpt-<step>`` while ``latest`` names its ``ckpt-<step>.new`` (a crash after the
    commit point, before the rename: the old save, superseded). Any other path: None.

    Returns:
        The sentence to raise with (names ``path`` and what ``latest`` names), or None.
    """
    p = Path(path)
    step = _saved_step(p.name)
    if step is None:
        return None
    pointed = _pointed(p.parent)
    latest = p.parent / LATEST_NAME
    if _step_of(p.name) is not None:  # ckpt-<step>
        staged = _staging(p.parent, step)
        if pointed != (step, staged):
            return None
        return (
            f"{p}: superseded by {staged.name}, a re-save of step {step} that {latest} "
            f"names (committed; its rename did not run); read {staged} or the root"
        )
    if pointed == (step, p):
        return None
    named = repr(latest.read_text().strip()) if latest.is_file() else "nothing (no file)"
    return (
        f"{p}: this save did not finish (it was never committed: {latest} names "
        f"{named}); use the root's newest committed one"
    )


def _pointer(root: Path) -> re.Match[str] | None:
    """``latest``'s content matched against ``ckpt-<step>`` or ``ckpt-<step>.new``."""
    pointer = root / LATEST_NAME
    if not pointer.is_file():
        return None
    return _POINTER.fullmatch(pointer.read_text().strip())


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _check_name(name: str) -> None:
    if not name or name.startswith(".") or "/" in name or "\\" in name:
        raise ValueError(f"checkpoint file name {name!r}: use a plain name like 'rank0.pt'")
    if name == MANIFEST_NAME:
        raise ValueError(f"checkpoint file name {name!r} is reserved for the manifest")


def read_manifest(ckpt: PathLike) -> Manifest:
    """The manifest of checkpoint directory ``ckpt``.

    Raises:
        CheckpointCorruptError: the manifest is missing (the save never finished) or
            unreadable.
        CheckpointMismatchError: it has another format version.
    """
    path = Path(ckpt) / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointCorruptError(
            path, "missing", f"{path} is missing: the save of {Path(ckpt).name} did not finish"
        )
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointMismatchError(
                path,
                "format",
                f"{path} has format {raw.get('format')!r}; this shardkit reads "
                f"{CHECKPOINT_FORMAT!r}",
            )
        return Manifest.from_dict(raw)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointCorruptError(path, "manifest", f"{path} is unreadable: {err}") from err


def _verify_file(ckpt: Path, record: FileRecord) -> None:
    path = ckpt / record.name
    if not path.is_file():
        raise CheckpointCorruptError(path, "missing", f"{path} is missing")
    size = path.stat().st_size
    if size < record.size_bytes:
        raise CheckpointCorruptError(
            path, "truncated", f"{path} is truncated: {size:,} of {record.size_bytes:,} bytes"
        )
    if size > record.size_bytes:
        raise CheckpointCorruptError(
            path,
            "corrupted",
            f"{path} is corrupted: {size:,} bytes, the manifest says {record.size_bytes:,}",
        )
    digest = _hash_file(path)
    if digest != record.sha256:
        raise CheckpointCorruptError(
            path,
            "corrupted",
            f"{path} is corrupted: sha256 {digest[:16]}..., the manifest says "
            f"{record.sha256[:16]}...",
        )


def verify_checkpoint(
    ckpt: PathLike, *, world_size: int | None = None, names: list[str] | None = None
) -> Manifest:
    """Check ``ckpt``'s manifest and its files' sizes and sha256 checksums.

    Reads every checked file once (sha256: about 630 MB/s on one core of the
    development machine).

    Args:
        ckpt: a checkpoint directory.
        world_size: this run's world size, when its state cannot be resharded; a
            checkpoint written by another number of ranks is then refused. Default
            None: any world size.
        names: check only these files (default None: every file of the manifest).

    Returns:
        The manifest.

    Raises:
        CheckpointCorruptError: a file is missing, truncated or corrupted, or the
            manifest is missing or unreadable (the message names the file).
        CheckpointMismatchError: another world size (when ``world_size`` is given) or
            another format version.
    """
    ckpt = Path(ckpt)
    manifest = read_manifest(ckpt)
    if world_size is not None and manifest.world_size != world_size:
        raise CheckpointMismatchError(
            ckpt,
            "world size",
            f"{ckpt} was written by {manifest.world_size} ranks, this run has {world_size} "
            "and its state cannot be resharded; launch with the same number of ranks",
        )
    _verify_files(ckpt, manifest, [r.name for r in manifest.files] if names is None else names)
    return manifest


def _verify_files(ckpt: Path, manifest: Manifest, names: list[str]) -> None:
    records = {r.name: r for r in manifest.files}
    for name in names:
        if name not in records:
            raise CheckpointCorruptError(
                ckpt / name, "missing", f"{ckpt / name} is not in the manifest"
            )
        _verify_file(ckpt, records[name])


def load_checkpoint_file(
    ckpt: PathLike,
    name: str,
    *,
    world_size: int | None = None,
    map_location: torch.device | str | None = None,
    weights_only: bool = True,
) -> Any:
    """Load file ``name`` of ``ckpt`` after :func:`verify_checkpoint` of it.

    Args:
        world_size: as in :func:`verify_checkpoint`.
        map_location: as in ``torch.load``.
        weights_only: default True: :func:`load_tensors_only` (tensors and plain
            containers only). False unpickles anything, running whatever code the file
            names: only for a file from a trusted source; shardkit never passes it.

    Raises:
        CheckpointCorruptError, CheckpointMismatchError: see :func:`verify_checkpoint`.
        CheckpointUnsafeError: the file holds something other than tensors and plain
            containers (see :func:`load_tensors_only`).
    """
    verify_checkpoint(ckpt, world_size=world_size, names=[name])
    if not weights_only:  # the caller's explicit choice, for a file it trusts
        return torch.load(Path(ckpt) / name, map_location=map_location, weights_only=False)
    return load_tensors_only(Path(ckpt) / name, map_location=map_location)


def _refusal_reason(err: pickle.UnpicklingError) -> str:
    """The line of torch's weights-only message that names the refused object."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    useful = [
        line
        for line in lines
        if not line.startswith(("Weights only load failed", "Check the documentation"))
    ]
    return " ".join(useful) or (lines[0] if lines else type(err).__name__)


def load_tensors_only(
    path: PathLike, *, map_location: torch.device | str | None = None, mmap: bool = False
) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain containers only.

    The loader of every shardkit checkpoint file (see [Note: tensors and plain
    containers only]). ``weights_only`` is passed explicitly, so the environment
    variable ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` does not turn it off.

    Args:
        path: the file.
        map_location: as in ``torch.load``. Default None.
        mmap: as in ``torch.load`` (memory-map the file). Default False.

    Raises:
        CheckpointUnsafeError: the file holds another object (a class instance, a
            function, anything a pickle could call); nothing of it was executed.
    """
    try:
        return torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointUnsafeError(
            path,
            "unsafe",
            f"{path} holds an object that is not a tensor or a plain container "
            f"({_refusal_reason(err)}); refused: loading it could run code. shardkit "
            "checkpoint files hold tensors, numbers, strings, lists, tuples and dicts "
            "only; a file from an untrusted source may have been tampered with, even "
            "with a matching manifest",
        ) from err


def _rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return group_rank(group), group_size(group)


def _write_files(
    ckpt: Path, files: Mapping[str, Any], rank: int, save: Callable[[Any, Any], None]
) -> list[FileRecord]:
    records = []
    for name, obj in files.items():
        _check_name(name)
        atomic_save(obj, ckpt / name, save=save)
        size = (ckpt / name).stat().st_size
        records.append(FileRecord(name, rank, size, _hash_file(ckpt / name)))
    return records


def _point_latest(root: Path, name: str) -> None:
    with atomic_write(root / LATEST_NAME, "w") as handle:
        handle.write(name + "\n")


def _swap_in(root: Path, step: int) -> None:
    """Steps 2-4 of [Note: commit order]: ``ckpt-<step>.new``, committed (``latest``
    names it), replaces ``ckpt-<step>``; ``latest`` then names ``ckpt-<step>``.
    Also finishes a swap that a crash interrupted (the staging directory gone: step 3
    was done)."""
    staged, ckpt = _staging(root, step), root / checkpoint_name(step)
    if staged.is_dir():
        if ckpt.exists():
            shutil.rmtree(ckpt)
        os.rename(staged, ckpt)
        fsync_dir(root)
    _point_latest(root, ckpt.name)


def _prepare(root: Path, step: int) -> tuple[str, Exception | None]:
    """Rank 0, before any rank writes: finish an interrupted swap, delete what crashed
    saves left (uncommitted staging directories), create an empty staging directory
    for ``step``. The reason and the error if that failed, else ``("", None)``."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        pointer = _pointer(root)
        if pointer is not None and pointer.group(2):  # a swap a crash interrupted
            _swap_in(root, int(pointer.group(1)))
        for stale in root.glob("ckpt-*" + _STAGING_SUFFIX):
            shutil.rmtree(stale)
        _staging(root, step).mkdir()
    except Exception as err:  # broadcast to every rank by the caller
        return f"rank 0: preparing {_staging(root, step).name}: {type(err).__name__}: {err}", err
    return "", None


def _names_staging(root: Path, step: int) -> bool:
    """Whether ``latest`` names ``ckpt-<step>.new`` (the save of ``step`` is committed
    there); False when ``latest`` cannot be read."""
    try:
        match = _pointer(root)
    except OSError:
        return False
    return match is not None and match.group(0) == _staging(root, step).name


def _discard(root: Path, step: int) -> None:
    """Delete the staging directory of a save that failed before the commit point
    (best effort: the next save's :func:`_prepare` deletes what is left)."""
    if not _names_staging(root, step):
        shutil.rmtree(_staging(root, step), ignore_errors=True)


def _commit(
    root: Path, step: int, per_rank: list[Any], layout: Mapping[str, Any], keep: int
) -> tuple[str, Exception | None]:
    """Write the manifest and swap the checkpoint in (rank 0); the reason and rank 0's
    error if that failed, else ``("", None)``. Past the commit point the reason says it
    was committed; before it, the staging directory is deleted."""
    failed = describe_failures(per_rank)
    if failed:
        _discard(root, step)
        return "not committed: " + failed, None
    staged = _staging(root, step)
    try:
        _write_manifest(staged, step, per_rank, layout)
        _point_latest(root, staged.name)  # the commit point
    except Exception as err:
        if not _names_staging(root, step):  # else committed after all: swap it in below
            _discard(root, step)
            return f"not committed: {RankFailure.of(0, err)}", err
    try:
        _swap_in(root, step)
        _prune(root, step, keep)
    except Exception as err:
        return (
            f"committed as {staged.name} (latest names it), but moving it to "
            f"{checkpoint_name(step)} failed: {type(err).__name__}: {err}; loading "
            "finds it, the next save finishes the move"
        ), err
    return "", None


def _write_manifest(
    staged: Path, step: int, per_rank: list[Any], layout: Mapping[str, Any]
) -> None:
    records = tuple(rec for recs in per_rank for rec in recs)
    names = [rec.name for rec in records]
    if len(set(names)) != len(names):
        raise ValueError(f"two ranks wrote the same file name: {sorted(names)}")
    manifest = Manifest(step, len(per_rank), records, dict(layout), time.time())
    with atomic_write(staged / MANIFEST_NAME, "w") as handle:
        handle.write(manifest.to_json())


def save_checkpoint(
    root: PathLike,
    step: int,
    files: Mapping[str, Any],
    *,
    layout: Mapping[str, Any] | None = None,
    keep: int = 0,
    group: dist.ProcessGroup | None = None,
    save: Callable[[Any, Any], None] = torch.save,
) -> Path:
    """Write this rank's ``files`` into ``root/ckpt-<step>`` and commit the checkpoint.

    A collective over ``group`` (every rank calls it; without a process group it
    works as a 1-rank job). The files go to ``ckpt-<step>.new`` first, which then
    replaces ``ckpt-<step>``: saving again at a step already saved (a resumed run)
    never rewrites the committed checkpoint in place, so a crash at any point leaves
    a complete checkpoint, the old or the new, named by ``latest``. See [Note: commit
    order] in the module docstring.

    Args:
        root: the checkpoint root directory (created if missing); shared by all ranks.
        step: the training step, for the directory name and the manifest.
        files: this rank's files, ``{name: object}``, each written with ``save``;
            names must be plain file names, distinct across ranks (e.g. ``rank3.pt``).
        layout: shard-layout metadata stored in the manifest (JSON-serializable);
            default None: ``{}``.
        keep: committed checkpoints to keep, the newest; older ones are deleted after
            the commit. Default 0: keep all.
        group: the process group; default None (the world group).
        save: serializer called as ``save(obj, file_handle)``; default ``torch.save``.

    Returns:
        The checkpoint directory.

    Raises:
        CheckpointError: (problem ``save``) on every rank, within seconds (no rank
            waits for the process group's timeout), when rank 0 could not prepare the
            staging directory, a rank could not write its files (any exception of its
            ``save``, of the file system: disk full, permission denied), two ranks
            used one name, or rank 0 could not write the manifest (the message says
            "not committed" and names each failing rank, the exception's type and
            message; ``latest`` and the committed checkpoints are unchanged, the
            staging directory is deleted); or the checkpoint was committed but rank 0
            could not move it from ``ckpt-<step>.new`` to ``ckpt-<step>`` (the message
            says so; loading finds it there, the next save finishes the move). On the
            failing rank the original exception is chained (``__cause__``).
    """
    root = Path(root)
    rank, world_size = _rank_world(group)
    json.dumps(layout or {})  # TypeError now, on every rank, if not serializable
    ckpt = root / checkpoint_name(step)
    status, error = [""], None
    if rank == 0:
        status[0], error = _prepare(root, step)
    broadcast_outcome(status, group)
    if status[0]:
        raise _save_failed(ckpt, f"not committed: {status[0]}") from error
    outcome: Any
    try:
        outcome = _write_files(_staging(root, step), files, rank, save)
    except Exception as err:  # reported on every rank below, never left to hang them
        outcome, error = RankFailure.of(rank, err), err
    per_rank: list[Any] = [outcome]
    if world_size > 1:
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, outcome, group=group)
    if rank == 0:
        status[0], commit_error = _commit(root, step, per_rank, layout or {}, keep)
        error = error or commit_error
    broadcast_outcome(status, group)
    if status[0]:
        raise _save_failed(ckpt, status[0]) from error
    return ckpt


def _save_failed(ckpt: PathLike, reason: str) -> CheckpointError:
    """The error a failed save raises on every rank: ``CheckpointError`` (problem
    ``save``), ``"saving <ckpt> failed, <reason>"``."""
    return CheckpointError(ckpt, "save", f"saving {ckpt} failed, {reason}")


def _prune(root: Path, step: int, keep: int) -> None:
    """Delete committed checkpoints older than the newest ``keep`` (0: keep all)."""
    if keep <= 0:
        return
    steps = sorted(s for p in root.iterdir() if (s := _step_of(p.name)) is not None)
    for old in [s for s in steps if s <= step][:-keep]:
        shutil.rmtree(root / checkpoint_name(old), ignore_errors=True)


def list_checkpoints(root: PathLike) -> list[Path]:
    """Committed checkpoint directories under ``root``, newest first.

    Nothing if ``latest`` does not exist (no save ever committed). Directories newer
    than the one ``latest`` names were never committed and are left out; the one it
    names is listed even if it has disappeared (verifying it then says so). While a
    save swaps a re-saved step in, ``latest`` may name ``ckpt-<step>.new``: that
    directory is listed while it exists, else ``ckpt-<step>`` (see [Note: commit
    order]).
    """
    root = Path(root)
    if not (root / LATEST_NAME).is_file():
        return []
    pointed = _pointed(root)
    steps = {s for p in root.iterdir() if p.is_dir() and (s := _step_of(p.name)) is not None}
    if pointed is None:
        return [root / checkpoint_name(s) for s in sorted(steps, reverse=True)]
    newest, named = pointed
    older = sorted((s for s in steps if s < newest), reverse=True)
    return [named] + [root / checkpoint_name(s) for s in older]


def _check_share(
    ckpt: Path, world_size: int | None, rank: int, ranks: int
) -> CheckpointError | None:
    """Verify the manifest and every ``ranks``-th file starting at ``rank``."""
    try:
        manifest = verify_checkpoint(ckpt, world_size=world_size, names=[])
        _verify_files(ckpt, manifest, [f.name for f in manifest.files[rank::ranks]])
    except CheckpointError as err:
        return err
    return None


def find_valid_checkpoint(
    root: PathLike, *, world_size: int | None = None, group: dist.ProcessGroup | None = None
) -> Path | None:
    """The newest committed checkpoint under ``root`` that passes :func:`verify_checkpoint`.

    A collective when a process group is up: the ranks split the checksum work (rank
    ``r`` hashes files ``r, r + N, ...``) and agree on the answer, so every rank
    returns the same directory. A damaged checkpoint is skipped; when an older one
    is used, one :class:`CheckpointFallbackWarning` per skipped checkpoint names it,
    the reason and the one used instead.

    Args:
        root: the checkpoint root directory.
        world_size: as in :func:`verify_checkpoint` (None: any world size).
        group: the process group; default None (the world group).

    Returns:
        The checkpoint directory, or None when none was ever committed.

    Raises:
        CheckpointMismatchError: the newest intact checkpoint does not fit this run.
        CheckpointCorruptError: checkpoints were committed but every one is damaged
            (the message lists them).
    """
    rank, ranks = _rank_world(group)
    skipped: list[tuple[Path, CheckpointError]] = []
    for ckpt in list_checkpoints(root):
        mine = _check_share(ckpt, world_size, rank, ranks)
        errors: list[Any] = [mine]
        if ranks > 1:
            errors = [None] * ranks
            dist.all_gather_object(errors, mine, group=group)
        error = next((e for e in errors if e is not None), None)
        if error is None:
            for bad, why in skipped:
                warnings.warn(
                    f"checkpoint {bad} is unusable ({why}); using {ckpt.name} instead",
                    CheckpointFallbackWarning,
                    stacklevel=2,
                )
            return ckpt
        if not isinstance(error, CheckpointCorruptError):
            raise error
        skipped.append((ckpt, error))
    if skipped:
        raise CheckpointCorruptError(
            root,
            "no valid checkpoint",
            f"no usable checkpoint in {root}: " + "; ".join(str(e) for _, e in skipped),
        )
    return None
