"""Pipe across ranks: a 2-stage pipeline on 2 ranks against the same model in one process.

Run (gloo, one thread per rank)::

    python -m benchmarks.bench_pipe                      # GPT 8 x 256, batch 16 x 128 tokens
    python -m benchmarks.bench_pipe --n-layer 4 --steps 2 --rounds 1   # quick

The model is the main job's GPT as ``nn.Sequential(embed, *blocks, head)``
(``shardkit.models.gpt_stages``), split in two equal halves of blocks. One training step
(forward, loss, backward; no optimizer) on the same mini-batch runs

- in one process (rank 0 alone, the plain module, no micro-batches),
- in one process with the same ``m`` micro-batches by gradient accumulation (``1 process
  m=...``: what micro-batching alone costs -- smaller matrix products, one gradient
  accumulation and the per-operator overhead per micro-batch -- without a pipeline), and
- as a 2-stage pipeline on 2 ranks with ``m`` = 1, 4, 8, 16 micro-batches, under GPipe
  and 1F1B.

Configurations run interleaved for ``--rounds`` rounds of ``--steps`` timed steps
after one untimed warm-up each (load from other processes on a shared machine falls on
all of them alike); a step's time is the slowest rank's. Reported: median step time,
throughput relative to one process (theory ``p m / (m + p - 1)``), and the measured
bubble -- the share of the step each stage spends blocked in receives, averaged over
the stages -- against the fill-drain theory ``(p - 1) / (m + p - 1)``. Peak RSS per
stage is measured in fresh processes per schedule (``VmHWM``, so nothing else ran
in them before). A Markdown table goes to stdout and ``benchmarks/results/``, the raw
numbers to ``benchmarks/results/bench_pipe-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.common import MIB, RESULTS, peak_rss_bytes, status_bytes
from shardkit.models import GPT, GPTConfig, gpt_stages
from shardkit.nn.pipe import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    bubble_fraction,
    stage_module,
)
from shardkit.testing import RankPool, run_distributed

SCHEDULES: dict[str, type[ScheduleGPipe] | type[Schedule1F1B]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
}
STAGES = 2


def _model(args: dict[str, Any]) -> tuple[nn.Sequential, list[int]]:
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=256,
        block_size=args["seq_len"],
        n_layer=args["n_layer"],
        n_head=4,
        n_embd=args["n_embd"],
    )
    half = args["n_layer"] // 2
    return gpt_stages(GPT(config)), [1 + half, args["n_layer"] - half + 1]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over ``(B, T, V)`` logits and ``(B, T)`` targets."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batch(args: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = (args["batch_size"], args["seq_len"])
    return torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g)


def _reduce(wall_s: float, cpu_s: float, wait_s: float) -> tuple[float, float, float]:
    """(slowest rank's wall seconds, CPU seconds of all ranks, mean waiting share)."""
    t = torch.tensor([wall_s], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    wall = float(t.item())
    sums = torch.tensor([cpu_s, wait_s / wall], dtype=torch.float64)
    dist.all_reduce(sums)
    return wall, float(sums[0]), float(sums[1]) / STAGES


def _one_process_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int = 1
) -> tuple[float, float, float]:
    """Rank 0 runs the plain model (``chunks`` micro-batches accumulated) while rank 1
    waits (it uses no CPU in a barrier)."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    if dist.get_rank() == 0:
        model.zero_grad(set_to_none=True)
        for xs, ys in zip(x.tensor_split(chunks), y.tensor_split(chunks)):
            (lm_loss(model(xs), ys) * (len(xs) / len(x))).backward()
    busy = dist.get_rank() == 0
    wall_s = time.perf_counter() - start if busy else 0.0
    return _reduce(wall_s, time.process_time() - cpu if busy else 0.0, 0.0)


def _pipe_step(runner: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
    """One pipeline step: (wall s, CPU s of all ranks, mean over stages of the waiting share)."""
    stage: PipelineStage = runner.stage
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    stage.module.zero_grad(set_to_none=True)
    runner.step(x if stage.is_first else None, target=y if stage.is_last else None)
    return _reduce(time.perf_counter() - start, time.process_time() - cpu, stage.wait_s)


def _bench(args: dict[str, Any]) -> dict[str, Any]:
    """On each of 2 ranks: interleaved timing of one process and every (schedule, m)."""
    full, balance = _model(args)
    part = stage_module(full, balance, dist.get_rank())
    stage = PipelineStage(part)
    runners = {
        f"{name} m={m}": cls(stage, m, loss_fn=lm_loss)
        for m in args["chunks"]
        for name, cls in SCHEDULES.items()
    }
    x, y = _batch(args)
    accumulate = {f"1 process m={m}": m for m in args["chunks"] if m > 1}
    keys = ["one process", *accumulate, *runners]
    times: dict[str, list[float]] = {k: [] for k in keys}
    cpus: dict[str, list[float]] = {k: [] for k in keys}
    waits: dict[str, list[float]] = {k: [] for k in keys}
    for rnd in range(args["rounds"]):
        for n in range(args["steps"] + (1 if rnd == 0 else 0)):
            for key in keys:
                if key == "one process" or key in accumulate:
                    wall, cpu, share = _one_process_step(full, x, y, accumulate.get(key, 1))
                else:
                    wall, cpu, share = _pipe_step(runners[key], x, y)
                if not (rnd == 0 and n == 0):  # the first round's first step warms up
                    times[key].append(wall)
                    cpus[key].append(cpu)
                    waits[key].append(share)
    params = sum(p.numel() for p in full.parameters())
    return {"times": times, "cpu": cpus, "waits": waits, "params": params}


def _peak_rss(args: dict[str, Any], schedule: str | None) -> dict[str, float]:
    """In a fresh process: RSS before and peak RSS after steps (MiB); ``None``: one process."""
    full, balance = _model(args)
    x, y = _batch(args)
    before = _rss_now_mib()
    for _ in range(2):
        if schedule is None:
            full.zero_grad(set_to_none=True)
            lm_loss(full(x), y).backward()
        else:
            stage = PipelineStage(stage_module(full, balance, dist.get_rank()))
            runner = SCHEDULES[schedule](stage, args["rss_chunks"], loss_fn=lm_loss)
            stage.module.zero_grad(set_to_none=True)
            runner.step(x if stage.is_first else None, target=y if stage.is_last else None)
    return {"before_mib": before, "peak_mib": peak_rss_bytes() / MIB}


def _rss_now_mib() -> float:
    return status_bytes("VmRSS") / MIB


def _tables(
    bench: dict[str, Any], rss: dict[str, list[dict[str, float]]], args: dict[str, Any]
) -> str:
    base = statistics.median(bench["times"]["one process"])
    lines = [
        f"GPT {args['n_layer']} x {args['n_embd']} ({bench['params'] / 1e6:.2f}M params), batch "
        f"{args['batch_size']} x {args['seq_len']} tokens, {STAGES} stages on {STAGES} ranks (gloo, 1 thread "
        f"each) vs 1 process (1 thread); forward + backward; medians of {len(bench['times']['one process'])} steps",
        "",
        "| config | step s | throughput vs 1 process | theory | bubble measured | bubble theory "
        "| cores busy | CPU s vs 1 process | estimate on 2 free cores |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base_cpu = statistics.median(bench["cpu"]["one process"])
    for key in bench["times"]:
        med = statistics.median(bench["times"][key])
        cpu = statistics.median(bench["cpu"][key])
        cores = statistics.median(c / t for c, t in zip(bench["cpu"][key], bench["times"][key]))
        if key == "one process" or key.startswith("1 process"):
            theory, bubble, bubble_theory, estimate = "1.00", "-", "-", "-"
        else:
            m = int(key.split("m=")[1])
            theory = f"{STAGES * m / (m + STAGES - 1):.2f}"
            bubble = f"{statistics.median(bench['waits'][key]):.2f}"
            bubble_theory = f"{bubble_fraction(STAGES, m):.2f}"
            estimate = f"{STAGES * (1 - bubble_fraction(STAGES, m)) * base_cpu / cpu:.2f}"
        lines.append(
            f"| {key} | {med:.3f} | {base / med:.2f} | {theory} | {bubble} | {bubble_theory} "
            f"| {cores:.2f} | {cpu / base_cpu:.2f} | {estimate} |"
        )
    lines += [
        "",
        "step s: median wall seconds of a step (slowest rank). cores busy: CPU seconds of all "
        "ranks / wall seconds (2.00 at most for the pipeline, 1.00 for one process; below "
        "that, other processes on the machine took the cores). CPU s vs 1 process: the "
        "total CPU work relative to the plain step (micro-batching and send/recv "
        "overhead); the `1 process m=...` rows give the share of micro-batching alone "
        "(gradient accumulation in one process). estimate on 2 free cores: p (1 - bubble theory) / (CPU s vs 1 process), "
        "what the step times would give if each rank had a core of its own (a model, not a "
        "measurement; use it when cores busy shows the machine was shared).",
    ]
    lines += [
        "",
        f"Peak RSS (MiB, fresh processes, m = {args['rss_chunks']}; before the steps in brackets)",
        "",
        "| config | " + " | ".join(f"rank {r}" for r in range(STAGES)) + " |",
        "|---|" + "---|" * STAGES,
    ]
    for name, ranks in rss.items():
        cells = " | ".join(f"{r['peak_mib']:.0f} ({r['before_mib']:.0f})" for r in ranks)
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--rss-chunks", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument(
        "--table", type=Path, default=None, help="re-render the tables of a results JSON"
    )
    args = vars(p.parse_args(argv))
    if args["table"] is not None:
        saved = json.loads(args["table"].read_text())
        print(_tables(saved["bench"], saved["rss"], saved["args"]))
        return
    args.pop("table")
    with RankPool(STAGES, timeout_s=3600.0) as pool:
        bench = pool.run(_bench, args, timeout_s=3600.0)[0]
    rss = {"one process": run_distributed(_peak_rss, 1, args, None, timeout_s=600.0)}
    for name in SCHEDULES:
        rss[name] = run_distributed(_peak_rss, STAGES, args, name, timeout_s=600.0)
    table = _tables(bench, rss, args)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (RESULTS / f"bench_pipe-{stamp}.md").write_text(table + "\n")
    out = RESULTS / f"bench_pipe-{stamp}.json"
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    out.write_text(
        json.dumps({"args": args, "bench": bench, "rss": rss, "loadavg_end": load}, indent=1)
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
