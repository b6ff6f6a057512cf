"""The disk tier's directory as files: its format, the names it owns, and their removal
(:func:`remove_offloaded`); :class:`~shardkit.nn.offload.disk.DiskTier` writes it."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from shardkit.checkpoint.generations import MANIFEST

__all__ = ["FORMAT", "OWNED", "check_layouts", "remove_offloaded"]

FORMAT = "shardkit.offload/2"  # /1: optimizer state as torch.save files
_FORMATS = ("shardkit.offload/1", FORMAT)  # what remove_offloaded deletes
OWNED = re.compile(r"^(\.?(slice\d+|shared|buffers)\..*|\.manifest\.json\..*\.tmp)$")
"""The names of the files the disk tier owns (its temporary files start with a dot)."""


def remove_offloaded(directory: str | os.PathLike[str]) -> bool:
    """Delete the offloaded model that ``directory`` holds: its manifest first (so an
    interrupted removal leaves no model), then every file the disk tier owns; other
    files stay. Returns whether there was one.

    For a job whose state lives elsewhere (a universal checkpoint) and that starts the
    disk tier afresh there (``resume=False`` refuses a directory holding a model).

    Raises:
        ValueError: ``directory``'s manifest is not the disk tier's (say FSDP's disk
            tier): nothing is deleted.
    """
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return False
    fmt = json.loads(manifest.read_text()).get("format")
    if fmt not in _FORMATS:
        raise ValueError(
            f"{str(directory)!r} holds {MANIFEST} of format {fmt!r}, not an offloaded "
            f"model ({FORMAT!r}); not deleting it"
        )
    manifest.unlink()
    for name in os.listdir(directory):
        if OWNED.match(name) or (name.endswith(".tmp") and OWNED.match(name[1:])):
            with contextlib.suppress(FileNotFoundError):
                (directory / name).unlink()
    return True


def check_layouts(
    stored: dict[str, list[dict[str, object]]], mine: dict[str, list[dict[str, object]]]
) -> None:
    """Refuse a directory whose slices' layouts (``stored``, from its manifest) are not
    the model's (``mine``), naming the first difference.

    Raises:
        ValueError: other slices, or another entry in a slice.
    """
    if sorted(stored) != sorted(mine):
        raise ValueError(
            f"offload_dir holds slices {sorted(stored)} but this model has {sorted(mine)}; "
            "use the same num_slices (and model) as the run that wrote it"
        )
    for name, entries in mine.items():
        if stored[name] != entries:
            diff = next((a, b) for a, b in zip(stored[name] + [{}], entries + [{}]) if a != b)
            raise ValueError(
                f"{name} in offload_dir does not match the model: stored {diff[0]}, "
                f"model {diff[1]}; use the architecture that wrote the directory"
            )
