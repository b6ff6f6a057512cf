"""Mixture of experts side by side: shardkit ``MoE`` at ep = 1, 2, 4, shardkit's and
(where installed) FairScale's ``MOELayer``, and the dense MLP with the same active
parameters per token.

Run (gloo, one thread per rank)::

    python -m benchmarks.moe                      # 2 and 4 ranks
    python -m benchmarks.moe --worlds 2 --tokens 64 --steps 2 --rounds 1   # quick

Each (world, configuration) runs in freshly spawned ranks, so the peak RSS (``VmHWM``
of each rank's process) is that configuration's alone. A step is forward, backward and
the gradient reduction (dense over all ranks by DDP, experts averaged over ``edp``);
its time is the slowest rank's; tokens/s is ``world x tokens / median step``. For
shardkit ``MoE`` the all-to-all bytes counted by the layer are reported against the
formula ``tokens x k x hidden x 4`` (each way; equal when no token is dropped).
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


def _configs(world: int, have_fairscale: bool) -> list[str]:
    names = ["dense (same active parameters)", "shardkit MOELayer (FairScale's)"]
    if have_fairscale:
        names.append("fairscale MOELayer")
    return names + [f"shardkit MoE ep={ep}" for ep in (1, 2, 4) if ep <= world]


def _build(name: str, args: argparse.Namespace, mesh: ProcessMesh) -> nn.Module:
    m, f, e, world = args.hidden, args.ffn, args.experts, mesh.dims.world_size
    if name.startswith("dense"):
        return nn.Sequential(nn.Linear(m, args.k * f), nn.GELU(), nn.Linear(args.k * f, m))
    if name.startswith("shardkit MoE"):
        return MoE(m, f, e, k=args.k, min_capacity=0, ep_group=mesh.group("ep"))
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
    ep = int(name.rsplit("=", 1)[1]) if name.startswith("shardkit MoE") else world
    mesh = ProcessMesh(ParallelDims(world_size=world, ep=ep if "MoE" in name else 1))
    torch.manual_seed(0)
    layer = _build(name, args, mesh)
    model = _Residual(layer)
    ignore_experts_in_ddp(model)
    ddp = DistributedDataParallel(model)
    x = torch.randn(args.tokens // 8, 8, args.hidden)
    times = []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        ddp(x).square().mean().backward()
        all_reduce_expert_gradients(model, mesh.group("edp") if "MoE" in name else None)
        elapsed = slowest(time.perf_counter() - start)
        if step:
            times.append(elapsed)
        model.zero_grad(set_to_none=True)
    row: dict[str, Any] = {
        "config": name,
        "world": world,
        "step_s": statistics.median(times),
        "tokens_per_s": world * args.tokens / statistics.median(times),
        "expert_bytes": sum(p.numel() * 4 for p in expert_parameters(model).values()),
        "peak_rss_mib": slowest(peak_rss_bytes() / MIB),
    }
    if isinstance(layer, MoE) and layer.last_routing is not None:
        row["bytes"] = dict(layer.last_all_to_all_bytes)
        row["kept_bytes"] = int(layer.last_routing.kept.sum()) * args.hidden * 4
        row["formula_bytes"] = args.tokens * args.k * args.hidden * 4 if ep > 1 else 0
    mesh.destroy()
    return row


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
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    have_fairscale = importlib.util.find_spec("fairscale") is not None
    out = RESULTS.__class__(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"moe-{time.strftime('%Y%m%d-%H%M%S')}.json"
    rows: list[dict[str, Any]] = []
    doc = {"args": vars(args), "rows": rows}
    print(HEADER, flush=True)
    for world in args.worlds:
        for _ in range(args.rounds):  # paired rounds: every configuration once per round
            for name in _configs(world, have_fairscale):
                rows.append(run_distributed(run_config, world, name, args, timeout_s=600)[0])
                print(render_row(rows[-1]), flush=True)
                path.write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
