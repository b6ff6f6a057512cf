"""Mixture of experts side by side: shardkit ``MoE`` at ep = 1, 2, 4 and ep 2 x tp 2,
shardkit's and (where installed) FairScale's ``MOELayer``, DeepSpeed's ``MoE`` (where
installed; on CPU ranks), and the dense MLP with the same active parameters per token.

Run (gloo, one thread per rank)::

    python -m benchmarks.moe                      # 2 and 4 ranks
    python -m benchmarks.moe --worlds 2 --tokens 64 --steps 2 --rounds 1   # quick

Each (world, configuration) runs in freshly spawned ranks, so the peak RSS (``VmHWM``
of each rank's process) is that configuration's alone. A step is forward, backward and
the gradient reduction (dense over all ranks by DDP, experts averaged over ``edp``);
its time is the slowest rank's; tokens/s is ``dp x tokens / median step`` (``dp`` the
ranks with their own tokens: the world, or world / tp when the tensor-parallel ranks
share theirs). For shardkit ``MoE`` the all-to-all bytes counted by the layer are
reported against the formula ``tokens x k x hidden x 4`` (each way; equal when no token
is dropped: at capacity factor 1 the layer drops the choices over an expert's capacity,
so the counted bytes are the kept share of the formula).

Rounds are paired: each round runs every configuration once, and the ``x FairScale``
ratios are per round (the same round's FairScale row), then the median over rounds.
Besides, ``--pairs`` steps of shardkit's and FairScale's ``MOELayer`` alternate in the
same ranks (the order flipped every step), which cancels the load of a shared machine
better than separate spawns: the median of the per-step time ratios is reported.
Markdown to stdout, JSON to ``benchmarks/results/moe-<time>.json``, both written as
each configuration finishes (a long run cut short keeps its rows).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import MIB, RESULTS, peak_rss_bytes, slowest
from benchmarks.runners import deepspeed_on_cpu
from shardkit.distributed.mesh import ParallelDims, ProcessMesh
from shardkit.extras import require
from shardkit.nn import MOELayer, Top2Gate
from shardkit.nn.moe import (
    MoE,
    all_reduce_expert_gradients,
    expert_parameters,
    ignore_experts_in_ddp,
)
from shardkit.testing import run_distributed


class _Residual(nn.Module):
    """``x + layer(x)``, for a layer returning a tensor or MoE's tuple."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        return x + (out[0] if isinstance(out, tuple) else out)


FAIRSCALE = "fairscale MOELayer"
DEEPSPEED = "deepspeed MoE ep=world"
EP_TP = "shardkit MoE ep=2 x tp=2"


def _configs(world: int, have_fairscale: bool, have_deepspeed: bool) -> list[str]:
    names = ["dense (same active parameters)", "shardkit MOELayer (FairScale's)"]
    if have_fairscale:
        names.append(FAIRSCALE)
    if have_deepspeed:
        names.append(DEEPSPEED)
    names += [f"shardkit MoE ep={ep}" for ep in (1, 2, 4) if ep <= world]
    return names + ([EP_TP] if world >= 4 and world % 4 == 0 else [])


def _mesh(name: str, world: int) -> ProcessMesh:
    if name == EP_TP:
        return ProcessMesh(ParallelDims(world_size=world, ep=2, tp=2))
    if name.startswith("shardkit MoE"):
        ep = int(name.rsplit("=", 1)[1])
    else:  # MOELayer and DeepSpeed split the experts over the world; dense has none
        ep = 1 if name.startswith("dense") else world
    return ProcessMesh(ParallelDims(world_size=world, ep=ep))


def _deepspeed_moe(args: argparse.Namespace, world: int) -> nn.Module:
    """DeepSpeed's ``MoE`` (top-k gate, capacity factor 1, experts over the world)."""
    deepspeed_on_cpu()
    deepspeed = require("deepspeed", "benchmarks.moe's DeepSpeed row", "pip install deepspeed")
    layer = require(
        "deepspeed.moe.layer", "benchmarks.moe's DeepSpeed row", "pip install deepspeed"
    )
    deepspeed.init_distributed(dist_backend="gloo")
    expert = nn.Sequential(
        nn.Linear(args.hidden, args.ffn), nn.GELU(), nn.Linear(args.ffn, args.hidden)
    )
    return layer.MoE(  # type: ignore[no-any-return]
        args.hidden, expert, args.experts, ep_size=world, k=args.k, min_capacity=0
    )


def _build(name: str, args: argparse.Namespace, mesh: ProcessMesh) -> nn.Module:
    m, f, e, world = args.hidden, args.ffn, args.experts, mesh.dims.world_size
    if name.startswith("dense"):
        return nn.Sequential(nn.Linear(m, args.k * f), nn.GELU(), nn.Linear(args.k * f, m))
    if name.startswith("shardkit MoE"):
        tp = mesh.group("tp") if mesh.dims.tp > 1 else None
        return MoE(m, f, e, k=args.k, min_capacity=0, ep_group=mesh.group("ep"), tp_group=tp)
    if name == DEEPSPEED:
        return _deepspeed_moe(args, world)
    local = nn.ModuleList(
        nn.Sequential(nn.Linear(m, f), nn.GELU(), nn.Linear(f, m)) for _ in range(e // world)
    )
    if name.startswith("fairscale"):
        fairscale_nn = require(
            "fairscale.nn", "benchmarks.moe's FairScale row", "pip install fairscale==0.4.13"
        )
        return fairscale_nn.MOELayer(fairscale_nn.Top2Gate(m, e), local)  # type: ignore[no-any-return]
    return MOELayer(Top2Gate(m, e), local)


def run_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """On every rank: build ``name``, time ``args.steps`` steps after one warm-up."""
    world = dist.get_world_size()
    mesh = _mesh(name, world)
    torch.manual_seed(0)
    layer = _build(name, args, mesh)
    model = _Residual(layer)
    for p in model.parameters():  # DeepSpeed marks its experts allreduce=False
        p.expert = getattr(p, "expert", False) or not getattr(p, "allreduce", True)  # type: ignore[attr-defined]
    ignore_experts_in_ddp(model)
    ddp = DistributedDataParallel(model, process_group=mesh.group("dp"))
    torch.manual_seed(1 + mesh.local_rank("dp"))  # the tp ranks share their tokens
    x = torch.randn(args.tokens // 8, 8, args.hidden)
    times = []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        ddp(x).square().mean().backward()
        all_reduce_expert_gradients(model, mesh.group("edp"))  # one rank: a no-op
        elapsed = slowest(time.perf_counter() - start)
        if step:
            times.append(elapsed)
        model.zero_grad(set_to_none=True)
    row: dict[str, Any] = {
        "config": name,
        "world": world,
        "step_s": statistics.median(times),
        "tokens_per_s": mesh.dims.dp * args.tokens / statistics.median(times),
        "expert_bytes": sum(p.numel() * 4 for p in expert_parameters(model).values()),
        "peak_rss_mib": slowest(peak_rss_bytes() / MIB),
    }
    if isinstance(layer, MoE) and layer.last_routing is not None:
        row["bytes"] = dict(layer.last_all_to_all_bytes)
        row["kept_bytes"] = int(layer.last_routing.kept.sum()) * args.hidden * 4
        row["formula_bytes"] = args.tokens * args.k * args.hidden * 4 if mesh.dims.ep > 1 else 0
    mesh.destroy()
    return row


def run_pair(args: argparse.Namespace) -> dict[str, Any]:
    """On every rank: shardkit's and FairScale's ``MOELayer`` (the same weights) step
    by step in the same ranks, the order flipped every step; the slowest rank's time."""
    fairscale_nn = require("fairscale.nn", "benchmarks.moe --pairs", "pip install fairscale")
    world = dist.get_world_size()
    m, f, e = args.hidden, args.ffn, args.experts

    def layer(gate_class: Any, moe_class: Any) -> nn.Module:
        torch.manual_seed(0)
        gate = gate_class(m, e)
        local = nn.ModuleList(
            nn.Sequential(nn.Linear(m, f), nn.GELU(), nn.Linear(f, m)) for _ in range(e // world)
        )
        return _Residual(moe_class(gate, local))  # type: ignore[no-any-return]

    layers = {
        "shardkit": layer(Top2Gate, MOELayer),
        "fairscale": layer(fairscale_nn.Top2Gate, fairscale_nn.MOELayer),
    }
    x = torch.randn(args.tokens // 8, 8, args.hidden)
    times: dict[str, list[float]] = {name: [] for name in layers}
    for step in range(args.pairs + 1):
        order = list(layers) if step % 2 else list(layers)[::-1]
        for name in order:
            start = time.perf_counter()
            layers[name](x).square().mean().backward()
            elapsed = slowest(time.perf_counter() - start)
            if step:
                times[name].append(elapsed)
    ratios = [f / s for s, f in zip(times["shardkit"], times["fairscale"], strict=True)]
    return {
        "world": world,
        "step_s": {name: statistics.median(t) for name, t in times.items()},
        "x_fairscale": statistics.median(ratios),  # shardkit tokens/s over FairScale's
        "ratios": ratios,
    }


def ratios_to_fairscale(rows: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """Per configuration and world: the median over rounds of tokens/s divided by the
    same round's FairScale ``MOELayer`` row."""
    out: dict[str, dict[int, list[float]]] = {}
    for world in sorted({r["world"] for r in rows}):
        mine = [r for r in rows if r["world"] == world]
        rounds = sorted({r["round"] for r in mine})
        for i in rounds:
            row = {r["config"]: r["tokens_per_s"] for r in mine if r["round"] == i}
            if FAIRSCALE not in row:
                continue
            for config, tps in row.items():
                out.setdefault(config, {}).setdefault(world, []).append(tps / row[FAIRSCALE])
    return {c: {w: statistics.median(v) for w, v in ws.items()} for c, ws in out.items()}


HEADER = (
    "| world | configuration | tokens/s | step ms | expert MiB / rank | peak RSS MiB | all-to-all bytes each way (counted / formula) |\n"
    "|---|---|---|---|---|---|---|"
)


def render_row(r: dict[str, Any]) -> str:
    """One row of the markdown table."""
    sent = f"{r['bytes']['dispatch']} / {r['formula_bytes']}" if "bytes" in r else "-"
    return (
        f"| {r['world']} | {r['config']} | {r['tokens_per_s']:.0f} | {1e3 * r['step_s']:.1f} "
        f"| {r['expert_bytes'] / MIB:.2f} | {r['peak_rss_mib']:.0f} | {sent} |"
    )


def render_markdown(rows: list[dict[str, Any]]) -> str:
    return "\n".join([HEADER, *(render_row(r) for r in rows)])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank (multiple of 8)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=10, help="alternated MOELayer steps")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    have_fairscale = importlib.util.find_spec("fairscale") is not None
    have_deepspeed = importlib.util.find_spec("deepspeed") is not None
    out = RESULTS.__class__(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"moe-{time.strftime('%Y%m%d-%H%M%S')}.json"
    rows: list[dict[str, Any]] = []
    pairs: list[dict[str, Any]] = []
    loads = [_load()]
    doc = {"args": vars(args), "rows": rows, "pairs": pairs, "uptime": loads}
    print(HEADER, flush=True)
    for world in args.worlds:
        if have_fairscale and args.pairs:
            pairs.append(run_distributed(run_pair, world, args, timeout_s=600)[0])
            print(
                f"world {world}: shardkit MOELayer / FairScale MOELayer tokens/s, alternated "
                f"steps: {pairs[-1]['x_fairscale']:.2f}",
                flush=True,
            )
        for i in range(args.rounds):  # paired rounds: every configuration once per round
            for name in _configs(world, have_fairscale, have_deepspeed):
                try:
                    row = run_distributed(run_config, world, name, args, timeout_s=600)[0]
                except Exception as err:
                    row = {"config": name, "world": world, "error": str(err)[-400:]}
                    print(f"| {world} | {name} | failed: {row['error'][-120:]} |", flush=True)
                else:
                    print(render_row(row), flush=True)
                rows.append(row | {"round": i})
                doc["x_fairscale"] = ratios_to_fairscale([r for r in rows if "error" not in r])
                path.write_text(json.dumps(doc, indent=1))
        loads.append(_load())
        path.write_text(json.dumps(doc, indent=1))
    return doc


def _load() -> str:
    """``/proc/loadavg`` (1, 5 and 15 minute load), with the time."""
    with open("/proc/loadavg") as f:
        return f"{time.strftime('%H:%M:%S')} {f.read().strip()}"


if __name__ == "__main__":
    main()
