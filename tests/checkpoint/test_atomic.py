"""Atomic writes: the old file survives a failure mid-save; no temporary file is left."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardkit.checkpoint import atomic_save, atomic_write, atomic_write_bytes


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    atomic_save({"w": torch.arange(4.0)}, path)
    assert torch.equal(torch.load(path)["w"], torch.arange(4.0))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_failure_mid_write_keeps_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "state.bin"
    atomic_write_bytes(path, b"old")
    with pytest.raises(RuntimeError, match="crash"), atomic_write(path) as handle:
        handle.write(b"half of the new")
        raise RuntimeError("crash")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]


def test_serializer_failure_keeps_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    atomic_save({"step": 1}, path)

    def broken(obj: object, handle: object) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_save({"step": 2}, path, save=broken)
    assert torch.load(path) == {"step": 1}


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic_write_bytes(tmp_path / "nope" / "f.bin", b"x")
