"""The disk tier: reopen and resume, crash safety, initialisation from the meta device."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkit.checkpoint.direct_io as direct_io
import shardkit.checkpoint.generations as generations
from shardkit.nn.offload import OffloadModel, remove_offloaded
from shardkit.testing import assert_state_dicts_close
from tests.nn.offload.common import optimizer_for, plain_state, tiny, train, wrap


def _reopen(directory: Path, seed: int = 99) -> tuple[OffloadModel, dict[str, str]]:
    """Reopen ``directory`` around a model with *other* initial values (overwritten)."""
    return wrap(tiny(seed), offload_device=directory, num_slices=3, resume=True)


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_reopen_and_resume_identically(optim: str, tmp_path: Path) -> None:
    plain = tiny()
    expected = train(plain, optimizer_for(plain, optim), 4)
    om, _ = wrap(tiny(), offload_device=tmp_path, num_slices=3)
    first = train(om, optimizer_for(om, optim), 2)
    del om
    reopened, rename = _reopen(tmp_path)
    rest = train(reopened, optimizer_for(reopened, optim), 2)
    assert first + rest == expected  # the same losses, bit for bit
    assert_state_dicts_close(plain_state(reopened, rename), dict(plain.named_parameters()), atol=0)


def test_crash_mid_step_leaves_committed_generation(tmp_path: Path, monkeypatch: Any) -> None:
    plain = tiny()
    expected = train(plain, optimizer_for(plain, "adamw"), 3)
    om, _ = wrap(tiny(), offload_device=tmp_path, num_slices=3)
    opt = optimizer_for(om, "adamw")
    train(om, opt, 2)
    committed = (tmp_path / "slice1.params.g2").read_bytes()
    real_write = direct_io.write_payload
    calls = []

    def write_half_then_fail(fd: int, segments: Any, size: int, *, aligned: bool) -> None:
        calls.append(size)
        if len(calls) == 2:  # slice0 written, slice1 fails half-way through its file
            real_write(fd, segments, size // 2, aligned=aligned)
            raise OSError("disk full (simulated)")
        real_write(fd, segments, size, aligned=aligned)

    monkeypatch.setattr(direct_io, "write_payload", write_half_then_fail)
    with pytest.raises(OSError, match="simulated"):
        train(om, opt, 1)
    monkeypatch.setattr(direct_io, "write_payload", real_write)
    del om, opt
    assert (tmp_path / "slice1.params.g2").read_bytes() == committed
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    reopened, rename = _reopen(tmp_path)
    assert not [f for f in os.listdir(tmp_path) if ".g3" in f]  # half a step, deleted
    losses = train(reopened, optimizer_for(reopened, "adamw"), 1)
    assert losses == expected[2:]  # the step that crashed, redone
    assert_state_dicts_close(plain_state(reopened, rename), dict(plain.named_parameters()), atol=0)


def test_meta_model_initialised_slice_by_slice(tmp_path: Path) -> None:
    plain = tiny(seed=5)
    with torch.device("meta"):
        meta = tiny(seed=5)  # consumes no random numbers: reset_parameters replays them
    om = OffloadModel(meta, "cpu", offload_dir=tmp_path, num_slices=3)
    values = [v for k, v in om.state_dict().items() if "weight" in k or "bias" in k]
    for got, want in zip(values, plain.parameters(), strict=True):
        assert torch.equal(got, want.detach())
    train(om, optimizer_for(om, "sgd"), 1)


def test_gradients_live_in_files_and_zero_grad_deletes_them(tmp_path: Path) -> None:
    om, _ = wrap(tiny(), offload_device=tmp_path, num_slices=3)
    opt = optimizer_for(om, "sgd")
    torch.nn.functional.mse_loss(om(torch.ones(2, 8)), torch.zeros(2, 4)).backward()
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".grad")) == [
        "slice0.grad",
        "slice1.grad",
        "slice2.grad",
    ]
    assert all(p.numel() == 0 and p.grad is None for p in om.parameters())  # nothing resident
    opt.zero_grad()
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".grad")]


def test_directory_of_the_earlier_format_is_named_and_removable(tmp_path: Path) -> None:
    """A directory whose optimizer state is in torch.save files (format
    shardkit.offload/1) does not reopen; the error names both formats."""
    om, _ = wrap(tiny(), offload_device=tmp_path, num_slices=3)
    train(om, optimizer_for(om, "adamw"), 1)
    del om
    manifest = tmp_path / generations.MANIFEST
    manifest.write_text(manifest.read_text().replace("shardkit.offload/2", "shardkit.offload/1"))
    with pytest.raises(ValueError, match="'shardkit.offload/1', not 'shardkit.offload/2'"):
        _reopen(tmp_path)
    assert remove_offloaded(tmp_path) is True
    assert not manifest.exists()
