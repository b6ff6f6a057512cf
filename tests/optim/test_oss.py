"""OSS parity with the unsharded optimizer, memory per rank, clipping and bad input.

Every distributed test runs a grid of configurations inside one ``pool.run`` per world
size (1, 2, 3, 4). Each rank trains a replica with OSS on its local batch (gradients
averaged over ranks, as DDP does) and, in the same process, a reference model with the
plain optimizer on the global batch; they must agree to fp32 rounding.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.memory import model_state_bytes
from shardkit.optim import OSS
from shardkit.testing import assert_same_across_ranks, assert_state_dicts_close

WORLD_SIZES = [1, 2, 3, 4]
LOCAL_BATCH = 4


class Net(nn.Module):
    """Parameters of varied sizes (so partitions are uneven) and a frozen-able layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 24)
        self.mid = nn.Linear(24, 24)
        self.head = nn.Linear(24, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(torch.tanh(self.emb(x))))) * self.scale


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(LOCAL_BATCH, 6, generator=g), torch.randn(LOCAL_BATCH, 3, generator=g)


def global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(batch(step, r) for r in range(world)))
    return torch.cat(xs), torch.cat(ys)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def average_grads(model: nn.Module) -> None:
    """DDP semantics by hand: gradients averaged over ranks."""
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def param_groups(model: Net, two_groups: bool) -> list[dict[str, Any]]:
    if not two_groups:
        return [{"params": list(model.parameters())}]
    return [
        {"params": [*model.emb.parameters(), model.scale], "lr": 0.05, "weight_decay": 0.0},
        {"params": [*model.mid.parameters(), *model.head.parameters()], "weight_decay": 0.1},
    ]


CONFIGS: list[dict[str, Any]] = [
    {"name": "sgd", "optim": torch.optim.SGD, "kw": {"lr": 0.1}},
    {"name": "sgd-momentum", "optim": torch.optim.SGD, "kw": {"lr": 0.1, "momentum": 0.9}},
    {"name": "adam", "optim": torch.optim.Adam, "kw": {"lr": 0.01}},
    {"name": "adamw-groups", "optim": torch.optim.AdamW, "kw": {"lr": 0.01}, "groups": True},
    {"name": "adamw-sched", "optim": torch.optim.AdamW, "kw": {"lr": 0.01}, "sched": True},
    {
        "name": "sgd-frozen",
        "optim": torch.optim.SGD,
        "kw": {"lr": 0.1, "momentum": 0.9},
        "freeze": True,
    },
    {"name": "adam-bucket64", "optim": torch.optim.Adam, "kw": {"lr": 0.01}, "bucket": 64},
    {"name": "adam-nobucket", "optim": torch.optim.Adam, "kw": {"lr": 0.01}, "bucket": 0},
    {"name": "adamw-ddp", "optim": torch.optim.AdamW, "kw": {"lr": 0.01}, "ddp": True},
    {"name": "adam-add-group", "optim": torch.optim.Adam, "kw": {"lr": 0.01}, "add_group_at": 2},
    {
        "name": "sgd-unfreeze",
        "optim": torch.optim.SGD,
        "kw": {"lr": 0.1, "momentum": 0.9},
        "freeze": True,
        "unfreeze_at": 2,
    },
]


def _run_parity(cfg: dict[str, Any], steps: int = 4) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    if cfg.get("freeze"):
        model.mid.weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    wrapped: nn.Module = DDP(model) if cfg.get("ddp") else model
    groups = param_groups(model, cfg.get("groups", False))
    ref_groups = param_groups(ref, cfg.get("groups", False))
    if cfg.get("add_group_at") is not None:  # model.scale joins in a group of its own later
        for gs, m in ((groups, model), (ref_groups, ref)):
            gs[0]["params"] = [p for p in gs[0]["params"] if p is not m.scale]
    opt = OSS(groups, optim=cfg["optim"], broadcast_buffer_size=cfg.get("bucket", -1), **cfg["kw"])
    ref_opt = cfg["optim"](ref_groups, **cfg["kw"])
    scheds = []
    if cfg.get("sched"):
        scheds = [
            torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref_opt)
        ]
    for step in range(steps):
        if step == cfg.get("unfreeze_at"):
            model.mid.weight.requires_grad_(True)
            ref.mid.weight.requires_grad_(True)
        if step == cfg.get("add_group_at"):
            opt.add_param_group({"params": [model.scale], "lr": 0.02})
            ref_opt.add_param_group({"params": [ref.scale], "lr": 0.02})
        x, y = batch(step, rank)
        loss_fn(wrapped, x, y).backward()
        if not cfg.get("ddp") and world > 1:
            average_grads(model)
        opt.step()
        opt.zero_grad()
        gx, gy = global_batch(step, world)
        loss_fn(ref, gx, gy).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for s in scheds:
            s.step()
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert_state_dicts_close(model, ref, atol=1e-6, rtol=1e-5)
    assert_same_across_ranks(model)
    owned = {id(p) for p in opt.local_params()}
    assert all(id(p) in owned for p in opt.state), "state outside the local shard"
    return {"name": cfg["name"], "owned": sorted(opt.param_to_rank.values())}


def _parity_grid() -> list[dict[str, Any]]:
    return [_run_parity(cfg) for cfg in CONFIGS]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_parity_with_unsharded_optimizer(rank_pool, world_size: int) -> None:
    results = rank_pool(world_size).run(_parity_grid)
    assert results[0] == results[-1]  # every rank made the same partition
    for cfg, res in zip(CONFIGS, results[0]):
        assert res["name"] == cfg["name"]
        assert set(res["owned"]) <= set(range(world_size))


def _memory_and_clip() -> dict[str, Any]:
    """Optimizer bytes per rank ~ total / N; clip_grad_norm == torch's on the full model."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8 * (i + 1), 8 * (i + 2)) for i in range(5)))
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    x = torch.randn(4, 8)
    model(x).pow(2).mean().backward()
    opt.step()
    local = model_state_bytes(model, opt).optimizer_state
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([local]))
    per_rank = [int(t) for t in gathered]
    largest = max(p.numel() for p in model.parameters()) * 8 + 4  # exp_avg + exp_avg_sq + step
    total = sum(per_rank)
    assert total == sum(p.numel() * 8 + 4 for p in model.parameters())
    assert max(abs(b - total / world) for b in per_rank) <= largest
    norms = []
    for norm_type in (1.0, 2.0, math.inf):
        ref = copy.deepcopy(model)
        opt.zero_grad()
        (model(x) * (rank + 1)).pow(2).mean().backward()
        average_grads(model)
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.clone()
        ours = opt.clip_grad_norm(0.5, norm_type)
        theirs = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type)
        assert torch.allclose(ours, theirs, rtol=1e-5), (norm_type, ours, theirs)
        for p in opt.local_params():
            q = dict(zip(model.parameters(), ref.parameters()))[p]
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        norms.append(float(ours))
    return {"per_rank": per_rank, "norms": norms}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_memory_per_rank_and_clip_grad_norm(rank_pool, world_size: int) -> None:
    results = rank_pool(world_size).run(_memory_and_clip)
    assert all(r == results[0] for r in results)


def _broadcast_fp16_and_buckets() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(12)))  # 24 small tensors
    opt = OSS(model.parameters(), lr=0.1, broadcast_fp16=True)
    model(torch.randn(2, 4) + rank).sum().backward()
    average_grads(model)
    opt.step()
    assert_same_across_ranks(model)
    halves = all(torch.equal(p, p.half().float()) for p in model.parameters())
    big = OSS(model.parameters(), lr=0.1)  # default 16 MiB buckets: one broadcast per owner
    model(torch.randn(2, 4)).sum().backward()
    count = big._broadcast_params()
    return {"fp16_exact": halves or world == 1, "broadcasts": count}


@pytest.mark.parametrize("world_size", [2, 3])
def test_broadcast_fp16_keeps_ranks_identical_and_buckets_bound_collectives(
    rank_pool, world_size: int
) -> None:
    results = rank_pool(world_size).run(_broadcast_fp16_and_buckets)
    assert all(r["fp16_exact"] for r in results)
    assert results[0]["broadcasts"] == world_size  # 24 parameters, one bucket per owner


def _state_dict_needs_consolidation() -> str:
    model = nn.Linear(3, 3)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.1)
    opt.consolidate_state_dict(recipient_rank=0)
    if dist.get_rank() == 0:
        return str(len(opt.state_dict()["param_groups"]))
    with pytest.raises(RuntimeError, match=r"consolidate_state_dict\(recipient_rank=1\)"):
        opt.state_dict()
    return "raised"


def test_bad_input_errors_name_the_fix(rank_pool) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="optimizer class such as torch.optim.AdamW"):
        OSS(model.parameters(), optim=torch.optim.SGD(model.parameters(), lr=0.1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer class"):
        OSS(model.parameters(), optim=dict)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty parameter list"):
        OSS([], lr=0.1)
    assert rank_pool(2).run(_state_dict_needs_consolidation) == ["1", "raised"]


def _process_group_keyword() -> dict[str, Any]:
    pair = dist.new_group([0, 1])  # collective on every rank; rank 2 is not in it
    if dist.get_rank() == 2:
        return {}
    torch.manual_seed(0)
    model = Net()
    by_alias = copy.deepcopy(model)
    opt = OSS(model.parameters(), lr=0.1, process_group=pair)
    alias = OSS(by_alias.parameters(), group=pair, lr=0.1)
    same = OSS(nn.Linear(2, 2).parameters(), lr=0.1, process_group=pair, group=pair)
    for o, m in ((opt, model), (alias, by_alias)):
        loss_fn(m, *batch(0, 0)).backward()
        o.step()
    assert_state_dicts_close(model, by_alias, atol=0.0)
    with pytest.raises(ValueError, match="group is FairScale's name for process_group"):
        OSS(Net().parameters(), lr=0.1, process_group=pair, group=dist.group.WORLD)
    return {
        "sizes": (opt.world_size, alias.world_size, same.world_size),
        "groups": (opt.process_group is pair, opt.group is pair, alias.process_group is pair),
        "owned": sorted(opt.param_to_rank.values()),
    }


def test_process_group_keyword_with_group_as_alias(rank_pool) -> None:
    results = rank_pool(3).run(_process_group_keyword)
    assert results[2] == {}
    assert results[0] == results[1]
    assert results[0]["sizes"] == (2, 2, 2) and results[0]["groups"] == (True, True, True)
    assert set(results[0]["owned"]) == {0, 1}  # ranks of the pair, not of the world
