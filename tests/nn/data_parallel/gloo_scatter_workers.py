"""Rank-side workers of test_fsdp_gloo_scatter_edges (top level: pickled to spawned ranks).

Each config trains an FSDP model and the plain model on the same global batch, step by
step, and reports the largest difference of the loss and of the full parameters after
every optimizer step (SGD with momentum; the plain model's update per step is ~1e-2, so
a misrouted or missing chunk shows far above fp32 rounding)."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.failures import CollectiveError
from shardkit.nn.data_parallel.fully_sharded import MixedPrecision, collectives
from tests.nn.data_parallel.fsdp_workers import LOCAL_BATCH, global_batch, tiny_gpt, wrap_model

STEPS = 3


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _max_diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert got.keys() == ref.keys(), (sorted(got), sorted(ref))
    return max(float((got[k].float() - ref[k].float()).abs().max()) for k in ref)


def _user_exchange(
    dp: list[int], step: int, group: Any = None
) -> tuple[list[Any], torch.Tensor, torch.Tensor]:
    """A pipeline-ish exchange with the default tag 0: send to the next rank of ``dp``,
    receive from the previous one; left in flight across FSDP's backward."""
    me = dp.index(dist.get_rank())
    nxt, prv = dp[(me + 1) % len(dp)], dp[(me - 1) % len(dp)]
    out = torch.full((37,), float(1000 * step + dist.get_rank()))
    box = torch.full((37,), float("nan"))
    works = [dist.isend(out, dst=nxt, group=group), dist.irecv(box, src=prv, group=group)]
    return works, box, torch.full((37,), float(1000 * step + prv))


def train(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg``: dp (global ranks doing FSDP, default all), group (a process group or a
    (shard, replicate) pair), nesting, kwargs (FSDP's), micro (micro-batches, all but
    the last under no_sync), freeze (a prefix of parameters to freeze), unused (adds
    a parameter the forward never uses), exchange (user isend/irecv around backward)."""
    dp = cfg.get("dp") or list(range(dist.get_world_size()))
    rank = dist.get_rank()
    out: dict[str, Any] = {"loss": [], "param": [], "exchange_ok": True}
    ref = tiny_gpt()
    if cfg.get("unused"):
        ref.unused = nn.Linear(3, 5)
    for name, p in ref.named_parameters():
        if cfg.get("freeze") and name.startswith(cfg["freeze"]):
            p.requires_grad_(False)
    if rank not in dp:
        return out
    kwargs = dict(cfg.get("kwargs", {}))
    if "group" in cfg:
        kwargs["process_group"] = cfg["group"]
    model = wrap_model(copy.deepcopy(ref), cfg.get("nesting", "block"), **kwargs)
    opt = _sgd([p for p in model.parameters() if p.requires_grad])
    ref_opt = _sgd([p for p in ref.parameters() if p.requires_grad])
    micro, me = cfg.get("micro", 1), dp.index(rank)
    if cfg.get("bf16_bound"):
        out["bound"] = _bf16_bound(ref, len(dp))
    for step in range(STEPS):
        ref_loss = model_loss = 0.0
        pending: list[Any] = []
        for m in range(micro):
            x, y = global_batch(step * micro + m, len(dp))
            loss = ref(x, y)[1] / micro
            loss.backward()
            ref_loss += float(loss)
            part = slice(me * LOCAL_BATCH, (me + 1) * LOCAL_BATCH)
            local = model(x[part], y[part])[1] / micro
            if cfg.get("exchange"):
                on = cfg.get("group") if cfg["exchange"] == "fsdp-group" else None
                pending.append(_user_exchange(dp, step * micro + m, on))
            if m < micro - 1 and not cfg.get("sync_every"):
                with model.no_sync():
                    local.backward()
            else:
                local.backward()
            model_loss += float(local)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        for works, box, expected in pending:
            for w in works:
                w.wait()
            out["exchange_ok"] &= torch.equal(box, expected)
        mean = torch.tensor([model_loss / len(dp)], dtype=torch.float64)
        group = cfg.get("group")
        world_group = group[0] if isinstance(group, tuple) else group
        if isinstance(group, tuple):  # the global batch spans every rank
            world_group = None
        dist.all_reduce(mean, group=world_group)
        out["loss"].append(abs(float(mean) - ref_loss))
        out["param"].append(_max_diff(model.state_dict(), ref.state_dict()))
    if cfg.get("unused"):
        full = model.state_dict()
        out["unused_unchanged"] = torch.equal(full["unused.weight"], ref.unused.weight)
    return out


def _bf16_bound(ref: nn.Module, world: int) -> float:
    """Step 1's largest parameter error a bf16 reduction may leave: lr times 4 bf16
    half-ulps (2^-9 each: the casts, the sum, the division) of sum_r |g_r| / world, the
    per-rank gradients of the plain model (SGD's first step is -lr * g)."""
    total: dict[str, torch.Tensor] = {}
    x, y = global_batch(0, world)
    for r in range(world):
        probe = copy.deepcopy(ref)
        part = slice(r * LOCAL_BATCH, (r + 1) * LOCAL_BATCH)
        probe(x[part], y[part])[1].backward()
        for name, p in probe.named_parameters():
            if p.grad is not None:
                total[name] = total.get(name, 0) + p.grad.abs() / world
    return 0.1 * 4 * 2.0**-9 * max(float(t.max()) for t in total.values())


def _groups_4() -> dict[str, Any]:
    """Shard groups {0, 2} and {1, 3} (global ranks not 0..k-1, listed high first),
    replicas {0, 1}, {2, 3}; every rank creates every group in the same order."""
    shard = [dist.new_group([2, 0]), dist.new_group([3, 1])]
    repl = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    rank = dist.get_rank()
    return {"pair": (shard[rank % 2], repl[rank // 2])}


# the configs run at 3 and 4 ranks (2 ranks run all): the 2-core machine is slow at 4
KEEP = {
    3: {"block", "size-nosync", "frozen-unused", "exchange-tag0", "bf16-reduce-huge"}
    | {"subgroup-1-2", "subgroup-1-2-exchange"},
    4: {"block-huge-bucket", "exchange-tag0", "bf16-reduce-tiny", "hybrid-odd-groups"}
    | {"hybrid-odd-groups-nosync-exchange", "hybrid-odd-groups-sync-every", "reshard-2-huge"},
}


def grid(world: int) -> dict[str, Any]:
    """Every config of one world size; keys name the config."""
    bf16 = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.bfloat16)
    cfgs: dict[str, dict[str, Any]] = {
        "block": {},
        "block-tiny-bucket": {"kwargs": {"bucket_cap_mb": 1e-6}},
        "block-huge-bucket": {"kwargs": {"bucket_cap_mb": 1e4}},
        "size-nosync": {"nesting": "size", "micro": 3},
        "frozen-block0": {"freeze": "blocks.0."},
        "frozen-unused": {"freeze": "wpe", "unused": True},
        "exchange-tag0": {"exchange": True, "micro": 2},
        "exchange-tag0-sync-every": {"exchange": True, "micro": 2, "sync_every": True},
        "bf16-reduce-tiny": {
            "kwargs": {"mixed_precision": bf16, "bucket_cap_mb": 1e-6},
            "bf16_bound": True,
        },
        "bf16-reduce-huge": {
            "kwargs": {"mixed_precision": bf16, "bucket_cap_mb": 1e4},
            "bf16_bound": True,
        },
    }
    if world == 4:
        pair = _groups_4()["pair"]
        hybrid = {"group": pair, "kwargs": {"sharding_strategy": "HYBRID_SHARD"}}
        cfgs["hybrid-odd-groups"] = hybrid
        cfgs["hybrid-odd-groups-nosync-exchange"] = {**hybrid, "micro": 2, "exchange": True}
        cfgs["hybrid-odd-groups-sync-every"] = {**hybrid, "micro": 2, "sync_every": True}
        cfgs["reshard-2"] = {"kwargs": {"reshard_after_forward": 2}}
        cfgs["reshard-2-huge"] = {"kwargs": {"reshard_after_forward": 2, "bucket_cap_mb": 1e4}}
    if world == 3:
        sub = dist.new_group([1, 2])
        cfgs["subgroup-1-2"] = {"dp": [1, 2], "group": sub}
        cfgs["subgroup-1-2-exchange"] = {
            "dp": [1, 2],
            "group": sub,
            "exchange": "fsdp-group",
            "micro": 2,
        }
    keep = KEEP.get(world)
    cfgs = {k: v for k, v in cfgs.items() if keep is None or k in keep}
    calls = {"scatter_sends": 0, "native": 0}
    real_isend, real_native = dist.isend, dist.reduce_scatter_single

    def isend(*args: Any, **kwargs: Any) -> Any:
        calls["scatter_sends"] += kwargs.get("tag") == collectives._SCATTER_TAG
        return real_isend(*args, **kwargs)

    def native(*args: Any, **kwargs: Any) -> Any:
        calls["native"] += 1
        return real_native(*args, **kwargs)

    dist.isend, dist.reduce_scatter_single = isend, native
    try:
        out: dict[str, Any] = {key: train(cfg) for key, cfg in cfgs.items()}
        out["two-roots"] = two_roots()
    finally:
        dist.isend, dist.reduce_scatter_single = real_isend, real_native
    return {"results": out, "calls": calls}


def two_roots() -> dict[str, Any]:
    """Two separately wrapped models (different seeds) trained alternately."""
    rank, world = dist.get_rank(), dist.get_world_size()
    refs = [tiny_gpt(0), tiny_gpt(1)]
    models = [wrap_model(copy.deepcopy(r), "block", bucket_cap_mb=1e4) for r in refs]
    opts = [_sgd(m.parameters()) for m in models] + [_sgd(r.parameters()) for r in refs]
    diffs = []
    for step in range(STEPS):
        for i in (0, 1):
            x, y = global_batch(10 * step + i, world)
            refs[i](x, y)[1].backward()
            part = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
            models[i](x[part], y[part])[1].backward()
        for o in opts:
            o.step()
            o.zero_grad()
        diffs.append(max(_max_diff(m.state_dict(), r.state_dict()) for m, r in zip(models, refs)))
    return {"loss": [0.0], "param": diffs, "exchange_ok": True}


def skipped_backward() -> dict[str, Any]:
    """Rank 1 skips a backward on a 3 s group: rank 0's must end in a CollectiveError
    naming the reduce-scatter, well before a hang; returns the message and the seconds."""
    import time

    group = dist.new_group([0, 1], timeout=timedelta(seconds=3))
    # reshard_after_forward=False: the backward's first collective is a reduce-scatter
    model = wrap_model(
        copy.deepcopy(tiny_gpt()), "block", process_group=group, reshard_after_forward=False
    )
    x, y = global_batch(0, 2)
    part = slice(dist.get_rank() * LOCAL_BATCH, (dist.get_rank() + 1) * LOCAL_BATCH)
    loss = model(x[part], y[part])[1]
    dist.barrier()
    outcome, start = "ok", time.monotonic()
    if dist.get_rank() == 0:
        try:
            loss.backward()
        except CollectiveError as err:
            outcome = f"{type(err).__name__}: {err}"
        except Exception as err:  # reported to the test
            outcome = f"OTHER {type(err).__name__}: {err}"
    elapsed = time.monotonic() - start
    dist.barrier()  # the world group: rank 1 waits here for rank 0's timeout
    return {"outcome": outcome, "seconds": elapsed}
