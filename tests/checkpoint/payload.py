"""A pickle payload planted in a checkpoint file, for the tests of safe loading."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from shardkit.checkpoint.manifest import MANIFEST_NAME, verify_checkpoint


class RunsCode:
    """Unpickling this runs ``os.system("touch <marker>")`` (pickle calls what it names)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch '{self.marker}'",))


def plant_payload(ckpt: Path, name: str, marker: Path) -> None:
    """Add a :class:`RunsCode` to the dict in ``ckpt/name``; rewrite the manifest to match."""
    path = ckpt / name
    obj = torch.load(path, weights_only=True)
    obj["note"] = RunsCode(marker)
    torch.save(obj, path)
    raw = json.loads((ckpt / MANIFEST_NAME).read_text())
    for record in raw["files"]:
        if record["name"] == name:
            record["size_bytes"] = path.stat().st_size
            record["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (ckpt / MANIFEST_NAME).write_text(json.dumps(raw))
    verify_checkpoint(ckpt)  # the checksums match: only the content can refuse it
