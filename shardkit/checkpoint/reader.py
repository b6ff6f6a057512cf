"""What a checkpoint holds, and its consolidated ``state_dict``, offline (no ranks).

The engine of ``python -m shardkit.checkpoint inspect|convert`` (:mod:`.cli`). It reads
a checkpoint directory in one process, without a process group and without the model,
and reads two things only:

- the manifest of any manifest checkpoint (:mod:`shardkit.checkpoint.manifest`): step,
  world size, layout, every file's size, sha256 and whether it matches;
- a universal checkpoint (:mod:`shardkit.checkpoint.universal`, format
  ``shardkit.universal/1``): the saving strategy, every key's shape, dtype and bytes,
  the optimizer's param groups and state names (from the shard files' headers), and
  the full tensors, each put together from the byte ranges of its pieces.

A checkpoint in one of the previous release's sharded formats (FSDP, OSS, tensor
parallel: :mod:`shardkit.checkpoint.legacy`) is named, with the command that converts
it; its content is read only by that conversion.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardkit.checkpoint.legacy import FORMATS as LEGACY_FORMATS
from shardkit.checkpoint.legacy import detect_format as legacy_format
from shardkit.checkpoint.manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    CheckpointError,
    Manifest,
    _saved_step,
    _step_of,
    list_checkpoints,
    not_the_committed_save,
    read_manifest,
    verify_checkpoint,
)
from shardkit.checkpoint.universal.loader import read_saved_index, read_tensor
from shardkit.checkpoint.universal.meta import FORMAT as UNIVERSAL_FORMAT

__all__ = [
    "UNIVERSAL_FORMAT",
    "CheckpointInfo",
    "FileInfo",
    "ParamInfo",
    "consolidate",
    "find_checkpoint_dir",
    "inspect_checkpoint",
]

PathLike = str | os.PathLike[str]
_KIND = {
    UNIVERSAL_FORMAT: "universal (pieces of every tensor and its optimizer state, one "
    "safetensors file per rank; loads into any strategy at any world size)",
    **LEGACY_FORMATS,
}
CONVERT = "python -m shardkit.checkpoint convert"


@dataclass(frozen=True)
class FileInfo:
    """One file: name, writer rank (None: unknown), bytes, sha256, and ``status``:
    ``"ok"``, or the problem (``"corrupted: ..."``); ``"unchecked"`` without a manifest."""

    name: str
    rank: int | None
    size_bytes: int
    sha256: str
    status: str


@dataclass(frozen=True)
class ParamInfo:
    """One parameter or buffer of the consolidated state dict."""

    name: str
    shape: list[int]
    dtype: str
    unit: str  # "" (kept for the JSON shape of earlier releases)
    size_bytes: int | None = None  # the full tensor's bytes, where the format says


@dataclass
class CheckpointInfo:
    """What :func:`inspect_checkpoint` found (``json``-serializable through ``asdict``).

    Attributes:
        directory: the checkpoint directory read.
        format: the content's format (the manifest layout's ``format``; an old
            format's tag, :mod:`shardkit.checkpoint.legacy`; ``main job`` for the
            main job's checkpoints of the previous release; ``unknown``).
        kind: the format in words.
        step, world_size, created_unix_s, layout: from the manifest (None without one).
        files: every file, with its checksum status.
        params: the parameters (and buffers) a consolidated state dict holds, in order
            (a universal checkpoint; empty otherwise).
        optimizer: a summary of the optimizer state, if any: ``class``,
            ``param_groups``, per group ``{"num_params": its parameter count,
            "hyperparameters": {...}}``; the state keys; the parameters with state.
        units: empty (kept for the JSON shape of earlier releases).
        notes: what a reader should know (an old format: the command converting it).
    """

    directory: str
    format: str
    kind: str
    step: int | None = None
    world_size: int | None = None
    created_unix_s: float | None = None
    layout: dict[str, Any] = field(default_factory=dict)
    files: list[FileInfo] = field(default_factory=list)
    params: list[ParamInfo] = field(default_factory=list)
    optimizer: dict[str, Any] | None = None
    units: dict[str, dict[str, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def intact(self) -> bool:
        """Every file matches the manifest (or there is no manifest to check against)."""
        return all(f.status in ("ok", "unchecked") for f in self.files)


def find_checkpoint_dir(path: PathLike) -> Path:
    """The checkpoint directory ``path`` means: a root's newest committed checkpoint
    (named by ``latest``), a checkpoint directory (``manifest.json``), or a plain
    directory of shard files.

    A save's staging directory ``ckpt-<step>.new`` (see [Note: commit order] in
    :mod:`shardkit.checkpoint.manifest`) is read only while the root's ``latest``
    names it (committed, a crash before the rename); otherwise its save did not
    finish, even with a manifest (a crash before the commit point).

    Raises:
        FileNotFoundError: ``path`` is not a directory, a root where nothing was
            committed, a ``ckpt-<step>`` or ``ckpt-<step>.new`` directory whose save
            did not finish (no ``manifest.json``; a ``ckpt-<step>`` holding shard
            files is a plain directory of them), or a ``ckpt-<step>.new`` that
            ``latest`` does not name.
    """
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{p} is not a directory")
    if (p / LATEST_NAME).is_file():
        committed = list_checkpoints(p)
        if not committed:
            raise FileNotFoundError(f"{p}: no committed checkpoint")
        return committed[0]
    names = [e.name for e in p.iterdir()]
    step = _saved_step(p.name)
    staging = step is not None and _step_of(p.name) is None  # ckpt-<step>.new
    shard_files = legacy_format(p) is not None
    if step is not None and MANIFEST_NAME not in names and (staging or not shard_files):
        raise FileNotFoundError(
            f"{p}: this save did not finish (no {MANIFEST_NAME!r}; files: "
            f"{sorted(names)}); use the root's newest committed one"
        )
    uncommitted = not_the_committed_save(p)
    if uncommitted is not None:
        raise FileNotFoundError(uncommitted)
    return p


def _file_infos(ckpt: Path, manifest: Manifest | None) -> list[FileInfo]:
    if manifest is None:
        names = sorted(e.name for e in ckpt.iterdir() if e.is_file())
        return [FileInfo(n, None, (ckpt / n).stat().st_size, "", "unchecked") for n in names]
    infos = []
    for record in manifest.files:
        try:
            verify_checkpoint(ckpt, names=[record.name])
            status = "ok"
        except CheckpointError as err:
            status = f"{err.problem}: {err}"
        infos.append(FileInfo(record.name, record.rank, record.size_bytes, record.sha256, status))
    return infos


def _detect_format(ckpt: Path, manifest: Manifest | None) -> str:
    old = legacy_format(ckpt)
    if old is not None:
        return old
    if manifest is not None:
        fmt = manifest.layout.get("format")
        if isinstance(fmt, str):
            return fmt
        if "strategy" in manifest.layout:
            return "main job"
    return "unknown"


def _group_summary(num_params: int | None, hyper: dict[str, Any]) -> dict[str, Any]:
    """One param group of :attr:`CheckpointInfo.optimizer`: ``{"num_params": its
    parameter count (None where the format does not record it), "hyperparameters":
    {name: value}}``, values made JSON-serializable by :func:`_plain`."""
    return {"num_params": num_params, "hyperparameters": {k: _plain(v) for k, v in hyper.items()}}


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it: a tuple or list as a list of plain values, None,
    a bool, number or string as is, anything else as its ``repr``."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _convert_note(ckpt: Path, fmt: str) -> str:
    return (
        f"format {fmt} is the previous release's, which this release no longer loads: "
        f"convert it to a universal checkpoint with `{CONVERT} {ckpt} <new root>`, "
        "then load that (load_universal, or the wrapper's load function)"
    )


def inspect_checkpoint(path: PathLike) -> CheckpointInfo:
    """What the checkpoint at ``path`` holds (see :func:`find_checkpoint_dir` for what
    ``path`` may be). Verifies every file's checksum; reads the content only when
    every file is intact.

    Raises:
        FileNotFoundError: see :func:`find_checkpoint_dir`.
        CheckpointError: the manifest is missing, unreadable or of another version
            (a directory without one is read as a plain directory of shard files only
            if it holds no ``manifest.json``); a file holds something other than
            tensors and plain containers (``CheckpointUnsafeError``: a universal
            checkpoint's ``extra`` files are not read here).
    """
    ckpt = find_checkpoint_dir(path)
    manifest = read_manifest(ckpt) if (ckpt / MANIFEST_NAME).is_file() else None
    fmt = _detect_format(ckpt, manifest)
    info = CheckpointInfo(str(ckpt), fmt, _KIND.get(fmt, fmt))
    if manifest is not None:
        info.step, info.world_size = manifest.step, manifest.world_size
        info.created_unix_s, info.layout = manifest.created_unix_s, dict(manifest.layout)
    info.files = _file_infos(ckpt, manifest)
    if not info.intact:
        info.notes.append("damaged files: the content was not read")
        return info
    if fmt in LEGACY_FORMATS:
        info.notes.append(_convert_note(ckpt, fmt))
    elif fmt == UNIVERSAL_FORMAT and manifest is not None:
        _inspect_universal(info, ckpt, manifest)
    elif fmt == "main job":
        info.notes.append(
            "a checkpoint of the main job of the previous release (files only): resume "
            "it with that release; its consolidated model is model.pt in --out-dir"
        )
    return info


def _inspect_universal(info: CheckpointInfo, ckpt: Path, manifest: Manifest) -> None:
    layout = manifest.layout
    for key, meta in layout["keys"].items():
        dtype = getattr(torch, meta["dtype"])
        size = _numel(meta["shape"]) * torch.empty(0, dtype=dtype).element_size()
        info.params.append(ParamInfo(key, list(meta["shape"]), meta["dtype"], "", size))
    index = read_saved_index(ckpt, manifest)
    optim = layout.get("optimizer")
    if optim is not None:
        info.optimizer = {
            "class": optim["class"],
            "param_groups": [
                _group_summary(len(group["keys"]), group["hyper"])
                for group in optim["param_groups"]
            ],
            "state_keys": sorted({s for _, s in index.pieces if s}),
            "scalar_keys": sorted({s for per in index.scalars.values() for s in per}),
            "params_with_state": len({k for k, s in index.pieces if s}),
        }
    info.notes.append(
        f"saved by strategy {layout.get('strategy')!r} on {manifest.world_size} ranks; "
        "load_universal loads it into any strategy at any world size"
    )


def _consolidate_universal(ckpt: Path, manifest: Manifest) -> dict[str, torch.Tensor]:
    index = read_saved_index(ckpt, manifest)
    state = {
        key: read_tensor(ckpt, index, key, tuple(meta["shape"]), meta["dtype"])
        for key, meta in manifest.layout["keys"].items()
    }
    for alias, key in manifest.layout.get("aliases", {}).items():
        state[alias] = state[key]  # a tied weight under each of its names
    return state


def consolidate(path: PathLike) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The full ``state_dict`` (original parameter names, full shapes) of the universal
    checkpoint at ``path``, and notes (none today); a tied tensor comes under each of
    its keys. Verifies the checksums of the files first.

    Each parameter is read from the byte ranges of the shard files that hold it
    (memory-mapped); the output holds the whole model once.

    Raises:
        CheckpointCorruptError: a file does not match the manifest.
        ValueError: not a universal checkpoint (an old format: the message gives the
            command that converts it to one).
        FileNotFoundError: see :func:`find_checkpoint_dir`.
    """
    ckpt = find_checkpoint_dir(path)
    manifest = read_manifest(ckpt) if (ckpt / MANIFEST_NAME).is_file() else None
    fmt = _detect_format(ckpt, manifest)
    if fmt == UNIVERSAL_FORMAT and manifest is not None:
        verify_checkpoint(ckpt)
        return _consolidate_universal(ckpt, manifest), []
    what = {
        "main job": "a checkpoint of the main job of the previous release: its "
        "consolidated model is model.pt in --out-dir, written at the end of the run",
    }.get(fmt, f"format {fmt!r} is not one convert reads")
    raise ValueError(
        f"{ckpt}: nothing to convert: {what}; convert reads universal checkpoints "
        f"({UNIVERSAL_FORMAT}) and the previous release's sharded formats "
        f"({', '.join(sorted(LEGACY_FORMATS))})"
    )


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
