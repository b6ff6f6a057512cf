"""benchmarks.comm: bytes counted for known collective patterns on 2 gloo ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from benchmarks import comm
from shardkit.testing import RankPool

N = 1000  # fp32 elements


def _patterns() -> dict[str, Any]:
    try:
        out = _count_patterns(comm.install())
    finally:
        comm.uninstall()
    out["restored"] = not getattr(dist.all_reduce, "__shardkit_counted__", False)
    return out


def _count_patterns(counter: comm.CommCounter) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rank, world = dist.get_rank(), dist.get_world_size()
    counter.reset()  # the counter is per process: an earlier test in this rank may have used it
    t = torch.ones(N)
    dist.all_reduce(t)  # outside counting(): not counted
    out["idle"] = counter.snapshot()
    with counter.counting():
        dist.all_reduce(t)
    out["all_reduce"] = counter.snapshot()
    counter.reset()
    with counter.counting():
        full = torch.empty(N * world)
        dist.all_gather_into_tensor(full, torch.ones(N))  # calls all_gather_single inside
        dist.reduce_scatter_tensor(torch.empty(N), torch.ones(N * world))
        dist.broadcast(torch.ones(N), src=0)
        work = dist.all_reduce(torch.ones(N, dtype=torch.bfloat16), async_op=True)
        assert work is not None
        work.wait()
    out["mixed"] = counter.snapshot()
    counter.reset()
    with counter.counting():
        if rank == 0:
            dist.send(torch.ones(N), 1)
        else:
            dist.recv(torch.empty(N), 0)
    out["p2p"] = counter.snapshot()
    counter.reset()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(10, 5))  # 55 parameters
    comm.count_ddp(model)
    reference = nn.Linear(10, 5)
    reference.load_state_dict(model.module.state_dict())
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(rank))
    with counter.counting():
        model(x).sum().backward()
    reference(x).sum().backward()
    grads = [reference.weight.grad.clone(), reference.bias.grad.clone()]
    for g in grads:
        dist.all_reduce(g)
        g /= world
    out["ddp"] = counter.snapshot()
    out["ddp_grad_diff"] = max(
        float((p.grad - g).abs().max()) for p, g in zip(model.module.parameters(), grads)
    )
    return out


def test_counted_bytes_of_known_patterns(rank_pool: Callable[[int], RankPool]) -> None:
    results = rank_pool(2).run(_patterns)
    for rank, r in enumerate(results):
        assert r["restored"]
        assert r["idle"]["calls"] == {}
        # an all-reduce of N fp32 elements: payload 4N bytes; ring volume 2 (N-1)/N x 4N
        assert r["all_reduce"]["payload_bytes"] == {"all_reduce": 4 * N}
        assert r["all_reduce"]["volume_bytes"] == {"all_reduce": 4 * N}
        mixed = r["mixed"]
        assert mixed["calls"] == {
            "all_gather": 1,
            "reduce_scatter": 1,
            "broadcast": 1,
            "all_reduce": 1,
        }
        assert mixed["payload_bytes"] == {
            "all_gather": 8 * N,  # the gathered tensor, counted once (not again inside)
            "reduce_scatter": 8 * N,  # the unscattered input
            "broadcast": 4 * N,
            "all_reduce": 2 * N,  # bf16
        }
        assert mixed["total_volume_bytes"] == 4 * N + 4 * N + 2 * N + 2 * N
        p2p = r["p2p"]
        if rank == 0:
            assert p2p["payload_bytes"] == {"send": 4 * N} and p2p["received_bytes"] == 0
        else:
            assert p2p["payload_bytes"] == {} and p2p["received_bytes"] == 4 * N
        # torch DDP through the counted hook: the gradients (55 fp32) all-reduced once,
        # and the averaged gradients are DDP's
        assert r["ddp"]["payload_bytes"] == {"all_reduce": 55 * 4}
        assert r["ddp_grad_diff"] < 1e-6


@pytest.mark.parametrize(
    ("stage", "world", "expected"),
    [
        (0, 2, 2 * 100 * 4 / 2),
        (1, 4, 2 * 100 * 4 * 3 / 4),
        (2, 1, 0.0),
        (3, 4, 3 * 100 * 4 * 3 / 4),
    ],
)
def test_theory_volume(stage: int, world: int, expected: float) -> None:
    assert comm.theory_volume_bytes(100, world, stage) == pytest.approx(expected)


def test_theory_volume_rejects_bad_stage() -> None:
    with pytest.raises(ValueError, match="got 4"):
        comm.theory_volume_bytes(100, 2, 4)
