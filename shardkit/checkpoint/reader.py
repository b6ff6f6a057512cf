"""What a checkpoint holds, and its consolidated ``state_dict``, offline (no ranks).

The engine of ``python -m shardkit.checkpoint inspect|convert`` (:mod:`.cli`). It reads
a checkpoint directory in one process, without a process group and without the model:

- any manifest checkpoint (:mod:`shardkit.checkpoint.manifest`): step, world size,
  layout, every file's size, sha256 and whether it matches;
- an FSDP sharded checkpoint (``save_fsdp_sharded``, format ``shardkit.fsdp_sharded/1``):
  every parameter's name, shape and dtype, and the full parameters, put together from
  the ranks' flat shards;
- an OSS sharded checkpoint (``OSS.save_sharded``, format ``shardkit.sharded_optim/1``):
  the optimizer state it holds (it holds no parameters);
- a checkpoint of the main job (``examples/train_gpt.py``): its strategy and model
  flags, and the names and shapes of rank 0's model state;
- a universal checkpoint (:mod:`shardkit.checkpoint.universal`, format
  ``shardkit.universal/1``): the saving strategy, every key's shape, dtype and bytes,
  the optimizer's param groups and state names (from the shard files' headers), and
  the full tensors, each put together from the byte ranges of its pieces.

[Note: reading a wrapper's format without importing the wrapper]
The layers forbid ``shardkit.checkpoint`` to import ``shardkit.nn`` (a lower layer
never imports a higher one; see docs/architecture.md). The FSDP sharded format is
plain data (dicts, lists, ints, strings and tensors, documented in
``shardkit.nn.data_parallel.fully_sharded.sharded_checkpoint``), so this module reads
it through that documented structure: which slice of which parameter each file
holds (a universal checkpoint says it in its shard files' headers). It only reads: the format stays the FSDP
package's. ``tests/checkpoint/test_cli.py`` runs it on checkpoints written by the
real ``save_fsdp_sharded`` and checks :data:`FSDP_SHARDED_FORMAT` against the FSDP
package's constant, so a change of the format fails there.

[Note: names in the FSDP format]
A unit's record names each parameter by its first location relative to the unit's
wrapped module; the output key is ``<unit path>.<name>``. Format version 1 does not
record a tied parameter's other names (a GPT's ``lm_head.weight``, tied to
``wte.weight``), nor which names inside a unit are wrapper attributes
(``checkpoint_wrapper``'s ``module.``), nor which buffers are persistent: the
consolidated dict then has the tied weight under its first name only, and those
names as recorded (:func:`consolidate` returns a note saying so). A unit record with
``"keys"`` (per parameter, the list of its state-dict keys) and a record with
``"buffer_keys"`` (``{recorded buffer name: state-dict key}``, persistent buffers
only) are read as given, with no note.

Files are read with :func:`~shardkit.checkpoint.manifest.load_tensors_only`
(memory-mapped, tensors and plain containers only): a parameter is read from the
byte ranges of the shards that hold it.

Why this module is long: it reads five checkpoint formats offline (manifest, FSDP
sharded, OSS sharded, the main job's, universal), a few small functions each; reading
only the manifest and the universal format (older ones through convert) shortens it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardkit.checkpoint.flat import read_flat_range
from shardkit.checkpoint.manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    CheckpointError,
    Manifest,
    _saved_step,
    _step_of,
    list_checkpoints,
    load_tensors_only,
    not_the_committed_save,
    read_manifest,
    verify_checkpoint,
)
from shardkit.checkpoint.universal.loader import read_saved_index, read_tensor
from shardkit.checkpoint.universal.meta import FORMAT as UNIVERSAL_FORMAT

__all__ = [
    "FSDP_SHARDED_FORMAT",
    "OSS_SHARDED_FORMAT",
    "UNIVERSAL_FORMAT",
    "CheckpointInfo",
    "FileInfo",
    "ParamInfo",
    "consolidate",
    "find_checkpoint_dir",
    "inspect_checkpoint",
]

FSDP_SHARDED_FORMAT = "shardkit.fsdp_sharded/1"
"""``save_fsdp_sharded``'s format (the FSDP package's ``FSDP_SHARD_FORMAT``)."""
OSS_SHARDED_FORMAT = "shardkit.sharded_optim/1"
"""``OSS.save_sharded``'s format (:data:`shardkit.checkpoint.sharded_optim.SHARD_FORMAT`)."""

PathLike = str | os.PathLike[str]
_FSDP_FILE = re.compile(r"fsdp-shard-(\d+)-of-(\d+)\.pt")
_OSS_FILE = re.compile(r"optim-shard-(\d+)-of-(\d+)\.pt")
_KIND = {
    FSDP_SHARDED_FORMAT: "FSDP sharded (flat parameter shards per unit, one file per rank)",
    OSS_SHARDED_FORMAT: "OSS sharded (optimizer state only, one file per rank)",
    UNIVERSAL_FORMAT: "universal (pieces of every tensor and its optimizer state, one "
    "safetensors file per rank; loads into any strategy at any world size)",
}


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
    unit: str  # the FSDP unit key, "buffer", or "" where the format has no units
    size_bytes: int | None = None  # the full tensor's bytes, where the format says


@dataclass
class CheckpointInfo:
    """What :func:`inspect_checkpoint` found (``json``-serializable through ``asdict``).

    Attributes:
        directory: the checkpoint directory read.
        format: the content's format (the manifest layout's ``format``; ``main job``
            for the main job's checkpoints; ``unknown``).
        kind: the format in words.
        step, world_size, created_unix_s, layout: from the manifest (None without one).
        files: every file, with its checksum status.
        params: the parameters (and buffers) a consolidated state dict holds, in order;
            empty when the checkpoint holds none (OSS) or cannot be read.
        optimizer: a summary of the optimizer state, if any: ``param_groups``, per
            group ``{"num_params": its parameter count (None for FSDP: the format
            does not record it), "hyperparameters": {...}}``; the state keys; the
            parameters with state.
        units: FSDP: per unit key, ``{"total", "shard_numel", "padding"}``.
        notes: what a reader should know (names the format does not record, etc.).
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
    shard_files = any(_FSDP_FILE.fullmatch(n) or _OSS_FILE.fullmatch(n) for n in names)
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
        names = sorted(
            e.name
            for e in ckpt.iterdir()
            if _FSDP_FILE.fullmatch(e.name) or _OSS_FILE.fullmatch(e.name)
        )
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
    if manifest is not None:
        fmt = manifest.layout.get("format")
        if isinstance(fmt, str):
            return fmt
        if "strategy" in manifest.layout:
            return "main job"
        return "unknown"
    names = [e.name for e in ckpt.iterdir()]
    if any(_FSDP_FILE.fullmatch(n) for n in names):
        return FSDP_SHARDED_FORMAT
    if any(_OSS_FILE.fullmatch(n) for n in names):
        return OSS_SHARDED_FORMAT
    return "unknown"


def _rank_files(ckpt: Path, pattern: re.Pattern[str]) -> list[Path]:
    """The shard files of one save, in rank order; refuses a mix or a gap."""
    found: dict[tuple[int, int], Path] = {}
    for entry in ckpt.iterdir():
        match = pattern.fullmatch(entry.name)
        if match:
            found[(int(match.group(1)), int(match.group(2)))] = entry
    sizes = sorted({n for _, n in found})
    if len(sizes) != 1:
        raise ValueError(f"{ckpt}: expected the shard files of one save, found world sizes {sizes}")
    (n,) = sizes
    missing = [r for r in range(n) if (r, n) not in found]
    if missing:
        raise ValueError(f"{ckpt}: shard files of ranks {missing} (of {n}) missing")
    return [found[(r, n)] for r in range(n)]


def _open(files: list[Path]) -> list[dict[str, Any]]:
    records = [load_tensors_only(p, map_location="cpu", mmap=True) for p in files]
    for path, record in zip(files, records):
        if not isinstance(record, dict):
            raise ValueError(f"{path} holds a {type(record).__name__}, expected a dict")
    return records


def _unit_prefix(key: str) -> str:
    """``"blocks.0.flat_param"`` -> ``"blocks.0."``; ``"flat_param"`` -> ``""``."""
    return key[: -len("flat_param")]


def _unit_keys(key: str, unit: dict[str, Any]) -> list[list[str]]:
    """Per parameter of a unit, in flat order: its state-dict keys (see [Note: names in
    the FSDP format])."""
    if "keys" in unit:
        return [list(keys) for keys in unit["keys"]]
    return [[_unit_prefix(key) + name] for name in unit["names"]]


def _fsdp_notes(records: list[dict[str, Any]]) -> list[str]:
    first = records[0]
    notes = []
    if not all("keys" in unit for unit in first["units"].values()):
        notes.append(
            f"format {FSDP_SHARDED_FORMAT} records each parameter under its first name "
            "only: a tied parameter's other names (e.g. an LM head tied to the token "
            "embedding) are not in the output (tie them again after loading with "
            "strict=False), and names inside a unit keep wrapper attributes "
            "(checkpoint_wrapper's 'module.')"
        )
    if first["buffers"] and "buffer_keys" not in first:
        notes.append(
            "buffers are named as the wrapped model's named_buffers() (wrapper "
            "attributes kept; non-persistent buffers included)"
        )
    return notes


def _check_fsdp_records(files: list[Path], records: list[dict[str, Any]]) -> None:
    n = len(records)
    for rank, (path, record) in enumerate(zip(files, records)):
        if record.get("format") != FSDP_SHARDED_FORMAT:
            raise ValueError(
                f"{path} has format {record.get('format')!r}, expected {FSDP_SHARDED_FORMAT!r}"
            )
        if (record.get("rank"), record.get("world_size")) != (rank, n):
            raise ValueError(
                f"{path} says rank {record.get('rank')} of {record.get('world_size')}, "
                f"its name says {rank} of {n}: the files come from different saves"
            )
        if set(record["units"]) != set(records[0]["units"]):
            raise ValueError(f"{path} has other units than {files[0]}: different saves")


def _fsdp_params(records: list[dict[str, Any]]) -> list[ParamInfo]:
    out: list[ParamInfo] = []
    for key, unit in records[0]["units"].items():
        dtype = str(unit["flat"].dtype).removeprefix("torch.")
        for keys, shape in zip(_unit_keys(key, unit), unit["shapes"]):
            out.extend(ParamInfo(k, list(shape), dtype, key) for k in keys)
    for name, buf in _fsdp_buffers(records[0]).items():
        out.append(
            ParamInfo(name, list(buf.shape), str(buf.dtype).removeprefix("torch."), "buffer")
        )
    return out


def _fsdp_buffers(record: dict[str, Any]) -> dict[str, torch.Tensor]:
    buffers: dict[str, torch.Tensor] = record["buffers"]
    if "buffer_keys" in record:
        return {key: buffers[name] for name, key in record["buffer_keys"].items()}
    return dict(buffers)


def _optim_summary_fsdp(record: dict[str, Any]) -> dict[str, Any] | None:
    optim = record.get("optim")
    if optim is None:
        return None
    keys = sorted({sk for unit in optim["flat"].values() for sk in unit})
    scalars = sorted({sk for per_param in optim["scalars"].values() for sk in per_param})
    return {
        "param_groups": [_plain_group(g) for g in optim["param_groups"]],
        "state_keys": keys,
        "scalar_keys": scalars,
        "units_with_state": sum(1 for unit in optim["flat"].values() if unit),
    }


def _plain_group(group: dict[str, Any]) -> dict[str, Any]:
    """A torch param group (``params``: parameter indices; FSDP's format drops them)
    as :func:`_group_summary` reports it."""
    hyper = {k: v for k, v in group.items() if k != "params"}
    return _group_summary(len(group["params"]) if "params" in group else None, hyper)


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


def _optim_summary_oss(records: list[dict[str, Any]]) -> dict[str, Any]:
    owned = {rec["rank"]: sorted(rec["state"]) for rec in records}
    keys = sorted({sk for rec in records for st in rec["state"].values() for sk in st})
    return {
        "param_groups": [_plain_group(g) for g in records[0]["param_groups"]],
        "state_keys": keys,
        "params_with_state": sum(len(v) for v in owned.values()),
        "owned_by_rank": {str(r): v for r, v in sorted(owned.items())},
    }


def _model_state_params(record: Any) -> list[ParamInfo]:
    """Rank 0's model state of a main-job checkpoint, where it is a dict of tensors."""
    state = record.get("strategy", {}).get("model") if isinstance(record, dict) else None
    if not isinstance(state, dict):
        return []
    return [
        ParamInfo(k, list(v.shape), str(v.dtype).removeprefix("torch."), "")
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    ]


def inspect_checkpoint(path: PathLike) -> CheckpointInfo:
    """What the checkpoint at ``path`` holds (see :func:`find_checkpoint_dir` for what
    ``path`` may be). Verifies every file's checksum; reads the content only when
    every file is intact.

    Raises:
        FileNotFoundError: see :func:`find_checkpoint_dir`.
        CheckpointError: the manifest is missing, unreadable or of another version
            (a directory without one is read as a plain directory of shard files only
            if it holds no ``manifest.json``); a file holds something other than
            tensors and plain containers (``CheckpointUnsafeError``).
        ValueError: the shard files do not form one save.
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
    if fmt == FSDP_SHARDED_FORMAT:
        files = _rank_files(ckpt, _FSDP_FILE)
        records = _open(files)
        _check_fsdp_records(files, records)
        info.world_size = len(records)
        info.params = _fsdp_params(records)
        info.optimizer = _optim_summary_fsdp(records[0])
        info.units = {
            key: {
                "total": int(unit["total"]),
                "shard_numel": int(unit["shard_numel"]),
                "padding": int(unit["shard_numel"]) * len(records) - int(unit["total"]),
            }
            for key, unit in records[0]["units"].items()
        }
        info.notes.extend(_fsdp_notes(records))
    elif fmt == OSS_SHARDED_FORMAT:
        records = _open(_rank_files(ckpt, _OSS_FILE))
        info.world_size = len(records)
        info.optimizer = _optim_summary_oss(records)
        info.notes.append("optimizer state only: the parameters are saved with the model")
    elif fmt == UNIVERSAL_FORMAT and manifest is not None:
        _inspect_universal(info, ckpt, manifest)
    elif fmt == "main job" and manifest is not None:
        rank0 = [f.name for f in manifest.files if f.rank == 0]
        if rank0:
            info.params = _model_state_params(
                load_tensors_only(ckpt / rank0[0], map_location="cpu", mmap=True)
            )
            info.notes.append(
                f"parameters: rank 0's model state ({rank0[0]}), as strategy "
                f"{manifest.layout.get('strategy')!r} keeps it (a shard for fsdp and pipe)"
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
    or FSDP sharded checkpoint at ``path``, and notes on what it lacks (see [Note:
    names in the FSDP format]; a universal checkpoint's tied tensors come under each of
    their keys). Verifies the checksums of the files first.

    Each parameter is read from the byte ranges of the shard files that hold it
    (memory-mapped); the output holds the whole model once.

    Raises:
        CheckpointCorruptError: a file does not match the manifest.
        CheckpointUnsafeError: a file holds something other than tensors and plain
            containers.
        ValueError: the checkpoint holds no parameters (OSS: optimizer state only;
            another format), or its files do not form one save.
        FileNotFoundError: see :func:`find_checkpoint_dir`.
    """
    ckpt = find_checkpoint_dir(path)
    manifest = read_manifest(ckpt) if (ckpt / MANIFEST_NAME).is_file() else None
    fmt = _detect_format(ckpt, manifest)
    if fmt == UNIVERSAL_FORMAT and manifest is not None:
        verify_checkpoint(ckpt)
        return _consolidate_universal(ckpt, manifest), []
    if fmt != FSDP_SHARDED_FORMAT:
        what = {
            OSS_SHARDED_FORMAT: "an OSS sharded checkpoint holds optimizer state only, no "
            "parameters (the model is saved on its own: model.state_dict())",
            "main job": "a checkpoint of the main job: its consolidated model is "
            "model.pt in --out-dir, written at the end of the run",
        }.get(fmt, f"format {fmt!r} is not one convert reads")
        raise ValueError(
            f"{ckpt}: nothing to convert: {what}; convert reads universal checkpoints "
            f"({UNIVERSAL_FORMAT}) and FSDP sharded checkpoints ({FSDP_SHARDED_FORMAT})"
        )
    if manifest is not None:
        verify_checkpoint(ckpt)
    files = _rank_files(ckpt, _FSDP_FILE)
    records = _open(files)
    _check_fsdp_records(files, records)
    state: dict[str, torch.Tensor] = {}
    for key, unit in records[0]["units"].items():
        shards = [rec["units"][key]["flat"] for rec in records]
        offset = 0
        for keys, shape in zip(_unit_keys(key, unit), unit["shapes"]):
            numel = _numel(shape)
            value = read_flat_range(shards, int(unit["shard_numel"]), offset, offset + numel)
            tensor = value.clone().reshape(shape)
            for k in keys:
                state[k] = tensor
            offset += numel
        if offset > int(unit["total"]):
            raise ValueError(
                f"unit {key!r}: parameters of {offset} elements, total {unit['total']}"
            )
    for name, buf in _fsdp_buffers(records[0]).items():
        state[name] = buf.clone()
    return state, _fsdp_notes(records)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
