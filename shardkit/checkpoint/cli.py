"""``python -m shardkit.checkpoint inspect|convert``: a checkpoint from the command line.

::

    python -m shardkit.checkpoint inspect CKPT [--json]
    python -m shardkit.checkpoint convert CKPT OUT.pt|OUT.safetensors   # a universal CKPT
    python -m shardkit.checkpoint convert OLD NEW_ROOT [--optimizer CLASS]  # an old format

``CKPT`` is a checkpoint root (``latest`` names the newest committed step), one
checkpoint directory (``ckpt-<step>/`` with ``manifest.json``), or a plain directory
of shard files. ``inspect`` prints the step, format, world size, every file with its
size, sha256 and whether it matches the manifest, the parameters (name, shape,
dtype; bytes for a universal checkpoint) and the optimizer state; ``--json`` prints
the same as one object (:class:`~shardkit.checkpoint.reader.CheckpointInfo`; a param
group: ``{"num_params": 2, "hyperparameters": {...}}``); for a checkpoint in one of the
previous release's sharded formats it names the format and the command converting it.
``convert`` writes the consolidated plain ``state_dict`` of a universal checkpoint
(``torch.save`` format, or safetensors by the file's suffix), for inference or
another library; of an old-format checkpoint (:mod:`shardkit.checkpoint.legacy`) it
writes a universal checkpoint under the root ``NEW_ROOT`` (``--optimizer``: the class
that stepped it, when its hyperparameters match no ``torch.optim`` class). Both run in
one process, without ranks (see :mod:`shardkit.checkpoint.reader`).

Exit status: 0; 1 when the checkpoint is damaged, unsafe, not finished saving (a
``ckpt-<step>`` or ``ckpt-<step>.new`` a crash left) or holds nothing to convert (one
line on stderr, naming the file and why; with ``inspect --json``, one JSON object on
stdout instead: ``{"ok": false, "problem": "...", "message": "..."}``); 2 for bad
usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shardkit.checkpoint.atomic import atomic_save, atomic_write_bytes
from shardkit.checkpoint.legacy import convert_legacy, detect_format
from shardkit.checkpoint.manifest import CheckpointError
from shardkit.checkpoint.reader import (
    CheckpointInfo,
    consolidate,
    find_checkpoint_dir,
    inspect_checkpoint,
)

__all__ = ["main"]

PROG = "python -m shardkit.checkpoint"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Inspect a shardkit checkpoint, or convert it to a plain state_dict."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="print what a checkpoint holds")
    inspect.add_argument("checkpoint", type=Path, help="a checkpoint root or directory")
    inspect.add_argument("--json", action="store_true", help="print it as one JSON object")
    convert = sub.add_parser(
        "convert",
        help="write the consolidated state_dict of a universal checkpoint, or an old-format "
        "checkpoint as a universal one",
    )
    convert.add_argument("checkpoint", type=Path, help="a checkpoint root or directory")
    convert.add_argument(
        "out",
        type=Path,
        help="a universal checkpoint: the output file, .safetensors (safetensors), else "
        "torch.save; an old format: the root of the universal checkpoint to write",
    )
    convert.add_argument(
        "--optimizer",
        default=None,
        help="an old format's optimizer class name (default: the torch.optim class its "
        "hyperparameters match)",
    )
    return parser


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _format_info(info: CheckpointInfo) -> list[str]:
    lines = [
        f"checkpoint  {info.directory}",
        f"format      {info.format}: {info.kind}",
        f"step        {info.step if info.step is not None else '- (no manifest)'}",
        f"world size  {info.world_size if info.world_size is not None else '-'}",
    ]
    if info.created_unix_s:
        created = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(info.created_unix_s))
        lines.append(f"created     {created}")
    if info.layout:
        # a universal checkpoint's keys and groups are listed below, not in one line
        shown = {k: v for k, v in info.layout.items() if k not in ("keys", "optimizer")}
        lines.append(f"layout      {json.dumps(shown, sort_keys=True)}")
    total = sum(f.size_bytes for f in info.files)
    lines.append(f"files       {len(info.files)}, {total:,} bytes ({_mib(total)})")
    for f in info.files:
        rank = "-" if f.rank is None else str(f.rank)
        lines.append(
            f"  {f.name}  rank {rank}  {f.size_bytes:,} bytes  sha256 {f.sha256 or '-'}  {f.status}"
        )
    for key, unit in info.units.items():
        lines.append(
            f"unit        {key}: {unit['total']:,} elements, {unit['shard_numel']:,} per rank, "
            f"padding {unit['padding']}"
        )
    if info.params:
        numel = sum(_numel(p.shape) for p in info.params)
        lines.append(f"parameters  {len(info.params)} tensors, {numel:,} elements")
        width = max(len(p.name) for p in info.params)
        for p in info.params:
            where = f"  ({p.unit})" if p.unit else ""
            size = f"  {p.size_bytes:,} bytes" if p.size_bytes is not None else ""
            lines.append(f"  {p.name:<{width}}  {list(p.shape)}  {p.dtype}{size}{where}")
    if info.optimizer is not None:
        opt = info.optimizer
        lines.append(f"optimizer   state keys {', '.join(opt['state_keys']) or '-'}")
        if opt.get("scalar_keys"):
            lines.append(f"  scalar state {', '.join(opt['scalar_keys'])}")
        for i, group in enumerate(opt["param_groups"]):
            lines.append(f"  group {i}: {_group_line(group)}")
        if "owned_by_rank" in opt:
            for rank, owned in opt["owned_by_rank"].items():
                lines.append(f"  rank {rank}: state of parameters {owned}")
    lines.extend(f"note        {note}" for note in info.notes)
    return lines


def _group_line(group: dict[str, Any]) -> str:
    """A param group of the reader (``{"num_params", "hyperparameters"}``) as ``2
    parameters, hyperparameters {...}``; without the count (None: FSDP's format does
    not record it) the hyperparameters only."""
    shown = f"hyperparameters {json.dumps(group['hyperparameters'], sort_keys=True)}"
    count = group["num_params"]
    if count is None:
        return shown
    return f"{count} parameter{'' if count == 1 else 's'}, {shown}"


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _inspect(args: argparse.Namespace) -> int:
    info = inspect_checkpoint(args.checkpoint)
    if args.json:
        print(json.dumps(asdict(info), indent=1, sort_keys=True))
    else:
        print("\n".join(_format_info(info)))
    return 0 if info.intact else 1


def _convert(args: argparse.Namespace) -> int:
    out: Path = args.out
    ckpt = find_checkpoint_dir(args.checkpoint)
    if detect_format(ckpt) is not None:
        written = convert_legacy(ckpt, out, args.optimizer)
        print(f"wrote {written}: a universal checkpoint (load_universal, any strategy)")
        return 0
    if not out.parent.is_dir():
        raise FileNotFoundError(f"{out.parent} (the output's directory) does not exist")
    state, notes = consolidate(args.checkpoint)
    if out.suffix == ".safetensors":
        from safetensors.torch import save  # pinned in requirements.txt / setup.py

        # one tensor per key: safetensors refuses storage shared between keys
        tensors = {k: v.contiguous().clone() for k, v in state.items()}
        atomic_write_bytes(out, save(tensors, metadata={"format": "pt"}))
    else:
        atomic_save(state, out)
    numel = sum(v.numel() for v in state.values())
    print(f"wrote {out}: {len(state)} tensors, {numel:,} elements, {out.stat().st_size:,} bytes")
    for note in notes:
        print(f"note: {note}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); the exit status."""
    args = _parser().parse_args(argv)
    try:
        return _inspect(args) if args.command == "inspect" else _convert(args)
    except (CheckpointError, ValueError, FileNotFoundError) as err:
        if getattr(args, "json", False):  # scripts parse stdout: the error as JSON too
            print(json.dumps(_error_object(err), indent=1, sort_keys=True))
        else:
            print(f"{PROG} {args.command}: error: {err}", file=sys.stderr)
        return 1


def _error_object(err: Exception) -> dict[str, Any]:
    """``inspect --json``'s output for a checkpoint it cannot read: ``ok`` false, the
    ``problem`` (a :class:`CheckpointError`'s word, ``not found`` for a path that is not
    a checkpoint, ``invalid`` for another refusal) and the one-line ``message``."""
    if isinstance(err, CheckpointError):
        problem = err.problem
    else:
        problem = "not found" if isinstance(err, FileNotFoundError) else "invalid"
    return {"ok": False, "problem": problem, "message": str(err)}
