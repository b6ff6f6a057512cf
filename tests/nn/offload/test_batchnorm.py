"""BatchNorm running statistics: updated once per micro-batch, also when recomputing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from shardkit.distributed.linear_partition import balance_bounds
from shardkit.nn.offload import OffloadModel
from shardkit.testing import assert_state_dicts_close
from tests.nn.offload.common import X, Y, optimizer_for, plain_state, target, wrap

STEPS = 3


def with_batchnorm(seed: int = 0) -> nn.Sequential:
    """Six layers, two BatchNorms: one with momentum 0.1, one cumulative (momentum=None)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.BatchNorm1d(16),
        nn.GELU(),
        nn.Linear(16, 16),
        nn.BatchNorm1d(16, momentum=None),
        nn.Linear(16, 4),
    )


def train_per_microbatch(model: nn.Module, microbatches: int) -> None:
    """``STEPS`` SGD steps; the plain model runs each micro-batch as OffloadModel does."""
    optimizer = optimizer_for(model, "sgd")
    for _ in range(STEPS):
        optimizer.zero_grad()
        out = model(X) if isinstance(model, OffloadModel) else plain_forward(model, microbatches)
        nn.functional.mse_loss(out, Y).backward()
        optimizer.step()


def plain_forward(model: nn.Module, microbatches: int) -> torch.Tensor:
    return torch.cat([model(chunk) for chunk in X.tensor_split(microbatches)])


@pytest.mark.parametrize("tier", ["memory", "disk"])
@pytest.mark.parametrize("microbatches", [1, 3])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_running_statistics_match_plain_model(
    checkpoint: bool, microbatches: int, tier: str, tmp_path: Path
) -> None:
    plain = with_batchnorm()
    train_per_microbatch(plain, microbatches)
    om, rename = wrap(
        with_batchnorm(),
        offload_device=target(tier, tmp_path),
        num_slices=3,
        checkpoint_activation=checkpoint,
        num_microbatches=microbatches,
    )
    train_per_microbatch(om, microbatches)
    buffers = {k: v for k, v in om.state_dict().items() if k not in rename}
    expected = {
        f"model_slices.{i}.{name}": b
        for i, (start, stop) in enumerate(balance_bounds(om.balance))
        for name, b in nn.Sequential(*list(plain)[start:stop]).state_dict().items()
        if "running" in name or "num_batches" in name
    }
    assert sorted(buffers) == sorted(expected)
    # one count per micro-batch forward, none for the recompute in backward
    counts = {k: int(v) for k, v in buffers.items() if "num_batches" in k}
    assert counts == dict.fromkeys(counts, STEPS * microbatches)
    assert_state_dicts_close(buffers, expected, atol=1e-6)
    assert_state_dicts_close(plain_state(om, rename), dict(plain.named_parameters()), atol=1e-5)
