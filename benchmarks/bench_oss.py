"""OSS / ShardedDDP against torch DDP and ZeroRedundancyOptimizer: step time and bytes.

Run (2 ranks, gloo, one thread per rank)::

    python -m benchmarks.bench_oss                    # the ANCHORS.md GPT: 6 x 512, vocab 8192
    python -m benchmarks.bench_oss --n-layer 2 --steps 6 --rounds 2   # quick

Every configuration is built once on each rank; after one untimed warm-up step each,
``--rounds`` x ``--steps`` times, one step of each configuration runs in turn
(interleaved step by step, so that the load from other processes on a shared machine
falls on all of them alike). The order rotates from one step to the next, so that no
configuration always runs first. Besides each median, the ratio to the first
configuration is the median of per-step ratios against its step of the same rotation
(paired), which cancels slow drifts of the machine's load. A step is forward +
backward + ``optimizer.step()`` + ``zero_grad()``; its time is the slowest rank's.
Reported: median step time, the paired ratio to torch DDP, the model-state bytes each
rank holds after backward (:func:`shardkit.memory.model_state_bytes`) and gradient +
optimizer bytes over the ZeRO formula of the configuration's stage (fp32 AdamW). A Markdown table goes to stdout, the raw
numbers to ``benchmarks/results/bench_oss-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.common import ADAMW, RESULTS, add_gpt_args, gpt_config_from, slowest
from shardkit.memory import model_state_bytes, zero_memory_estimate
from shardkit.models import GPT
from shardkit.optim import OSS
from shardkit.testing import RankPool


@dataclass
class Setup:
    """One benchmarked configuration on this rank."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    model: nn.Module


def _ddp(model: GPT) -> Setup:
    return Setup(DDP(model), torch.optim.AdamW(model.parameters(), **ADAMW), model)


def _ddp_oss(model: GPT) -> Setup:
    return Setup(DDP(model), OSS(model.parameters(), optim=torch.optim.AdamW, **ADAMW), model)


def _ddp_zero(model: GPT) -> Setup:
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
    return Setup(DDP(model), opt, model)


def _sdp_oss(model: GPT) -> Setup:
    from shardkit.nn import ShardedDataParallel

    opt = OSS(model.parameters(), optim=torch.optim.AdamW, **ADAMW)
    return Setup(ShardedDataParallel(model, opt), opt, model)


# ZeRO stage of each configuration, for the per-rank formula (shardkit.memory).
STAGES = {
    "torch DDP + AdamW": 0,
    "DDP + OSS(AdamW)": 1,
    "DDP + ZeroRedundancyOptimizer(AdamW)": 1,
    "ShardedDDP + OSS(AdamW)": 2,
}

CONFIGS: dict[str, Callable[[GPT], Setup]] = {
    "torch DDP + AdamW": _ddp,
    "DDP + OSS(AdamW)": _ddp_oss,
    "DDP + ZeroRedundancyOptimizer(AdamW)": _ddp_zero,
    "ShardedDDP + OSS(AdamW)": _sdp_oss,
}


def _step(setup: Setup, x: torch.Tensor, y: torch.Tensor, measure: bool) -> dict[str, int]:
    _, loss = setup.module(x, targets=y)
    loss.backward()
    state = {}
    if measure:
        state = model_state_bytes(setup.model, None).as_dict()
    setup.optimizer.step()
    if measure:
        opt = setup.optimizer
        local = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt  # its shard
        state["optimizer_state"] = model_state_bytes(setup.model, local).optimizer_state
    setup.optimizer.zero_grad(set_to_none=True)
    return state


def _bench(args: dict[str, Any]) -> dict[str, Any]:
    """Body of each rank: build every configuration, run interleaved rounds."""
    cfg = gpt_config_from(args)
    rank = dist.get_rank()
    setups: dict[str, Setup] = {}
    for name in args["configs"]:
        torch.manual_seed(0)
        setups[name] = CONFIGS[name](GPT(cfg))
    gen = torch.Generator().manual_seed(rank)
    shape = (args["batch"], args["seq_len"])
    x = torch.randint(0, cfg.vocab_size, shape, generator=gen)
    y = torch.randint(0, cfg.vocab_size, shape, generator=gen)
    times: dict[str, list[float]] = {name: [] for name in setups}
    state: dict[str, dict[str, int]] = {}
    for name, setup in setups.items():
        state[name] = _step(setup, x, y, measure=True)  # warm-up (allocates the state)
    for round_index in range(args["rounds"]):
        for step in range(args["steps"]):
            names = list(setups)
            shift = (round_index * args["steps"] + step) % len(names)  # no fixed position
            for name in names[shift:] + names[:shift]:  # one step of each, in turn
                setup = setups[name]
                dist.barrier()
                start = time.perf_counter()
                _step(setup, x, y, measure=False)
                times[name].append(slowest(time.perf_counter() - start))
        if rank == 0:
            medians = {k: round(statistics.median(v), 3) for k, v in times.items()}
            print(f"round {round_index + 1}/{args['rounds']}: median s {medians}", flush=True)
    params = sum(p.numel() for p in next(iter(setups.values())).model.parameters())
    return {"times": times, "state": state, "params": params}


def _table(results: list[dict[str, Any]], configs: list[str]) -> tuple[str, dict[str, Any]]:
    base = statistics.median(results[0]["times"][configs[0]])
    mib, world, psi = 2**20, len(results), results[0]["params"]
    rows = [
        "| config | median step s | x first (paired) | params / grads / optimizer MiB per rank "
        "| (grads + optimizer) / ZeRO formula, worst rank |",
        "|---|---|---|---|---|",
    ]
    first = results[0]["times"][configs[0]]
    summary: dict[str, Any] = {}
    for name in configs:
        med = statistics.median(results[0]["times"][name])
        # paired: each step against the first config's step run just before it
        paired = statistics.median(t / f for t, f in zip(results[0]["times"][name], first))
        per_rank = [r["state"][name] for r in results]
        mem = " and ".join(
            f"{s['parameters'] / mib:.1f}/{s['gradients'] / mib:.1f}/{s['optimizer_state'] / mib:.1f}"
            for s in per_rank
        )
        formula = zero_memory_estimate(psi, world, STAGES[name], mixed_precision=False)
        expected = formula.gradients + formula.optimizer_state
        worst = max(s["gradients"] + s["optimizer_state"] for s in per_rank) / expected
        rows.append(f"| {name} | {med:.3f} | {paired:.3f} | {mem} | {worst:.3f} |")
        summary[name] = {
            "median_s": med,
            "ratio_of_medians": med / base,
            "paired_ratio": paired,
            "state_bytes": per_rank,
            "grads_plus_optimizer_over_formula": worst,
            "times_s": results[0]["times"][name],
        }
    return "\n".join(rows), summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add_gpt_args(p, steps=5, rounds=3)
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--world-size", type=int, default=2)
    args = vars(p.parse_args(argv))
    with RankPool(args["world_size"], timeout_s=3600.0) as pool:
        results = pool.run(_bench, args, timeout_s=3600.0)
    table, summary = _table(results, args["configs"])
    n = results[0]["params"]
    print(f"GPT {n / 1e6:.1f}M parameters, {args['world_size']} ranks (gloo, 1 thread each)")
    print(table)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"bench_oss-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": args, "params": n, "summary": summary}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
