"""shardkit FSDP against torch DDP and torch FSDP2 ``fully_shard``: time, RSS, bytes.

Run (2 ranks, gloo, one thread per rank)::

    python -m benchmarks.bench_fsdp                       # the ANCHORS.md GPT: 6 x 512, vocab 8192
    python -m benchmarks.bench_fsdp --n-layer 2 --n-embd 256 --steps 4   # quick

Each configuration runs in freshly spawned ranks (so the peak RSS, read with
``resource.getrusage(RUSAGE_SELF).ru_maxrss`` in each rank, is that configuration's
alone): one untimed warm-up step, then ``--steps`` timed steps (forward, backward,
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
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.memory import model_state_bytes, zero_memory_estimate
from shardkit.testing import run_distributed
from shardkit.testing.models import GPT, Block, GPTConfig

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = ["torch DDP", "torch FSDP2 fully_shard", "shardkit FSDP"]
ADAMW: dict[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.01}


def _build(name: str, model: GPT) -> nn.Module:
    if name == "torch DDP":
        return nn.parallel.DistributedDataParallel(model)
    if name == "torch FSDP2 fully_shard":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
    from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy

    with enable_wrap(wrapper_cls=FSDP):
        wrapped = auto_wrap(model, transformer_auto_wrap_policy({Block}))
    return FSDP(wrapped)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _bench_one(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """One configuration on this rank, in a fresh process."""
    rss_start = _rss_mib()
    cfg = GPTConfig(
        vocab_size=args["vocab"],
        block_size=args["seq_len"],
        n_layer=args["n_layer"],
        n_head=args["n_head"],
        n_embd=args["n_embd"],
    )
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
            state = _state_bytes(model, opt)
        opt.zero_grad()
        elapsed = _slowest(time.perf_counter() - start)
        if step > 0:
            times.append(elapsed)
    return {
        "times": times,
        "state": state,
        "rss_mib": _rss_mib(),
        "rss_start_mib": rss_start,
        "params": params,
    }


def _state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    holder = nn.Module()
    holder.params = nn.ParameterList([nn.Parameter(t, requires_grad=False) for t in local])
    for mine, p in zip(holder.params, model.parameters()):
        if p.grad is not None:
            grad = p.grad
            mine.grad = grad.to_local() if hasattr(grad, "to_local") else grad
    measured = model_state_bytes(holder).as_dict()
    opt_tensors = [
        v.to_local() if hasattr(v, "to_local") else v
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]
    seen, total = set(), 0
    for t in opt_tensors:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += key[1]
    measured["optimizer_state"] = total
    return measured


def _table(runs: dict[str, list[dict[str, Any]]], world: int) -> tuple[str, dict[str, Any]]:
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
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=2)
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
