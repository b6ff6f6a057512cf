"""Asynchronous universal checkpoints (``AsyncCheckpointer``): the same checkpoint as a
synchronous save, taken at the call, committed in the background.

One 2-rank gloo group runs every multi-rank config (:func:`_async_worker`):

- DDP and FSDP: a synchronous and an asynchronous save of the same state. The
  background write is held until the caller has changed every parameter and taken
  another optimizer step; the shard files and ``extra`` files must still be byte for
  byte the synchronous save's (the staging copy was taken at the call).
- The DDP checkpoint saved asynchronously loads into fresh DDP models exactly
  (parameters, buffers, AdamW state), one more step from it equals one more step from
  the synchronous one; it loads into FSDP (another strategy) with the saved values, and
  in the test process (1 rank, a plain model: another world size) with the saved
  parameters and optimizer state.
- A write that fails on rank 1 in the background is raised by the next ``save()`` on
  both ranks, naming rank 1; ``latest`` stays on the previous checkpoint; the next
  save commits.
- A save requested while one is in flight waits for it; both commit; the staging
  buffer is allocated once.

:func:`test_sigkill_during_background_write_keeps_previous` kills a 1-rank process
(SIGKILL) while its background thread is in the middle of writing a shard file:
``latest`` names the previous checkpoint, which verifies and loads with its values.
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.checkpoint import CheckpointError
from shardkit.checkpoint.manifest import LATEST_NAME, find_valid_checkpoint
from shardkit.checkpoint.universal import AsyncCheckpointer, load_universal, save_universal
from shardkit.checkpoint.universal.shardfile import ShardFile
from shardkit.nn import FSDP

_WRITE_TO = ShardFile.write_to


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def _step(model: Any, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One AdamW step on a batch that is the same on every rank (so BatchNorm's running
    statistics, which DDP does not average, stay replicas)."""
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 6, generator=g)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _values(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters, buffers and AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``)."""
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i, state in optimizer.state_dict()["state"].items():
        out.update({f"state.{i}.{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    return out


def _files(ckpt: Path) -> dict[str, bytes]:
    """Every file of a checkpoint but the manifest (it records the creation time)."""
    return {p.name: p.read_bytes() for p in sorted(ckpt.iterdir()) if p.name != "manifest.json"}


@contextlib.contextmanager
def _held_writes() -> Iterator[threading.Event]:
    """Shard files are written only after the event is set."""
    release = threading.Event()

    def held(self: ShardFile, handle: Any) -> None:
        release.wait(60)
        _WRITE_TO(self, handle)

    with mock.patch.object(ShardFile, "write_to", held):
        yield release


def _change_everything(model: Any, optimizer: torch.optim.Optimizer) -> None:
    """Train after the save point: one more step, then every parameter + 1."""
    _step(model, optimizer, seed=9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


def _same_as_sync(kind: str, root: Path, checkpointer: AsyncCheckpointer) -> dict[str, Any]:
    """Save one state synchronously and asynchronously; change the model before the
    background write starts; both checkpoints' files must be identical."""
    base = _model()
    model: Any = DistributedDataParallel(base) if kind == "ddp" else FSDP(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, eps=1e-4)
    for seed in (1, 2):
        _step(model, optimizer, seed)
    saved = _values(base, optimizer) if kind == "ddp" else {}  # (FSDP's: loaded into DDP)
    sync = save_universal(root / f"{kind}-sync", 2, model, optimizer, extra={"k": kind})
    with _held_writes() as release:
        handle = checkpointer.save(root / f"{kind}-async", 2, model, optimizer, extra={"k": kind})
        _change_everything(model, optimizer)
        release.set()
        committed = handle.result()
    return {"identical": _files(sync) == _files(committed), "saved": saved, "path": committed}


def _load_into(kind: str, ckpt: Path) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(5)  # another initialisation: the load must overwrite it all
    base = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    model: Any = DistributedDataParallel(base) if kind == "ddp" else FSDP(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, eps=1e-4)
    load_universal(ckpt, model, optimizer)
    return model, optimizer


def _resumes(root: Path, saved: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The DDP checkpoints, sync and async, loaded into DDP and FSDP."""
    out: dict[str, Any] = {}
    a_model, a_opt = _load_into("ddp", root / "ddp-async" / "ckpt-000002")
    s_model, s_opt = _load_into("ddp", root / "ddp-sync" / "ckpt-000002")
    out["loaded"] = _values(a_model.module, a_opt)
    loaded = out["loaded"]
    out["loaded_diff"] = sorted(set(saved) ^ set(loaded)) + [
        k for k in saved if k in loaded and not torch.equal(saved[k], loaded[k])
    ]
    _step(a_model, a_opt, seed=3)
    _step(s_model, s_opt, seed=3)
    after_a, after_s = _values(a_model.module, a_opt), _values(s_model.module, s_opt)
    out["next_step_equal"] = all(torch.equal(after_a[k], after_s[k]) for k in after_a)
    out["next_step_moved"] = not torch.equal(after_a["0.weight"], saved["0.weight"])
    f_model, _ = _load_into("fsdp", root / "ddp-async" / "ckpt-000002")
    full = {k: v.detach().clone() for k, v in f_model.state_dict().items()}
    keys = sorted(k for k in saved if not k.startswith("state."))
    out["fsdp_matches"] = sorted(full) == keys and all(torch.equal(full[k], saved[k]) for k in keys)
    return out


def _disk_full(self: ShardFile, handle: Any) -> None:
    handle.write(b"half a shard file")
    raise OSError(errno.ENOSPC, "No space left on device")


def _failure_surfaces(root: Path, checkpointer: AsyncCheckpointer) -> dict[str, Any]:
    """Step 1 commits; step 2 fails on rank 1 in the background; step 3's ``save()``
    raises it on both ranks; step 4 commits."""
    model = DistributedDataParallel(_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    _step(model, optimizer, 1)
    checkpointer.save(root, 1, model, optimizer).result()
    patch = mock.patch.object(ShardFile, "write_to", _disk_full)
    with patch if dist.get_rank() == 1 else contextlib.nullcontext():
        handle = checkpointer.save(root, 2, model, optimizer)  # returns: the failure is later
        while not handle.done():
            time.sleep(0.01)
    out: dict[str, Any] = {"latest_after_failure": (root / LATEST_NAME).read_text().strip()}
    _step(model, optimizer, 2)
    try:
        checkpointer.save(root, 3, model, optimizer)
        out["raised"] = None
    except CheckpointError as err:
        out["raised"] = str(err)
    out["in_flight"] = checkpointer.in_flight
    checkpointer.save(root, 4, model, optimizer)
    out["committed"] = checkpointer.wait()
    out["listing"] = sorted(os.listdir(root))
    return out


def _second_waits(root: Path, checkpointer: AsyncCheckpointer) -> dict[str, Any]:
    """Two saves back to back: the second waits for the first; both commit."""
    model = DistributedDataParallel(_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    _step(model, optimizer, 1)
    allocations = checkpointer.staging.allocations

    def slow(self: ShardFile, handle: Any) -> None:
        time.sleep(0.5)
        _WRITE_TO(self, handle)

    with mock.patch.object(ShardFile, "write_to", slow):
        first = checkpointer.save(root, 1, model, optimizer)
        _step(model, optimizer, 2)
        first_done = first.done()
        second = checkpointer.save(root, 2, model, optimizer)
        checkpointer.wait()
    return {
        "first_done_when_second_started": first_done,
        "waited_s": second.waited_s,
        "listing": sorted(os.listdir(root)),
        "new_allocations": checkpointer.staging.allocations - allocations,
    }


def _async_worker(root: Path) -> dict[str, Any]:
    checkpointer = AsyncCheckpointer()
    out: dict[str, Any] = {}
    for kind in ("ddp", "fsdp"):
        out[kind] = _same_as_sync(kind, root, checkpointer)
    dist.barrier()  # every rank's files are committed before any rank loads
    out["resume"] = _resumes(root, out["ddp"]["saved"])
    out["failure"] = _failure_surfaces(root / "failure", checkpointer)
    out["waits"] = _second_waits(root / "waits", checkpointer)
    checkpointer.close()
    return out


@pytest.fixture(scope="module")
def results(rank_pool: Any, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("async_ckpt")
    out: list[dict[str, Any]] = rank_pool(2).run(_async_worker, root, timeout_s=90)
    return out


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_async_files_equal_sync_despite_training_after(
    results: list[dict[str, Any]], kind: str
) -> None:
    for out in results:
        assert out[kind]["identical"], kind


def test_async_checkpoint_resumes_bit_for_bit(results: list[dict[str, Any]]) -> None:
    for out in results:
        assert out["resume"]["loaded_diff"] == []
        assert out["resume"]["next_step_equal"]
        assert out["resume"]["next_step_moved"]


def test_async_checkpoint_loads_into_fsdp(results: list[dict[str, Any]]) -> None:
    for out in results:
        assert out["resume"]["fsdp_matches"]


def test_async_checkpoint_loads_at_one_rank(results: list[dict[str, Any]]) -> None:
    saved = results[0]["ddp"]["saved"]
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, eps=1e-4)
    loaded = load_universal(results[0]["ddp"]["path"], model, optimizer)
    assert (loaded.step, loaded.saved_world_size, loaded.extra(1)) == (2, 2, {"k": "ddp"})
    got = _values(model, optimizer)
    assert sorted(got) == sorted(saved)
    for k in saved:
        assert torch.equal(got[k], saved[k]), k


def test_background_failure_raises_on_every_rank_at_next_save(
    results: list[dict[str, Any]],
) -> None:
    for out in results:
        got = out["failure"]
        assert got["latest_after_failure"] == "ckpt-000001"
        assert got["raised"] is not None
        assert "ckpt-000002 failed, not committed: rank 1: OSError: [Errno 28]" in got["raised"]
        assert got["in_flight"] is None  # step 3 was not started
        assert got["committed"].name == "ckpt-000004"
        assert got["listing"] == ["ckpt-000001", "ckpt-000004", LATEST_NAME]


def test_second_save_waits_for_the_first(results: list[dict[str, Any]]) -> None:
    for out in results:
        got = out["waits"]
        assert not got["first_done_when_second_started"]
        assert got["waited_s"] > 0.2
        assert got["listing"] == ["ckpt-000001", "ckpt-000002", LATEST_NAME]
        assert got["new_allocations"] == 0  # the same layout reuses the staging buffer


# SIGKILL during the background write ---------------------------------------------------
def _killed_child(root: str) -> None:
    """Commit step 1, then start step 2 whose shard file stops half written (a marker
    file says so) and wait to be killed."""
    torch.set_num_threads(1)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    _step(model, optimizer, 1)
    checkpointer = AsyncCheckpointer()
    checkpointer.save(root, 1, model, optimizer).result()
    torch.save(_values(model, optimizer), Path(root) / "expected.pt")

    def half(self: ShardFile, handle: Any) -> None:
        handle.write(b"x" * 64)
        handle.flush()
        Path(root, "writing").touch()
        time.sleep(120)

    _step(model, optimizer, 2)
    with mock.patch.object(ShardFile, "write_to", half):
        checkpointer.save(root, 2, model, optimizer)
        _change_everything(model, optimizer)
        time.sleep(120)


def test_sigkill_during_background_write_keeps_previous(tmp_path: Path) -> None:
    proc = mp.get_context("spawn").Process(target=_killed_child, args=(str(tmp_path),))
    proc.start()
    deadline = time.monotonic() + 60
    while not (tmp_path / "writing").exists():
        assert proc.is_alive() and time.monotonic() < deadline, "the child never wrote"
        time.sleep(0.05)
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert proc.exitcode == -signal.SIGKILL
    assert (tmp_path / "ckpt-000002.new").is_dir()  # the interrupted save's staging directory
    assert (tmp_path / LATEST_NAME).read_text().strip() == "ckpt-000001"
    assert find_valid_checkpoint(tmp_path) == tmp_path / "ckpt-000001"
    expected = torch.load(tmp_path / "expected.pt")
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    assert load_universal(tmp_path, model, optimizer).step == 1
    got = _values(model, optimizer)
    assert sorted(got) == sorted(expected)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
