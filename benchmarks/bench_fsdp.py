"""shardkit FSDP against torch DDP and torch FSDP2 ``fully_shard``: time, RSS, bytes.

Run (2 ranks, gloo, one thread per rank)::

    python -m benchmarks.bench_fsdp                       # the ANCHORS.md GPT: 6 x 512, vocab 8192
    python -m benchmarks.bench_fsdp --n-layer 2 --n-embd 256 --steps 4   # quick

Each configuration runs in freshly spawned ranks (so the peak RSS, ``VmHWM`` of each
rank's process, is that configuration's alone): one untimed warm-up step, then ``--steps`` timed steps (forward, backward,
``optimizer.step()``, ``zero_grad()``; a step's time is the slowest rank's). The
configurations are run ``--rounds`` times in turn and the median over all steps is
reported, so that load from other processes falls on all of them alike. Model-state
bytes per rank are measured after a step, before ``zero_grad``
(:func:`shardkit.memory.model_state_bytes`). Markdown to stdout, JSON to
``benchmarks/results/bench_fsdp-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import (
    ADAMW,
    MIB,
    RESULTS,
    add_gpt_args,
    build_shardkit_fsdp,
    build_torch_fsdp2,
    gpt_config_from,
    local_state_bytes,
    peak_rss_bytes,
    slowest,
)
from shardkit.memory import zero_memory_estimate
from shardkit.models import GPT
from shardkit.testing import run_distributed

CONFIGS = ["torch DDP", "torch FSDP2 fully_shard", "shardkit FSDP"]


def _build(name: str, model: GPT) -> nn.Module:
    if name == "torch DDP":
        return nn.parallel.DistributedDataParallel(model)
    if name == "torch FSDP2 fully_shard":
        return build_torch_fsdp2(model)
    return build_shardkit_fsdp(model)


def _rss_mib() -> float:
    return peak_rss_bytes() / MIB


def _bench_one(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """One configuration on this rank, in a fresh process."""
    rss_start = _rss_mib()
    cfg = gpt_config_from(args)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    params = gpt.num_parameters()
    model = _build(name, gpt)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, cfg.vocab_size, (args["batch"], args["seq_len"]), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (args["batch"], args["seq_len"]), generator=gen)
    times, state = [], {}
    for step in range(args["steps"] + 1):
        dist.barrier()
        start = time.perf_counter()
        model(x, y)[1].backward()
        opt.step()
        if step == 0:
            state = local_state_bytes(model, opt.state)
        opt.zero_grad()
        elapsed = slowest(time.perf_counter() - start)
        if step > 0:
            times.append(elapsed)
    return {
        "times": times,
        "state": state,
        "rss_mib": _rss_mib(),
        "rss_start_mib": rss_start,
        "params": params,
    }


def _table(runs: dict[str, list[list[dict[str, Any]]]], world: int) -> tuple[str, dict[str, Any]]:
    """``runs[config][round][rank]``: one rank's result of one round."""
    mib = 2**20
    med = {
        n: statistics.median([t for rank0 in r for t in rank0[0]["times"]]) for n, r in runs.items()
    }
    base = med[CONFIGS[0]]
    psi = runs[CONFIGS[0]][0][0]["params"]
    rows = [
        "| config | median step s | x DDP | params / grads / optimizer MiB per rank | peak RSS MiB per rank |",
        "|---|---|---|---|---|",
    ]
    summary: dict[str, Any] = {}
    for name, rounds in runs.items():
        ranks = rounds[-1]
        s = ranks[0]["state"]
        rss = [max(rd[r]["rss_mib"] for rd in rounds) for r in range(world)]
        rows.append(
            f"| {name} | {med[name]:.3f} | {med[name] / base:.2f} | "
            f"{s['parameters'] / mib:.0f} / {s['gradients'] / mib:.0f} / {s['optimizer_state'] / mib:.0f} | "
            + " / ".join(f"{v:.0f}" for v in rss)
            + " |"
        )
        summary[name] = {
            "median_s": med[name],
            "x_ddp": med[name] / base,
            "state": s,
            "peak_rss_mib": rss,
        }
    z3 = zero_memory_estimate(psi, world, 3, mixed_precision=False)
    rows.append(
        f"\nZeRO-3 formula (fp32 AdamW, psi={psi:,}, N={world}): {z3.total / mib:.0f} MiB per rank"
    )
    return "\n".join(rows), summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_gpt_args(parser, steps=5, rounds=2)
    parser.add_argument("--world-size", type=int, default=2)
    args = vars(parser.parse_args())
    runs: dict[str, list[Any]] = {name: [] for name in CONFIGS}
    for round_index in range(args["rounds"]):
        for name in CONFIGS:
            runs[name].append(
                run_distributed(_bench_one, args["world_size"], name, args, timeout_s=1800)
            )
            print(
                f"round {round_index + 1}: {name}: {statistics.median(runs[name][-1][0]['times']):.3f} s",
                flush=True,
            )
    table, summary = _table(runs, args["world_size"])
    print(table)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"bench_fsdp-{time.strftime('%Y%m%d-%H%M%S')}.json"
    load = os.getloadavg()
    out.write_text(
        json.dumps(
            {"args": args, "summary": summary, "loadavg": load, "runs": runs},
            indent=1,
            default=float,
        )
    )
    print(f"\nload average {load}; raw numbers: {out}")


if __name__ == "__main__":
    main()
