"""Checkpoint directories with a manifest: checksums, damage detection, fallback, commit."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.checkpoint.manifest import (
    CHECKPOINT_FORMAT,
    LATEST_NAME,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFallbackWarning,
    CheckpointMismatchError,
    find_valid_checkpoint,
    list_checkpoints,
    load_checkpoint_file,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
)


def _payload(step: int) -> dict[str, Any]:
    return {"step": step, "w": torch.arange(64.0) * step}


def _two_checkpoints(root: Path) -> tuple[Path, Path]:
    first = save_checkpoint(root, 2, {"rank0.pt": _payload(2)}, layout={"strategy": "ddp"})
    second = save_checkpoint(root, 4, {"rank0.pt": _payload(4)}, layout={"strategy": "ddp"})
    return first, second


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_manifest_records_every_file(tmp_path: Path) -> None:
    before = time.time()
    ckpt = save_checkpoint(
        tmp_path, 7, {"rank0.pt": _payload(7), "extra.pt": [1, 2]}, layout={"units": [3, 5]}
    )
    raw = json.loads((ckpt / "manifest.json").read_text())
    assert (raw["format"], raw["step"], raw["world_size"]) == (CHECKPOINT_FORMAT, 7, 1)
    assert raw["layout"] == {"units": [3, 5]}
    assert raw["created_unix_s"] >= before
    for rec in raw["files"]:
        data = (ckpt / rec["name"]).read_bytes()
        assert (rec["rank"], rec["size_bytes"]) == (0, len(data))
        assert rec["sha256"] == hashlib.sha256(data).hexdigest()
    assert [r["name"] for r in raw["files"]] == ["rank0.pt", "extra.pt"]
    assert (tmp_path / LATEST_NAME).read_text() == "ckpt-000007\n"
    assert sorted(p.name for p in ckpt.iterdir()) == ["extra.pt", "manifest.json", "rank0.pt"]
    loaded = load_checkpoint_file(ckpt, "rank0.pt", world_size=1)
    assert loaded["step"] == 7 and torch.equal(loaded["w"], _payload(7)["w"])


@pytest.mark.parametrize(
    ("damage", "problem", "message"),
    [
        (_truncate, "truncated", r"rank0\.pt is truncated: \d[\d,]* of \d[\d,]* bytes"),
        (_flip_byte, "corrupted", r"rank0\.pt is corrupted: sha256 [0-9a-f]{16}\.\.\., the"),
        (lambda p: p.write_bytes(p.read_bytes() + b"x"), "corrupted", r"manifest says \d"),
        (Path.unlink, "missing", r"rank0\.pt is missing"),
    ],
)
def test_damage_detected_and_previous_used(
    tmp_path: Path, damage: Any, problem: str, message: str
) -> None:
    first, second = _two_checkpoints(tmp_path)
    damage(second / "rank0.pt")
    with pytest.raises(CheckpointCorruptError, match=message) as info:
        load_checkpoint_file(second, "rank0.pt")
    assert (info.value.problem, info.value.path) == (problem, second / "rank0.pt")
    with pytest.warns(CheckpointFallbackWarning, match="ckpt-000004 is unusable") as caught:
        assert find_valid_checkpoint(tmp_path) == first
    assert len(caught) == 1 and "using ckpt-000002 instead" in str(caught[0].message)
    assert load_checkpoint_file(first, "rank0.pt")["step"] == 2


@pytest.mark.parametrize(
    ("text", "error", "match"),
    [
        (None, CheckpointCorruptError, "manifest.json is missing"),
        ('{"format": "shardkit.checkpoint/1", "step"', CheckpointCorruptError, "unreadable"),
        ('{"format": "shardkit.checkpoint/1"}', CheckpointCorruptError, "unreadable"),
        ("[1, 2]", CheckpointCorruptError, "unreadable"),
        ('{"format": "shardkit.checkpoint/9"}', CheckpointMismatchError, "this shardkit reads"),
    ],
)
def test_bad_manifest(tmp_path: Path, text: str | None, error: type, match: str) -> None:
    first, second = _two_checkpoints(tmp_path)
    manifest = second / "manifest.json"
    if text is None:
        manifest.unlink()
    else:
        manifest.write_text(text)
    with pytest.raises(error, match=match):
        read_manifest(second)
    if error is CheckpointMismatchError:  # intact but not ours: not skipped
        with pytest.raises(CheckpointMismatchError):
            find_valid_checkpoint(tmp_path)
    else:
        with pytest.warns(CheckpointFallbackWarning):
            assert find_valid_checkpoint(tmp_path) == first


def test_world_size_mismatch_is_refused_not_skipped(tmp_path: Path) -> None:
    _, second = _two_checkpoints(tmp_path)
    match = "written by 1 ranks, this run has 2 and its state cannot be resharded"
    with pytest.raises(CheckpointMismatchError, match=match) as info:
        verify_checkpoint(second, world_size=2)
    assert info.value.problem == "world size"
    with pytest.raises(CheckpointMismatchError, match=match):
        find_valid_checkpoint(tmp_path, world_size=2)
    assert find_valid_checkpoint(tmp_path) == second  # reshardable state: any world size


def test_all_damaged_raises_listing_each(tmp_path: Path) -> None:
    first, second = _two_checkpoints(tmp_path)
    _truncate(first / "rank0.pt")
    _flip_byte(second / "rank0.pt")
    with pytest.raises(CheckpointCorruptError, match="no usable checkpoint") as info:
        find_valid_checkpoint(tmp_path)
    assert "ckpt-000004/rank0.pt is corrupted" in str(info.value)
    assert "ckpt-000002/rank0.pt is truncated" in str(info.value)


def test_uncommitted_and_missing(tmp_path: Path) -> None:
    assert find_valid_checkpoint(tmp_path) is None  # nothing ever saved
    (tmp_path / "ckpt-000002").mkdir()  # a crash before the first commit
    assert find_valid_checkpoint(tmp_path) is None
    first, second = _two_checkpoints(tmp_path)
    stale = tmp_path / "ckpt-000006"  # files written, crash before the manifest
    stale.mkdir()
    torch.save(_payload(6), stale / "rank0.pt")
    assert list_checkpoints(tmp_path) == [second, first]
    assert find_valid_checkpoint(tmp_path) == second
    shutil.rmtree(second)  # the pointer names a checkpoint that is gone
    with pytest.warns(CheckpointFallbackWarning, match="ckpt-000004/manifest.json is missing"):
        assert find_valid_checkpoint(tmp_path) == first


def test_failed_save_is_not_committed(tmp_path: Path) -> None:
    first, _ = _two_checkpoints(tmp_path)
    (tmp_path / LATEST_NAME).write_text(first.name + "\n")

    def broken(obj: object, handle: Any) -> None:
        handle.write(b"half")
        raise OSError("disk full")

    with pytest.raises(
        CheckpointError, match="ckpt-000009 failed, not committed: rank 0: OSError: disk full"
    ):
        save_checkpoint(tmp_path, 9, {"rank0.pt": 1}, save=broken)
    assert (tmp_path / LATEST_NAME).read_text() == "ckpt-000002\n"
    assert not (tmp_path / "ckpt-000009" / "rank0.pt").exists()
    assert find_valid_checkpoint(tmp_path) == first


@pytest.mark.parametrize("name", ["", ".hidden", "a/b.pt", "manifest.json"])
def test_bad_file_name(tmp_path: Path, name: str) -> None:
    with pytest.raises(CheckpointError, match="ValueError: checkpoint file name"):
        save_checkpoint(tmp_path, 1, {name: 1})
    assert not (tmp_path / LATEST_NAME).exists()


def test_keep_prunes_oldest_committed(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {"rank0.pt": step}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-000003", "ckpt-000004"]


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_any_truncation_or_byte_flip_is_detected(tmp_path_factory: Any, data: Any) -> None:
    root = tmp_path_factory.mktemp("fuzz")
    size = data.draw(st.integers(1, 300), label="tensor elements")
    ckpt = save_checkpoint(root, 1, {"rank0.pt": torch.randn(size)})
    path = ckpt / "rank0.pt"
    n = path.stat().st_size
    if data.draw(st.booleans(), label="truncate"):
        keep = data.draw(st.integers(0, n - 1), label="bytes kept")
        path.write_bytes(path.read_bytes()[:keep])
        problem = "truncated"
    else:
        _flip_byte(path, data.draw(st.integers(0, n - 1), label="offset"))
        problem = "corrupted"
    with pytest.raises(CheckpointCorruptError) as info:
        verify_checkpoint(ckpt)
    assert info.value.problem == problem


# ---- collective: 2 ranks ------------------------------------------------------------


def _two_rank_checkpoints(root: Path) -> list[Any]:
    """Save twice; damage rank 1's newest file; both ranks must fall back to the same."""
    rank = dist.get_rank()
    out: list[Any] = []
    for step in (3, 6):
        ckpt = save_checkpoint(root, step, {f"rank{rank}.pt": _payload(10 * step + rank)})
    manifest = read_manifest(ckpt)
    out.append([(f.name, f.rank) for f in manifest.files])
    out.append(manifest.world_size)
    if rank == 1:  # only rank 1 hashes rank1.pt: rank 0 learns it from rank 1
        _flip_byte(ckpt / "rank1.pt")
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = find_valid_checkpoint(root, world_size=2)
    out.append((found.name if found else None, [str(w.message) for w in caught]))
    out.append(load_checkpoint_file(found, f"rank{rank}.pt", world_size=2)["step"])

    def broken_on_rank_1(obj: object, handle: Any) -> None:
        if rank == 1:
            raise RuntimeError("no space left")
        torch.save(obj, handle)

    try:  # a failure on one rank raises on every rank (no hang), and commits nothing
        save_checkpoint(root, 9, {f"rank{rank}.pt": 1}, save=broken_on_rank_1)
        out.append("saved")
    except CheckpointError as err:
        out.append(str(err))
    out.append((root / LATEST_NAME).read_text().strip())
    return out


def test_two_ranks_agree_on_fallback(rank_pool: Any, tmp_path: Path) -> None:
    per_rank = rank_pool(2).run(_two_rank_checkpoints, tmp_path)
    assert per_rank[0][:3] == per_rank[1][:3] and per_rank[0][4:] == per_rank[1][4:]
    files, world, (found, msgs), _, save_error, latest = per_rank[0]
    assert (files, world, found) == ([("rank0.pt", 0), ("rank1.pt", 1)], 2, "ckpt-000003")
    assert len(msgs) == 1 and "ckpt-000006/rank1.pt is corrupted" in msgs[0], msgs
    assert [r[3] for r in per_rank] == [30, 31]
    assert "rank 1: RuntimeError: no space left" in save_error
    assert latest == "ckpt-000006"
