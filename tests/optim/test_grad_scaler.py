"""ShardedGradScaler: every rank skips the same step and keeps the same scale."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.optim.grad_scaler import ShardedGradScaler
from shardkit.testing import assert_tensors_close


def _train(
    scaler: torch.amp.GradScaler,
    inject_inf_at: int | None,
    inf_rank: int,
    bad: float = float("inf"),
) -> list[Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    rank = dist.get_rank() if dist.is_initialized() else 0
    for step in range(4):
        opt.zero_grad()
        x = torch.randn(8, 4)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step == inject_inf_at and rank == inf_rank:
            model.weight.grad[0, 0] = bad
        scaler.step(opt)
        scaler.update()
        history.append((model.weight.detach().clone(), scaler.get_scale()))
    return history


def _sharded_run() -> list[Any]:
    return [
        _train(ShardedGradScaler(init_scale=1024.0), inject_inf_at=None, inf_rank=1),
        _train(ShardedGradScaler(init_scale=1024.0), inject_inf_at=2, inf_rank=1),
        _train(ShardedGradScaler(init_scale=1024.0, growth_interval=1), None, 0),
    ]


def test_overflow_on_one_rank_is_skipped_on_all(rank_pool) -> None:
    per_rank = rank_pool(2).run(_sharded_run)
    reference_clean = _train(torch.amp.GradScaler("cpu", init_scale=1024.0), None, 0)
    reference_growth = _train(
        torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1), None, 0
    )
    for rank, (clean, inf_run, growth) in enumerate(per_rank):
        # no overflow: identical to torch's GradScaler (the same batches on every rank)
        for step, ((w, s), (w_ref, s_ref)) in enumerate(zip(clean, reference_clean)):
            assert s == s_ref == 1024.0
            assert_tensors_close(w, w_ref, atol=0, rtol=0, name=f"rank {rank} step {step}")
        assert (
            [s for _, s in growth]
            == [s for _, s in reference_growth]
            == [
                2048.0,
                4096.0,
                8192.0,
                16384.0,
            ]
        )
        # overflow on rank 1 at step 2: every rank skips that step and halves the scale
        assert [s for _, s in inf_run] == [1024.0, 1024.0, 512.0, 512.0]
        assert_tensors_close(inf_run[2][0], inf_run[1][0], atol=0, rtol=0, name="skipped step")
    for a, b in zip(per_rank[0][1], per_rank[1][1]):
        assert_tensors_close(a[0], b[0], atol=0, rtol=0, name="ranks agree")


def test_disabled_is_pass_through() -> None:
    scaler = ShardedGradScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss
    assert scaler.get_scale() == 1.0


def _nan_run() -> list[Any]:
    return _train(ShardedGradScaler(init_scale=1024.0), 2, inf_rank=1, bad=float("nan"))


def test_nan_gradient_on_one_rank_is_skipped_on_all(rank_pool) -> None:
    """A NaN (not an overflow) in one rank's gradient: the same skip as for inf."""
    per_rank = rank_pool(2).run(_nan_run)
    for run in per_rank:
        assert [s for _, s in run] == [1024.0, 1024.0, 512.0, 512.0]
        assert_tensors_close(run[2][0], run[1][0], atol=0, rtol=0, name="skipped step")
        assert all(bool(w.isfinite().all()) for w, _ in run)
    for a, b in zip(*per_rank):
        assert_tensors_close(a[0], b[0], atol=0, rtol=0, name="ranks agree")
