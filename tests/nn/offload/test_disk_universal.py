"""OffloadModel's disk tier in the universal checkpoint: exact round trips, other layouts.

A disk-tier OffloadModel (stepped by its sliced AdamW) and a plain twin train the same
steps. Its universal checkpoint loads into a plain model with the twin's parameters,
buffers and AdamW state exactly; the twin's checkpoint loads into a fresh disk tier
(a new generation of its directory) that then steps exactly like the twin, also after
reopening the directory. Saving leaves the directory as it was; a failed load commits
nothing. On 2 gloo ranks (``disk_universal_workers``) the disk tier crosses to and from
FSDP and OSS. Models: the ``seq`` MLP of the universal-checkpoint tests (a persistent
buffer) and the tiny GPT as stages (the tied embedding / LM head: the pinned
``shared`` group).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardkit.checkpoint.manifest import CheckpointMismatchError
from shardkit.checkpoint.universal import load_universal, save_universal
from shardkit.checkpoint.universal.adapters import tied_aliases
from shardkit.models import GPT, gpt_stages
from shardkit.nn import OffloadModel
from shardkit.nn.offload import remove_offloaded
from shardkit.nn.offload.universal_layout import original_key
from tests.checkpoint.universal_workers import TINY, batch, make_model, reference
from tests.nn.offload.disk_universal_workers import HYPER, checkpoint_tensors, disk_and_fsdp

TOL = {"atol": 1e-5, "rtol": 1e-4}


def _seq(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return make_model("seq")


def _gpt(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return gpt_stages(GPT(TINY))


MODELS: dict[str, Callable[[int], nn.Module]] = {"seq": _seq, "gpt": _gpt}


def _step(family: str, model: nn.Module, optimizer: Any, step: int) -> None:
    x, y = batch(family, step)
    optimizer.zero_grad()
    out = model(x)
    if family == "gpt":
        F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1)).backward()
    else:
        F.mse_loss(out, y).backward()
    optimizer.step()


def _disk(model: nn.Module, directory: Path) -> tuple[OffloadModel, Any]:
    om = OffloadModel(model, "cpu", offload_dir=directory, num_slices=2)
    return om, om.sliced_optimizer(torch.optim.AdamW, **HYPER)


def _twin(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    return model, torch.optim.AdamW(model.parameters(), **HYPER)  # type: ignore[arg-type]


def _assert_equal(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """Exactly the same parameters (and buffers), element-wise state and scalars."""
    assert set(got["params"]) == set(want["params"]), what
    for key, value in want["params"].items():
        assert torch.equal(got["params"][key], value), f"{what}: {key}"
    assert set(got["state"]) == set(want["state"]), what
    for key, state in want["state"].items():
        for name, value in state.items():
            assert torch.equal(got["state"][key][name], value), f"{what}: {key}.{name}"
    assert got["scalars"] == want["scalars"], what


def _assert_steps_equal(om: OffloadModel, twin: nn.Module, what: str) -> None:
    """``om``'s parameters and buffers (read slice by slice) equal the twin's exactly."""
    state = {original_key(k, om.balance): v for k, v in om.state_dict().items()}
    aliases = tied_aliases(twin)
    assert state.keys() == twin.state_dict().keys() - aliases.keys(), what
    for key, value in state.items():
        assert torch.equal(value, twin.state_dict()[key]), f"{what}: {key}"


def _listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("family", sorted(MODELS))
def test_disk_tier_saved_loads_into_plain_model_exactly(family: str, tmp_path: Path) -> None:
    om, sliced = _disk(MODELS[family](0), tmp_path / "offload")
    twin, twin_opt = _twin(MODELS[family](0))
    for step in range(2):
        _step(family, om, sliced, step)
        _step(family, twin, twin_opt, step)
    listing, generation = _listing(tmp_path / "offload"), om.tier.generation
    save_universal(tmp_path / "ckpt", 2, om, sliced)
    # saving read the files: the directory, placeholders and empty state are as before
    assert (_listing(tmp_path / "offload"), om.tier.generation) == (listing, generation)
    assert not sliced.state
    unpinned = [p for s in om.slices if not s.pinned for p in s.parameters]
    assert unpinned and all(p.numel() == 0 for p in unpinned)
    plain = MODELS[family](1)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=5.0)  # hyperparameters restored too
    load_universal(tmp_path / "ckpt", plain, plain_opt)
    _assert_equal(reference(plain, plain_opt), reference(twin, twin_opt), family)
    assert {k: plain_opt.param_groups[0][k] for k in HYPER} == HYPER
    saved_keys = checkpoint_tensors(tmp_path / "ckpt")["params"].keys()
    assert saved_keys == twin.state_dict().keys() - tied_aliases(twin).keys()  # plain keys


@pytest.mark.parametrize("family", sorted(MODELS))
def test_plain_checkpoint_loads_into_disk_tier_and_steps_like_twin(
    family: str, tmp_path: Path
) -> None:
    twin, twin_opt = _twin(MODELS[family](0))
    for step in range(2):
        _step(family, twin, twin_opt, step)
    save_universal(tmp_path / "ckpt", 2, twin, twin_opt)
    om, sliced = _disk(MODELS[family](1), tmp_path / "offload")
    sliced.param_groups[0]["lr"] = 5.0  # replaced by the checkpoint's
    load_universal(tmp_path / "ckpt", om, sliced)
    assert om.tier.generation == 1
    assert _listing(tmp_path / "offload") == sorted(
        ["manifest.json", "buffers.g1.pt"]
        + [f"{s.name}.{kind}.g1" for s in om.slices for kind in ("params", "optim")]
    )  # generation 0 and the load's scratch files are gone
    save_universal(tmp_path / "held", 2, om, sliced)
    _assert_equal(
        checkpoint_tensors(tmp_path / "held"), checkpoint_tensors(tmp_path / "ckpt"), family
    )
    assert sliced.param_groups[0]["lr"] == HYPER["lr"]
    _step(family, om, sliced, 2)
    _step(family, twin, twin_opt, 2)
    _assert_steps_equal(om, twin, f"{family} step 3")
    del om, sliced  # the directory alone carries on: the committed format is a step's
    reopened = OffloadModel(
        MODELS[family](2), "cpu", offload_dir=tmp_path / "offload", num_slices=2, resume=True
    )
    _step(family, reopened, reopened.sliced_optimizer(torch.optim.AdamW, **HYPER), 3)
    _step(family, twin, twin_opt, 3)
    _assert_steps_equal(reopened, twin, f"{family} step 4 after reopening")


def test_checkpoint_before_the_first_step_loads_without_state(tmp_path: Path) -> None:
    twin, twin_opt = _twin(_seq(0))
    save_universal(tmp_path / "ckpt", 0, twin, twin_opt)
    om, sliced = _disk(_seq(1), tmp_path / "offload")
    _step("seq", om, sliced, 0)  # state in the directory, then replaced by none
    load_universal(tmp_path / "ckpt", om, sliced)
    assert all(om.tier.store.path(s.name, "optim") is None for s in om.slices)
    _step("seq", om, sliced, 0)
    _step("seq", twin, twin_opt, 0)
    _assert_steps_equal(om, twin, "seq")


def test_failed_load_commits_nothing(tmp_path: Path) -> None:
    om, sliced = _disk(_seq(0), tmp_path / "offload")
    twin, twin_opt = _twin(_seq(0))
    _step("seq", om, sliced, 0)
    _step("seq", twin, twin_opt, 0)
    other = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))  # other shapes
    save_universal(tmp_path / "other", 1, other, torch.optim.AdamW(other.parameters()))
    listing, before = _listing(tmp_path / "offload"), om.state_dict()
    with pytest.raises(CheckpointMismatchError, match="does not fit the model"):
        load_universal(tmp_path / "other", om, sliced)
    assert (_listing(tmp_path / "offload"), om.tier.generation) == (listing, 1)
    assert not sliced.state and all(p.numel() == 0 for p in om.slices[0].parameters)
    after = om.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    _step("seq", om, sliced, 1)  # training goes on from generation 1
    _step("seq", twin, twin_opt, 1)
    _assert_steps_equal(om, twin, "seq")


def test_model_only_round_trip_keeps_the_optimizer_state(tmp_path: Path) -> None:
    om, sliced = _disk(_seq(0), tmp_path / "offload")
    _step("seq", om, sliced, 0)
    save_universal(tmp_path / "ckpt", 1, om)
    optim_files = {s.name: om.tier.store.path(s.name, "optim") for s in om.slices}
    plain = _seq(1)
    load_universal(tmp_path / "ckpt", plain)
    _assert_steps_equal(om, plain, "model only")
    fresh, fresh_opt = _disk(_seq(2), tmp_path / "fresh")
    _step("seq", fresh, fresh_opt, 0)
    load_universal(tmp_path / "ckpt", fresh)  # no optimizer: its state files stay
    assert fresh.tier.generation == 2 and all(
        fresh.tier.store.path(s.name, "optim") is not None for s in fresh.slices
    )
    _assert_steps_equal(fresh, plain, "model only, loaded")
    assert optim_files == {s.name: om.tier.store.path(s.name, "optim") for s in om.slices}


def test_disk_tier_refuses_a_torch_optimizer(tmp_path: Path) -> None:
    om, _ = _disk(_seq(0), tmp_path / "offload")
    with pytest.raises(ValueError, match=r"pass its model.sliced_optimizer\(...\), not a AdamW"):
        save_universal(tmp_path / "ckpt", 0, om, torch.optim.AdamW(om.parameters()))


@pytest.mark.timeout(240)
def test_disk_tier_crosses_fsdp_and_oss_on_two_ranks(rank_pool: Any, tmp_path: Path) -> None:
    """Per direction: loaded == checkpoint exactly; checkpoint and next step match the
    plain twin to fp32 rounding (the 2 ranks average half-batch gradients)."""
    for other in ("fsdp", "oss"):
        result = rank_pool(2).run(disk_and_fsdp, str(tmp_path / other), other)[0]
        for direction, got in result.items():
            label = f"{direction} ({other})"
            loaded = {k: got["loaded"][k] for k in ("params", "state", "scalars")}
            _assert_equal(loaded, got["saved"], label)
            for name in ("saved", "stepped"):
                want = got["want" if name == "saved" else "want_stepped"]
                for key, value in want["params"].items():
                    torch.testing.assert_close(
                        got[name]["params"][key], value, **TOL, msg=f"{label} {name} {key}"
                    )
            assert got["saved"]["scalars"] == got["want"]["scalars"], label


def test_remove_offloaded_deletes_the_tier_files_only(tmp_path: Path) -> None:
    om, sliced = _disk(_seq(0), tmp_path / "offload")
    _step("seq", om, sliced, 0)
    (tmp_path / "offload" / "notes.txt").write_text("mine")
    del om, sliced
    assert remove_offloaded(tmp_path / "offload") is True
    assert _listing(tmp_path / "offload") == ["notes.txt"]
    assert remove_offloaded(tmp_path / "offload") is False  # nothing left to remove
    _disk(_seq(0), tmp_path / "offload")  # a new model starts there (no resume=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text('{"format": "shardkit.fsdp.disk/1"}')
    with pytest.raises(ValueError, match="not an offloaded model"):
        remove_offloaded(other)
    assert _listing(other) == ["manifest.json"]


def test_save_between_backward_and_step_keeps_held_gradients(tmp_path: Path) -> None:
    """With ``disk_io_bytes``, backward's last slice holds its gradients in memory for
    the step. A save then (it drops the read-aheads first, handing held gradients to
    their files) assigned them to the offloaded slice's empty placeholders and failed:
    "attempting to assign a gradient of size [16, 8] to a tensor of size [0]" (found by
    the disk tier's state machine). They go to the gradient file directly now, and the
    step after uses them."""
    om = OffloadModel(
        _seq(0), "cpu", offload_dir=tmp_path / "offload", num_slices=2, disk_io_bytes=2**20
    )
    sliced = om.sliced_optimizer(torch.optim.AdamW, **HYPER)
    twin, twin_opt = _twin(_seq(0))
    x, y = batch("seq", 0)
    for model in (om, twin):
        F.mse_loss(model(x), y).backward()
    save_universal(tmp_path / "ckpt", 0, om, sliced)
    sliced.step()
    twin_opt.step()
    _assert_steps_equal(om, twin, "saved between backward and step")
