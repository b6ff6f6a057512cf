"""Parity: OffloadModel trains exactly like the plain model, on every tier."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from shardkit.models import GPT, GPTConfig, gpt_stages
from shardkit.nn.offload import OffloadModel
from shardkit.testing import assert_state_dicts_close
from tests.nn.offload.common import (
    OPTIMIZERS,
    X,
    optimizer_for,
    plain_state,
    target,
    tiny,
    train,
    wrap,
)

STEPS = 3


_GRID = [(1, False, 1), (1, True, 3), (3, False, 1), (3, True, 1), (3, True, 3), (3, False, 3)]
_GRID += [(4, False, 1), (4, True, 3)]
_DISK_GRID = [("disk", *c) for c in _GRID]  # the slowest tier (files, fsync): 8 configs
_MEMORY_GRID = [
    (tier, n, c, m)
    for tier in ("resident", "memory")
    for n in (1, 3, 4)
    for c, m in [(False, 1), (True, 1), (True, 3), (False, 3)]
]


@pytest.mark.parametrize("optim", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    ("tier", "num_slices", "checkpoint", "microbatches"), _MEMORY_GRID + _DISK_GRID
)
def test_parity_with_plain_model(
    tier: str, num_slices: int, checkpoint: bool, microbatches: int, optim: str, tmp_path: Path
) -> None:
    plain = tiny()
    expected_losses = train(plain, optimizer_for(plain, optim), STEPS)
    om, rename = wrap(
        tiny(),
        offload_device=target(tier, tmp_path),
        num_slices=num_slices,
        checkpoint_activation=checkpoint,
        num_microbatches=microbatches,
    )
    losses = train(om, optimizer_for(om, optim), STEPS)
    # One micro-batch: the same operations in the same order, bit for bit. Several: the
    # batch-mean gradient is summed in another order (fp32 rounding).
    atol = 0.0 if microbatches == 1 else 1e-5
    assert_state_dicts_close(plain_state(om, rename), dict(plain.named_parameters()), atol=atol)
    assert losses == pytest.approx(expected_losses, abs=atol + 1e-6)


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_dropout_replayed_when_recomputing(tier: str, tmp_path: Path) -> None:
    plain = tiny(dropout=0.5)
    torch.manual_seed(7)
    train(plain, optimizer_for(plain, "adamw"), STEPS)
    om, rename = wrap(
        tiny(dropout=0.5), offload_device=target(tier, tmp_path), checkpoint_activation=True
    )
    torch.manual_seed(7)
    train(om, optimizer_for(om, "adamw"), STEPS)
    assert_state_dicts_close(plain_state(om, rename), dict(plain.named_parameters()), atol=0.0)
    assert torch.get_rng_state().ne(torch.manual_seed(7).get_state()).any()  # RNG advanced


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_gradient_accumulation_and_eval(tier: str, tmp_path: Path) -> None:
    plain = tiny()
    om, rename = wrap(tiny(), offload_device=target(tier, tmp_path), num_slices=3)
    for model in (plain, om):
        opt = optimizer_for(model, "adamw")
        for _ in range(2):
            opt.zero_grad()
            for half in (X[:3], X[3:]):  # two backward calls, one step
                nn.functional.mse_loss(model(half), torch.ones(3, 4)).backward()
            opt.step()
    assert_state_dicts_close(plain_state(om, rename), dict(plain.named_parameters()), atol=1e-6)
    with torch.no_grad():
        assert torch.allclose(om(X), plain(X), atol=1e-6)


def test_learning_rate_changes_reach_sliced_optimizer(tmp_path: Path) -> None:
    plain = tiny()
    om, rename = wrap(tiny(), offload_device=tmp_path / "d", num_slices=2)
    for model in (plain, om):
        opt = optimizer_for(model, "adamw")
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        train(model, opt, 1)
        scheduler.step()
        opt.param_groups[0]["weight_decay"] = 0.5  # by hand
        train(model, opt, 1)
        assert opt.param_groups[0]["lr"] == 0.005
    assert_state_dicts_close(plain_state(om, rename), dict(plain.named_parameters()), atol=0.0)


@pytest.mark.parametrize(("tier", "microbatches"), [("memory", 1), ("disk", 1), ("disk", 2)])
def test_gpt_with_tied_head(tier: str, microbatches: int, tmp_path: Path) -> None:
    """GPT stages: the tied embedding / LM head weight is stepped once, in the shared group."""
    config = GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16)
    torch.manual_seed(0)
    gpt = GPT(config)
    copy_ = copy.deepcopy(gpt)
    idx = torch.randint(0, config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(3))
    om, rename = wrap(
        gpt_stages(copy_),
        names_from=copy_,
        offload_device=target(tier, tmp_path),
        num_slices=3,
        checkpoint_activation=True,
        num_microbatches=microbatches,
    )
    assert om.slices[0].name == "shared"
    opt_ref = torch.optim.AdamW(gpt.parameters(), lr=1e-2)
    opt = (
        optimizer_for(om, "adamw")
        if tier == "disk"
        else torch.optim.AdamW(om.parameters(), lr=1e-2)
    )
    if tier == "disk":
        opt.param_groups[0].update(lr=1e-2, weight_decay=0.01)
    for _ in range(STEPS):
        opt_ref.zero_grad()
        gpt(idx, targets=idx)[1].backward()  # type: ignore[union-attr]
        opt_ref.step()
        opt.zero_grad()
        logits = om(idx)
        nn.functional.cross_entropy(
            logits.reshape(-1, config.vocab_size), idx.reshape(-1)
        ).backward()
        opt.step()
    # Adam divides by sqrt(v): near-zero gradients amplify the summation-order rounding
    # of several micro-batches, hence the looser tolerance there.
    atol = 0.0 if microbatches == 1 else 1e-4
    assert_state_dicts_close(plain_state(om, rename), dict(gpt.named_parameters()), atol=atol)


def test_balance_by_parameters(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(40, 40))
    om = OffloadModel(model, "cpu", num_slices=2)
    assert om.balance == [3, 1]
