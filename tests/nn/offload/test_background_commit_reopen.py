"""Regression tests found by trying the disk tier's background step commit as a user:
what the directory holds after a failed background commit once the model is dropped
(generation g's files were deleted: the store's committed files had run ahead of the
manifest on the disk), and a reopen of the directory in the same process while the
previous model's commit is in flight (it read the manifest before it: a returned step
was lost or the reopen failed)."""

from __future__ import annotations

import contextlib
import gc
import json
import threading
from pathlib import Path

import pytest

from shardkit.nn.offload import OffloadModel
from shardkit.testing import assert_state_dicts_close
from tests.nn.offload.common import optimizer_for, plain_state, tiny, train, wrap

IO_BYTES = 2**20


def _manifest_generation(directory: Path) -> int:
    return int(json.loads((directory / "manifest.json").read_text())["generation"])


def _reopened(directory: Path) -> tuple[OffloadModel, dict[str, str]]:
    return wrap(
        tiny(99), offload_device=directory, num_slices=3, resume=True, disk_io_bytes=IO_BYTES
    )


def test_dropping_the_model_after_a_failed_background_commit_keeps_the_generation(
    tmp_path: Path,
) -> None:
    plain = tiny()
    train(plain, optimizer_for(plain, "adamw"), 2)
    directory = tmp_path / "offload"
    om, _ = wrap(tiny(), offload_device=directory, num_slices=3, disk_io_bytes=IO_BYTES)
    optimizer = optimizer_for(om, "adamw")
    train(om, optimizer, 2)
    om.tier.settle()

    def full(text: str) -> None:
        raise OSError(28, "No space left on device (injected)")

    om.tier.store._rename_manifest = full  # type: ignore[method-assign]
    train(om, optimizer, 1)  # step 3's commit fails on the commit thread
    with pytest.raises(OSError, match="No space left"):
        train(om, optimizer, 1)
    with contextlib.suppress(OSError):  # what a user does after the error: settle, drop
        om.tier.settle()
    del om, optimizer
    gc.collect()
    assert _manifest_generation(directory) == 2
    reopened, renamed = _reopened(directory)  # FileNotFoundError: buffers.g2.pt
    assert reopened.tier.generation == 2
    assert_state_dicts_close(plain_state(reopened, renamed), dict(plain.named_parameters()), atol=0)


def test_reopening_while_the_previous_model_commits_keeps_its_last_step(
    tmp_path: Path,
) -> None:
    plain = tiny()
    train(plain, optimizer_for(plain, "adamw"), 3)
    directory = tmp_path / "offload"
    om, _ = wrap(tiny(), offload_device=directory, num_slices=3, disk_io_bytes=IO_BYTES)
    optimizer = optimizer_for(om, "adamw")
    train(om, optimizer, 2)
    om.tier.settle()
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
    with contextlib.suppress(OSError):
        om.tier.settle()
    assert reopened.tier.generation == 3
    assert_state_dicts_close(plain_state(reopened, renamed), dict(plain.named_parameters()), atol=0)
