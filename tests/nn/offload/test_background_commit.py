"""The disk tier's step commit in the background (``disk_io_bytes > 0``): the step
returns before its manifest is renamed, the next step waits for it, and a crash or a
failed commit leaves the generation before it (see [Note: background step commits] in
:mod:`shardkit.nn.offload.disk`)."""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkit.nn.offload import OffloadModel
from shardkit.testing import assert_state_dicts_close
from tests.nn.offload.common import (
    killed_then_resumed,
    optimizer_for,
    plain_state,
    tiny,
    train,
    wrap,
)

IO_BYTES = 2**20


def _manifest_generation(directory: Path) -> int:
    return int(json.loads((directory / "manifest.json").read_text())["generation"])


def _reopened(directory: Path) -> tuple[OffloadModel, dict[str, str]]:
    return wrap(
        tiny(99), offload_device=directory, num_slices=3, resume=True, disk_io_bytes=IO_BYTES
    )


def _two_steps(directory: Path) -> tuple[OffloadModel, Any]:
    """A disk-tier model and its optimizer after two steps, the second's commit landed."""
    om, _ = wrap(tiny(), offload_device=directory, num_slices=3, disk_io_bytes=IO_BYTES)
    optimizer = optimizer_for(om, "adamw")
    train(om, optimizer, 2)
    om.tier.settle()
    return om, optimizer


def _disk_full(om: OffloadModel) -> None:
    """Every later manifest rename of ``om``'s store fails as on a full disk."""

    def full(text: str) -> None:
        raise OSError(28, "No space left on device (injected)")

    om.tier.store._rename_manifest = full  # type: ignore[method-assign]


def test_step_returns_before_its_commit_and_settle_waits(tmp_path: Path) -> None:
    plain = tiny()
    expected = train(plain, optimizer_for(plain, "adamw"), 4)
    directory = tmp_path / "offload"
    om, rename = wrap(tiny(), offload_device=directory, num_slices=3, disk_io_bytes=IO_BYTES)
    optimizer = optimizer_for(om, "adamw")
    store = om.tier.store
    losses = train(om, optimizer, 3)
    # finished writes are forgotten at each background commit, not kept for every step
    assert len(store._pending) <= sum(len(kinds) for kinds in store.files.values())
    om.tier.settle()  # step 3's commit on the disk before the gate
    gate, rename_manifest = threading.Event(), store._rename_manifest

    def gated(text: str) -> None:
        assert gate.wait(60)
        rename_manifest(text)

    store._rename_manifest = gated  # type: ignore[method-assign]
    losses += train(om, optimizer, 1)
    assert losses == expected  # bit for bit
    # step 4 returned; its manifest waits for the gate: the disk still names step 3
    assert om.tier.generation == 4 and _manifest_generation(directory) == 3
    assert (directory / "buffers.g3.pt").exists()  # named by the manifest on the disk
    gate.set()
    om.tier.settle()
    assert _manifest_generation(directory) == 4
    files = os.listdir(directory)
    assert not [f for f in files if ".g3" in f or f.endswith(".tmp")], files
    reopened, renamed = _reopened(directory)
    assert reopened.tier.generation == 4
    assert_state_dicts_close(plain_state(reopened, renamed), dict(plain.named_parameters()), atol=0)
    assert_state_dicts_close(plain_state(om, rename), dict(plain.named_parameters()), atol=0)


def test_dropping_the_model_lands_its_commit(tmp_path: Path) -> None:
    """``del`` of the model and its optimizer waits for the last step's commit: a
    reopened directory holds that step, not the one before."""
    directory = tmp_path / "offload"
    om, optimizer = _two_steps(directory)
    store, rename_manifest = om.tier.store, om.tier.store._rename_manifest

    def slow(text: str) -> None:
        time.sleep(0.5)
        rename_manifest(text)

    store._rename_manifest = slow  # type: ignore[method-assign]
    train(om, optimizer, 1)
    del om, optimizer, store
    gc.collect()
    assert _manifest_generation(directory) == 3
    assert _reopened(directory)[0].tier.generation == 3


def test_a_failed_background_commit_is_raised_by_the_next_step(tmp_path: Path) -> None:
    plain = tiny()
    train(plain, optimizer_for(plain, "adamw"), 2)
    directory = tmp_path / "offload"
    om, optimizer = _two_steps(directory)
    _disk_full(om)
    train(om, optimizer, 1)  # step 3 returns; its commit fails on the commit thread
    with pytest.raises(OSError, match="No space left") as raised:
        train(om, optimizer, 1)
    # the message says what survives; the generation is the manifest's again
    assert "committing generation 3" in str(raised.value), raised.value
    assert "names generation 2, whole" in str(raised.value), raised.value
    assert raised.value.errno == 28 and om.tier.generation == 2
    assert _manifest_generation(directory) == 2
    reopened, renamed = _reopened(directory)
    assert reopened.tier.generation == 2
    assert_state_dicts_close(plain_state(reopened, renamed), dict(plain.named_parameters()), atol=0)


def killed_in_the_commit(directory: str, marker: str) -> None:
    """Two steps, then a third whose background commit SIGKILLs the process just before
    renaming the manifest (run in a child process)."""
    torch.set_num_threads(1)
    om, optimizer = _two_steps(Path(directory))
    store, returned = om.tier.store, threading.Event()

    def die(text: str) -> None:
        assert returned.wait(60)  # the step returned while its commit was in flight
        Path(marker).write_text(json.dumps({"generation": json.loads(text)["generation"]}))
        os.kill(os.getpid(), signal.SIGKILL)

    store._rename_manifest = die  # type: ignore[method-assign]
    train(om, optimizer, 1)
    returned.set()
    threading.Event().wait(60)


def test_killed_in_the_background_commit_resumes_from_the_previous_generation(
    tmp_path: Path,
) -> None:
    seen = killed_then_resumed(tmp_path, killed_in_the_commit, IO_BYTES)
    assert seen == {"generation": 3}


def test_dropping_the_model_after_a_failed_background_commit_keeps_the_generation(
    tmp_path: Path,
) -> None:
    """A settle and a drop after a failed background commit keep the generation the
    manifest on the disk names (they deleted its files: the store's committed files had
    run ahead of that manifest)."""
    plain = tiny()
    train(plain, optimizer_for(plain, "adamw"), 2)
    directory = tmp_path / "offload"
    om, optimizer = _two_steps(directory)
    _disk_full(om)
    train(om, optimizer, 1)  # step 3's commit fails on the commit thread
    with pytest.raises(OSError, match="No space left"):
        train(om, optimizer, 1)
    om.tier.settle()  # what a user does after the error: settle, drop
    del om, optimizer
    gc.collect()
    assert _manifest_generation(directory) == 2
    reopened, renamed = _reopened(directory)  # before: FileNotFoundError buffers.g2.pt
    assert reopened.tier.generation == 2
    assert_state_dicts_close(plain_state(reopened, renamed), dict(plain.named_parameters()), atol=0)


def test_reopening_while_the_previous_model_commits_keeps_its_last_step(
    tmp_path: Path,
) -> None:
    """A reopen while the previous model's commit is in flight (``model =
    OffloadModel(..., resume=True)`` without ``del model``) waits for it: before, it
    resumed the generation before it or failed on the files it deleted."""
    plain = tiny()
    train(plain, optimizer_for(plain, "adamw"), 3)
    directory = tmp_path / "offload"
    om, optimizer = _two_steps(directory)
    store = om.tier.store
    gate, rename_manifest = threading.Event(), store._rename_manifest

    def gated(text: str) -> None:
        assert gate.wait(60)
        rename_manifest(text)

    store._rename_manifest = gated  # type: ignore[method-assign]
    train(om, optimizer, 1)  # step 3 returned, its commit waits for the gate
    timer = threading.Timer(0.5, gate.set)
    timer.start()
    try:
        reopened, renamed = _reopened(directory)  # the old model is still alive
    finally:
        gate.set()
        timer.join()
    om.tier.settle()
    assert reopened.tier.generation == 3
    assert_state_dicts_close(plain_state(reopened, renamed), dict(plain.named_parameters()), atol=0)
