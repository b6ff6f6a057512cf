"""The generation store's I/O: direct I/O round trips, write-behind ordering, the bound
on writes in flight, a background write's error at the commit."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkit.checkpoint.direct_io as direct_io
from shardkit.checkpoint.direct_io import CHUNK, PAGE, AlignedBufferPool, aligned_empty
from shardkit.checkpoint.generations import MANIFEST, GenerationStore

OWNED = re.compile(r"^e\d+\.\w+\.g\d+$")


def _store(directory: Path, resume: bool = False, **kwargs: Any) -> GenerationStore:
    return GenerationStore(directory, fmt="test/1", owned=OWNED, resume=resume, **kwargs)


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def _slow_writes(monkeypatch: Any, seconds: float) -> list[int]:
    """Every file write waits ``seconds`` first; returns the sizes written, in order."""
    real, sizes = direct_io.write_payload, []

    def slow(fd: int, segments: Any, size: int, *, aligned: bool) -> None:
        time.sleep(seconds)
        sizes.append(size)
        real(fd, segments, size, aligned=aligned)

    monkeypatch.setattr(direct_io, "write_payload", slow)
    return sizes


@pytest.mark.parametrize("direct", [True, False])
def test_round_trip_any_size_and_alignment(tmp_path: Path, direct: bool) -> None:
    """Sizes around the block and chunk sizes, from aligned and misaligned memory, into
    aligned and misaligned memory, with and without O_DIRECT: the bytes come back."""
    store = _store(tmp_path, direct_io=direct)
    for seed, n in enumerate([0, 1, PAGE - 1, PAGE, PAGE + 1, CHUNK + 3 * PAGE + 5]):
        source = _bytes(n + 1, seed)[1:]  # misaligned by one byte
        aligned = aligned_empty(n)
        aligned.copy_(source)
        for kind, tensor in (("misaligned", source), ("aligned", aligned)):
            store.write(f"e{seed}", kind, 1, tensor)
            assert os.path.getsize(store.path(f"e{seed}", kind)) == n  # type: ignore[arg-type]
            for into in (aligned_empty(n), torch.empty(n + 1, dtype=torch.uint8)[1:]):
                assert store.read(f"e{seed}", kind, into) == n
                assert torch.equal(into, source), (n, kind)
    packed = [torch.arange(5, dtype=torch.float32), torch.ones(3, dtype=torch.float64)]
    assert store.write_packed("e9", "optim", 1, packed) == 64 + 24  # second tensor at 64
    back = torch.empty(88, dtype=torch.uint8)
    store.read("e9", "optim", back)
    assert torch.equal(back[:20].view(torch.float32), packed[0])
    assert torch.equal(back[64:].view(torch.float64), packed[1])
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_read_after_a_pending_write_sees_the_new_bytes(tmp_path: Path, monkeypatch: Any) -> None:
    store = _store(tmp_path, write_behind_bytes=2**20)
    old, new, newer = _bytes(5000, 1), _bytes(5000, 2), _bytes(5000, 3)
    store.write("e0", "params", 1, old)
    _slow_writes(monkeypatch, 0.2)
    pending = store.write_async("e0", "params", 2, [new])
    assert not pending.done()
    got = torch.empty(5000, dtype=torch.uint8)
    store.read("e0", "params", got)  # waits for generation 2
    assert torch.equal(got, new)
    later = store.write_async("e0", "params", 3, [newer])
    ahead = torch.empty(5000, dtype=torch.uint8)
    store.read_async("e0", "params", ahead).result()
    assert later.done() and torch.equal(ahead, newer)


def test_writes_in_flight_stay_within_the_bound(tmp_path: Path, monkeypatch: Any) -> None:
    size, bound = 3 * PAGE, 10 * PAGE  # three writes fit, a fourth waits
    sizes = _slow_writes(monkeypatch, 0.05)
    store = _store(tmp_path, write_behind_bytes=bound, io_threads=4)
    tensors = [_bytes(size, i) for i in range(8)]
    start = time.perf_counter()
    futures = [store.write_async(f"e{i}", "params", 1, [t]) for i, t in enumerate(tensors)]
    submitted = time.perf_counter() - start
    assert 3 * size >= store.peak_inflight_bytes > size  # concurrent, and bounded
    assert submitted >= 0.05  # the fourth write waited for the first
    big = _bytes(2 * bound, 9)  # larger than the bound: written alone
    futures.append(store.write_async("e8", "params", 1, [big]))
    store.flush()
    assert all(f.done() for f in futures) and store.inflight_bytes == 0
    assert len(sizes) == 9
    for i, t in enumerate([*tensors, big]):
        got = torch.empty_like(t)
        store.read(f"e{i}", "params", got)
        assert torch.equal(got, t)


def test_a_failed_background_write_fails_the_commit(tmp_path: Path, monkeypatch: Any) -> None:
    store = _store(tmp_path, write_behind_bytes=2**20)
    store.write("e0", "params", 1, _bytes(100, 0))
    store.commit(1)
    real, calls = direct_io.write_payload, []

    def fail_second(fd: int, segments: Any, size: int, *, aligned: bool) -> None:
        calls.append(size)
        if len(calls) == 2:
            real(fd, segments, size // 2, aligned=aligned)
            raise OSError("disk full (simulated)")
        real(fd, segments, size, aligned=aligned)

    monkeypatch.setattr(direct_io, "write_payload", fail_second)
    store.write_async("e0", "params", 2, [_bytes(100, 1)])
    store.write_async("e1", "params", 2, [_bytes(100, 2)])
    with pytest.raises(OSError, match="simulated"):
        store.commit(2)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["generation"] == 1 and manifest["files"] == {"e0": {"params": "e0.params.g1"}}
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    store.close()  # the error was raised once


def test_close_waits_for_writes_started_from_other_threads(
    tmp_path: Path, monkeypatch: Any
) -> None:
    _slow_writes(monkeypatch, 0.05)
    store = _store(tmp_path, write_behind_bytes=2**20)
    data = _bytes(PAGE, 5)
    thread = threading.Thread(target=store.write_async, args=("e0", "params", 1, [data]))
    thread.start()
    thread.join()
    store.close()
    assert (tmp_path / "e0.params.g1").read_bytes() == bytes(data.tolist())


def test_buffer_pool_reuses_a_buffer_only_once_nothing_views_it() -> None:
    pool = AlignedBufferPool(limit_bytes=3 * PAGE)
    first = pool.take(PAGE)
    address = first.data_ptr()
    assert address % PAGE == 0
    view = first[6:10].view(torch.int16)
    del first
    assert pool.take(PAGE).data_ptr() != address  # still viewed: not handed out again
    del view
    assert pool.take(PAGE).data_ptr() == address  # free: warm memory reused
    unpooled = AlignedBufferPool(limit_bytes=0)
    assert unpooled.take(PAGE).data_ptr() % PAGE == 0 and not unpooled._buffers


def test_background_entry_commits_in_order_then_a_full_commit(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """[Note: background commits]: per-entry commits of (slow) writes; once flushed the manifest names every entry's newest file and the previous
    generation's files are gone; a full commit after them is the last word."""
    store = _store(tmp_path, write_behind_bytes=2**20)
    for i in range(3):
        store.write(f"e{i}", "params", 0, _bytes(100, i))
    store.commit(0)
    _slow_writes(monkeypatch, 0.05)
    for i in range(3):
        store.write_async(f"e{i}", "params", 1, [_bytes(100, 10 + i)])
        store.commit(0, entries=[f"e{i}"], background=True, step=i)
    store.flush()
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["step"] == 2
    assert manifest["files"] == {f"e{i}": {"params": f"e{i}.params.g1"} for i in range(3)}
    assert sorted(os.listdir(tmp_path)) == sorted(
        [MANIFEST, *(f"e{i}.params.g1" for i in range(3))]
    )
    for i in range(3):
        got = torch.empty(100, dtype=torch.uint8)
        store.read(f"e{i}", "params", got)
        assert torch.equal(got, _bytes(100, 10 + i))
    store.write_async("e0", "params", 2, [_bytes(100, 20)])
    store.commit(1, entries=["e0"], background=True)
    store.commit(2)
    assert json.loads((tmp_path / MANIFEST).read_text())["generation"] == 2
    store.close()


def test_a_failed_background_commit_commits_nothing_after_it(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A write that fails under a background commit: that commit and every later
    background commit leave the manifest as it was (a later manifest would name the
    lost file); the error is raised once, by the next call."""
    store = _store(tmp_path, write_behind_bytes=2**20)
    for i in range(2):
        store.write(f"e{i}", "params", 0, _bytes(100, i))
    store.commit(0)
    before = (tmp_path / MANIFEST).read_text()
    real = direct_io.write_payload

    def fail_e0(fd: int, segments: Any, size: int, *, aligned: bool) -> None:
        if size == 100:  # e0's new file (e1's has 300 bytes), whichever thread writes it
            time.sleep(0.05)
            real(fd, segments, size // 2, aligned=aligned)
            raise OSError("disk full (simulated)")
        real(fd, segments, size, aligned=aligned)

    monkeypatch.setattr(direct_io, "write_payload", fail_e0)
    store.write_async("e0", "params", 1, [_bytes(100, 5)])
    store.commit(0, entries=["e0"], background=True)
    store.write_async("e1", "params", 1, [_bytes(300, 6)])
    store.commit(0, entries=["e1"], background=True)  # waits for the failed one
    with pytest.raises(OSError, match="simulated"):
        store.flush()
    assert (tmp_path / MANIFEST).read_text() == before
    assert {"e0.params.g0", "e1.params.g0"} <= set(os.listdir(tmp_path))
    store.close()


def test_a_read_after_a_background_commit_waits_for_the_write(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Regression: a background commit took the entry's write out of the table of
    writes in flight, so a read right after it read the file before the write ended."""
    store = _store(tmp_path, write_behind_bytes=2**20)
    store.write("e0", "params", 0, _bytes(100, 0))
    store.commit(0)
    _slow_writes(monkeypatch, 0.2)
    store.write_async("e0", "params", 1, [_bytes(100, 1)])
    store.commit(0, entries=["e0"], background=True)
    got = torch.empty(100, dtype=torch.uint8)
    store.read("e0", "params", got)
    assert torch.equal(got, _bytes(100, 1))
    store.close()


def test_temporary_files_of_interrupted_writes_are_removed_on_reopen(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Regression: a killed process's temporary files (``.e0.params.g2.<random>.tmp``)
    stayed in the directory for good: the owned pattern ends with ``$`` (FSDP's disk
    tier's too), so the temporary names never matched it. Reopening now removes them
    and a temporary manifest; an unowned temporary file stays, and the temporary file
    of a write in flight survives a commit of another entry."""
    store = _store(tmp_path)
    store.write("e0", "params", 1, _bytes(100, 0))
    store.commit(1)
    store.close()
    leftovers = [".e0.params.g2.k3j_x9aq.tmp", f".{MANIFEST}.p0q1r2s3.tmp"]
    for name in [*leftovers, ".notes.txt.a1b2c3d4.tmp"]:
        (tmp_path / name).write_bytes(b"half")
    again = GenerationStore(
        tmp_path, fmt="test/1", owned=OWNED, resume=True, write_behind_bytes=2**20
    )
    assert again.open()["generation"] == 1
    again.remove_unreferenced(set())
    assert sorted(os.listdir(tmp_path)) == sorted(
        [MANIFEST, "e0.params.g1", ".notes.txt.a1b2c3d4.tmp"]
    )
    started, release = threading.Event(), threading.Event()
    real = direct_io.write_payload

    def held(fd: int, segments: Any, size: int, *, aligned: bool) -> None:
        started.set()
        release.wait(10)
        real(fd, segments, size, aligned=aligned)

    monkeypatch.setattr(direct_io, "write_payload", held)
    again.write_async("e1", "params", 2, [_bytes(64, 1)])  # in flight: its .tmp exists
    assert started.wait(10)
    monkeypatch.setattr(direct_io, "write_payload", real)
    again.write("e0", "params", 2, _bytes(100, 2))
    again.commit(2, entries=["e0"])  # removes unreferenced files: not e1's temporary one
    assert [f for f in os.listdir(tmp_path) if f.startswith(".e1.params.g2.")]
    release.set()
    again.commit(2)
    again.close()
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".tmp")) == [
        ".notes.txt.a1b2c3d4.tmp"
    ]
    files = json.loads((tmp_path / MANIFEST).read_text())["files"]
    assert files == {"e0": {"params": "e0.params.g2"}, "e1": {"params": "e1.params.g2"}}


def test_two_background_commits_queued_and_the_directory_locked_until_both_end(
    tmp_path: Path,
) -> None:
    """``commits_in_flight=2``: a second background commit is queued without waiting
    for the first, a third waits for the oldest; a store opening the directory waits
    until the last queued commit ended (the directory's ``flock``), and then reads the
    newest manifest."""
    with pytest.raises(ValueError, match="commits_in_flight >= 1"):
        _store(tmp_path / "bad", commits_in_flight=0)
    store = _store(tmp_path, write_behind_bytes=2**20, commits_in_flight=2)
    for i in range(3):
        store.write(f"e{i}", "params", 0, _bytes(100, i))
    store.commit(0)
    gate, renamed, rename = threading.Event(), [], store._rename_manifest

    def gated(text: str) -> None:
        assert gate.wait(60)
        rename(text)
        renamed.append(json.loads(text)["step"])

    store._rename_manifest = gated  # type: ignore[method-assign]
    for i in range(2):
        store.write(f"e{i}", "params", 1, _bytes(100, 10 + i))
        store.commit(1, entries=[f"e{i}"], background=True, step=i)  # returns at once
    assert renamed == [] and len(store._commits) == 2
    third = threading.Thread(
        target=store.commit, args=(1,), kwargs={"entries": ["e2"], "background": True, "step": 2}
    )
    store.write("e2", "params", 1, _bytes(100, 12))
    third.start()
    third.join(0.3)
    assert third.is_alive()  # waits for the oldest of the two queued
    opened: list[int] = []
    opener = threading.Thread(
        target=lambda: opened.append(_store(tmp_path, resume=True).open()["step"])
    )
    opener.start()
    opener.join(0.3)
    assert opener.is_alive() and not opened  # the directory is locked by the queued commits
    gate.set()
    third.join(10)
    opener.join(10)
    store.flush()
    assert renamed == [0, 1, 2]
    assert opened == [2]  # what the last queued commit named, not an older manifest
    store.close()


def test_busy_periods_cover_the_io_and_are_taken_once(tmp_path: Path, monkeypatch: Any) -> None:
    """Two concurrent slow writes are one busy period, a later read another; their
    wall-clock spans hold the I/O; ``take_busy_periods`` empties the record."""
    _slow_writes(monkeypatch, 0.05)
    store = _store(tmp_path, write_behind_bytes=8 * PAGE, io_threads=2)
    start = time.time()
    for i in range(2):
        store.write_async(f"e{i}", "params", 1, [_bytes(PAGE, i)])
    store.flush()
    middle = time.time()
    store.read("e0", "params", torch.empty(PAGE, dtype=torch.uint8))
    periods = store.take_busy_periods()
    # the writes overlap (one period; two if a loaded machine started the second late)
    assert len(periods) in (2, 3), periods
    (a, b), (c, d) = periods[0], periods[-1]
    assert start <= a and b - a >= 0.05 and periods[-2][1] <= middle <= c <= d <= time.time()
    assert sum(e - s for s, e in periods) <= store.io_seconds + 1e-3
    assert store.take_busy_periods() == ()
    store.close()
