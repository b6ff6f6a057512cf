"""Universal checkpoints of a plain module and torch DDP: exact round trips across world sizes.

Two gloo ranks train a small model (Linear, BatchNorm, Linear; AdamW with two param
groups of different hyperparameters) under DDP and save it; the checkpoint loads back
at 2 ranks (DDP), in this process (a plain model, 1 rank), and a 1-rank checkpoint
loads at 2 ranks. Parameters, buffers, AdamW's state (``exp_avg``, ``exp_avg_sq``,
``step``) and each group's lr / betas / weight decay come back exactly, and one more
step from the loaded state equals one more step from the original.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.checkpoint import CheckpointError
from shardkit.checkpoint.manifest import read_manifest
from shardkit.checkpoint.universal import (
    DDPLayout,
    PlainLayout,
    TensorView,
    layout_of,
    load_universal,
    save_universal,
)
from shardkit.distributed.shard_descriptor import set_view
from shardkit.nn.tensor_parallel.partition import shard
from tests.checkpoint.payload import plant_payload


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


def _optimizer(model: nn.Module, lr: tuple[float, float] = (0.1, 0.01)) -> torch.optim.AdamW:
    first = list(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    return torch.optim.AdamW(
        [
            {"params": first, "lr": lr[0], "weight_decay": 0.0},
            {"params": rest, "lr": lr[1], "betas": (0.8, 0.95)},
        ]
    )


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Parameters, buffers, optimizer state and hyperparameters (detached copies)."""
    sd = optimizer.state_dict()
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "state": {
            i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            for i, st in sd["state"].items()
        },
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]],
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a["model"]) == list(b["model"])
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert sorted(a["state"]) == sorted(b["state"])
    for i in a["state"]:
        assert sorted(a["state"][i]) == sorted(b["state"][i]), i
        for k, v in a["state"][i].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][i][k])), (i, k)
    assert a["groups"] == b["groups"]


def _ddp_worker(root: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    model = DistributedDataParallel(_model())
    optimizer = _optimizer(model.module)
    for s in range(2):
        _step(model, optimizer, 10 * s + rank)
    extra = {"rank": rank, "rng": torch.get_rng_state(), "pos": [rank, 3]}
    ckpt = save_universal(root / "ddp", 2, model, optimizer, extra=extra)
    saved = _snapshot(model.module, optimizer)
    rank0 = [saved]
    dist.broadcast_object_list(rank0, src=0)  # DDP: rank 0's buffers are saved
    saved["model"].update({k: v for k, v in rank0[0]["model"].items() if "running" in k})
    # back at 2 ranks into a fresh DDP model with other hyperparameters
    fresh = DistributedDataParallel(_model())
    fresh_opt = _optimizer(fresh.module, lr=(0.5, 0.5))
    loaded = load_universal(root / "ddp", fresh, fresh_opt)
    assert_same(saved, _snapshot(fresh.module, fresh_opt))
    assert (loaded.step, loaded.saved_world_size, loaded.saved_strategy) == (2, 2, "ddp")
    assert loaded.extra(rank)["pos"] == [rank, 3] and loaded.extra(2) is None
    assert torch.equal(loaded.extra(rank)["rng"], extra["rng"])
    # the same trajectory: one more step from both
    _step(model, optimizer, 99 + rank)
    _step(fresh, fresh_opt, 99 + rank)
    assert_same(_snapshot(model.module, optimizer), _snapshot(fresh.module, fresh_opt))
    # a 1-rank checkpoint (written by the test process) loads at 2 ranks
    one = DistributedDataParallel(_model())
    one_opt = _optimizer(one.module)
    load_universal(root / "one", one, one_opt)
    # a plain module (no DDP) saved by 2 ranks: each writes half of every tensor
    save_universal(root / "plain", 4, one.module, one_opt)
    return {"saved": saved, "ckpt": str(ckpt), "one": _snapshot(one.module, one_opt)}


def _errors_worker(root: Path) -> list[str]:
    """One rank's bad input fails the collective on every rank (no rank left waiting)."""
    rank, out = dist.get_rank(), []
    model = DistributedDataParallel(_model())
    bad = {"x": np.zeros(1)} if rank == 1 else {}
    try:
        save_universal(root, 1, model, extra=bad)
    except TypeError as err:
        out.append(f"save: {err}")
    save_universal(root, 2, model, extra={"rank": rank})
    dist.barrier()
    if rank == 0:
        plant_payload(root / "ckpt-000002", "extra-1.pt", root / "marker")
    dist.barrier()
    try:
        load_universal(root, model)
    except CheckpointError as err:
        out.append(f"load: {type(err).__name__} {err.problem}: {err}")
    out.append(f"marker: {(root / 'marker').exists()}")
    return out


def _tp_full() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 6))


def _tp_worker(root: Path) -> dict[str, Any]:
    """Each rank holds part r of 2 (stride 3, a fused q|k|v) of the Linear, the
    LayerNorm whole; one AdamW step on its own part; saved by the plain layout."""
    rank = dist.get_rank()
    full = _tp_full()
    local = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 3))
    local[0].load_state_dict(full[0].state_dict())
    with torch.no_grad():
        for name in ("weight", "bias"):
            part = shard(getattr(full[1], name), 0, rank, 2, stride=3)
            getattr(local[1], name).copy_(part)
            set_view(
                getattr(local[1], name),
                TensorView((6, *part.shape[1:]), 0, rank, 2, 3),
            )
    optimizer = torch.optim.AdamW(local.parameters(), lr=0.1)
    local(torch.ones(2, 4)).sum().backward()
    for p in local[0].parameters():  # replicas: the same gradient on every rank
        assert p.grad is not None
        dist.all_reduce(p.grad)
    optimizer.step()
    ckpt = save_universal(root, 1, local, optimizer)
    states = {
        name: {k: v.clone() for k, v in optimizer.state[p].items()}
        for name, p in local.named_parameters()
    }
    return {"ckpt": str(ckpt), "model": local.state_dict(), "state": states}


def test_plain_roundtrip_one_rank(tmp_path: Path) -> None:
    model, optimizer = _model(), None
    optimizer = _optimizer(model)
    for s in range(3):
        _step(model, optimizer, s)
    save_universal(tmp_path, 3, model, optimizer, extra={"pos": 5})
    saved = _snapshot(model, optimizer)
    fresh = _model()
    fresh_opt = _optimizer(fresh, lr=(1.0, 2.0))
    loaded = load_universal(tmp_path, fresh, fresh_opt)
    assert_same(saved, _snapshot(fresh, fresh_opt))
    assert fresh_opt.param_groups[1]["betas"] == (0.8, 0.95)  # a tuple again
    assert (loaded.step, loaded.saved_world_size, loaded.saved_strategy) == (3, 1, "plain")
    assert loaded.extra(0) == {"pos": 5} and loaded.extra(1) is None


def test_before_first_step_no_state(tmp_path: Path) -> None:
    """A checkpoint saved before the first step loads as no state, also into an
    optimizer that has stepped."""
    model = _model()
    save_universal(tmp_path, 0, model, _optimizer(model))
    other = _model()
    other_opt = _optimizer(other)
    _step(other, other_opt, 1)
    load_universal(tmp_path, other, other_opt)
    assert other_opt.state_dict()["state"] == {}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


def test_layout_of_picks_the_adapter() -> None:
    assert type(layout_of(nn.Linear(2, 2))) is PlainLayout
    assert DDPLayout.strategy == "ddp"


def test_ddp_two_ranks_and_one(rank_pool: Any, tmp_path: Path) -> None:
    model = _model()
    optimizer = _optimizer(model)
    for s in range(2):
        _step(model, optimizer, 50 + s)
    save_universal(tmp_path / "one", 4, model, optimizer)
    one = _snapshot(model, optimizer)

    out = rank_pool(2).run(_ddp_worker, tmp_path, timeout_s=120)
    saved = out[0]["saved"]
    assert_same(one, out[0]["one"])
    assert_same(one, out[1]["one"])
    assert_same(out[0]["saved"], out[1]["saved"])  # DDP: ranks equal
    ckpt = Path(out[0]["ckpt"])
    layout = read_manifest(ckpt).layout
    assert layout["strategy"] == "ddp" and layout["world_size"] == 2
    assert layout["keys"]["0.weight"] == {"shape": [6, 4], "dtype": "float32"}
    groups = layout["optimizer"]["param_groups"]
    assert groups[0]["keys"] == ["0.weight", "0.bias"] and groups[0]["hyper"]["lr"] == 0.1
    assert groups[1]["hyper"]["betas"] == [0.8, 0.95]
    # writes are spread: rank 1 writes the second half of every parameter (and of its
    # AdamW state: x3), rank 0 the first half and the buffers (13 elements)
    numel = []
    for r in range(2):
        with safe_open(str(ckpt / f"shard-{r}-of-2.safetensors"), framework="pt") as f:
            names = list(f.keys())
            numel.append(sum(f.get_slice(n).get_shape()[0] for n in names))
    assert numel == [(31 * 3) + 13, 32 * 3]
    # into one plain model (this process: 1 rank)
    plain = _model()
    plain_opt = _optimizer(plain, lr=(3.0, 3.0))
    loaded = load_universal(ckpt, plain, plain_opt)
    assert_same(saved, _snapshot(plain, plain_opt))
    assert loaded.extra(1)["rank"] == 1 and loaded.extra(0)["pos"] == [0, 3]
    plain2 = _model()
    plain2_opt = _optimizer(plain2, lr=(3.0, 3.0))
    loaded = load_universal(tmp_path / "plain", plain2, plain2_opt)
    assert (loaded.saved_world_size, loaded.saved_strategy) == (2, "plain")
    assert_same(one, _snapshot(plain2, plain2_opt))


def test_errors_agree_on_every_rank(rank_pool: Any, tmp_path: Path) -> None:
    out = rank_pool(2).run(_errors_worker, tmp_path, timeout_s=120)
    for rank in range(2):
        save, _, marker = out[rank]
        assert save.startswith("save: ") and "extra of rank 1 holds something other" in save
        assert marker == "marker: False"
    assert out[0][1].startswith("load: CheckpointError load: loading failed on rank 1: ")
    assert out[1][1].startswith("load: CheckpointUnsafeError unsafe: ")
    assert not (tmp_path / "ckpt-000001").exists()  # the failed save wrote nothing


class _Odd(nn.Module):
    """An empty parameter, a 0-dim one, a non-contiguous one and a transposed buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.empty = nn.Parameter(torch.randn(0, 3))
        self.scalar = nn.Parameter(torch.randn(()))
        self.strided = nn.Parameter(torch.randn(3, 2).t())
        self.register_buffer("table", torch.randn(2, 4).t())


def test_empty_scalar_and_strided_tensors(tmp_path: Path) -> None:
    """Regression: an empty parameter's Adam state (its step) was dropped on load, and
    the coverage check refused the empty tensor."""
    model = _Odd()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    (model.scalar * 3 + model.strided.square().sum() + model.empty.sum()).backward()
    optimizer.step()
    save_universal(tmp_path, 1, model, optimizer)
    fresh = _Odd()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    load_universal(tmp_path, fresh, fresh_opt)
    assert_same(_snapshot(model, optimizer), _snapshot(fresh, fresh_opt))
    assert not fresh.strided.is_contiguous()  # filled in place


def test_tensor_parallel_parts_into_a_plain_model(rank_pool: Any, tmp_path: Path) -> None:
    """Parts of 2 (stride 3) saved by 2 ranks load into the whole model in one process
    (the assemble-and-cut path), parameters and AdamW state; the strategy says tp2."""
    out = rank_pool(2).run(_tp_worker, tmp_path, timeout_s=120)
    model = _tp_full()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    loaded = load_universal(tmp_path, model, optimizer)
    assert loaded.saved_strategy == "plain+tp2"
    for rank in range(2):
        for name in ("1.weight", "1.bias"):
            value = model.state_dict()[name]
            assert torch.equal(shard(value, 0, rank, 2, stride=3), out[rank]["model"][name])
            param = dict(model.named_parameters())[name]
            for key in ("exp_avg", "exp_avg_sq"):
                mine = shard(optimizer.state[param][key], 0, rank, 2, stride=3)
                assert torch.equal(mine, out[rank]["state"][name][key]), (name, key)
        assert torch.equal(model.state_dict()["0.weight"], out[rank]["model"]["0.weight"])
    assert optimizer.param_groups[0]["lr"] == 0.1
