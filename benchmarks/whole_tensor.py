"""FSDP + Muon (``WholeTensorOptimizer``) against FSDP + AdamW: step time and bytes.

Run (gloo, one thread per rank)::

    python -m benchmarks.whole_tensor                       # 2 ranks, 4 paired rounds
    python -m benchmarks.whole_tensor --rounds 1 --steps 2  # quick

A GPT (default 4 layers x 256, vocab 256, sequence 128, batch 8 per rank) wrapped in
FSDP by Block. ``adamw``: a plain ``torch.optim.AdamW`` over the flat shards.
``muon``: a ``WholeTensorOptimizer`` with ``torch.optim.Muon`` for the 2-D weights of
the blocks and AdamW for the rest (embeddings, biases, norms), as Muon is used. Both
run in the same spawned ranks, alternating inside each round (AB, then BA), so the
paired ratio ``muon / adamw`` of each round is taken under the same load. Step time is
the slowest rank's wall time of forward, backward and ``optimizer.step()``; the step
of the optimizer alone is reported too. Bytes are counted by :mod:`benchmarks.comm`
(ring volume sent per rank and step, per collective kind) over one step, and the
exchange's exact bytes (``WholeTensorOptimizer.plan.bytes_per_step``) are reported
against the reduce-scatter of the same parameters.
Markdown to stdout, JSON to ``benchmarks/results/whole_tensor-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import comm
from benchmarks.common import RESULTS, machine, slowest, timestamp
from shardkit.models import GPT, Block, GPTConfig
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy
from shardkit.optim import WholeTensorOptimizer
from shardkit.testing import RankPool


def _model(cfg: GPTConfig) -> FSDP:
    torch.manual_seed(0)
    with enable_wrap(wrapper_cls=FSDP):
        model = auto_wrap(GPT(cfg), transformer_auto_wrap_policy({Block}))
    return model if isinstance(model, FSDP) else FSDP(model)


def _optimizer(model: FSDP, kind: str, shapes: dict[str, Any]) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    if kind == "adamw":
        return torch.optim.AdamW([p for _, p in named], lr=3e-4)
    matrix = {n for n, s in shapes.items() if len(s) == 2 and n.startswith("blocks.")}
    return WholeTensorOptimizer(
        model,
        [
            {"params": [p for n, p in named if n in matrix], "optim": torch.optim.Muon, "lr": 0.02},
            {
                "params": [p for n, p in named if n not in matrix],
                "optim": torch.optim.AdamW,
                "lr": 3e-4,
            },
        ],
    )


def _timed_exchange(opt: WholeTensorOptimizer, spent: list[float]) -> None:
    """Add the seconds of the optimizer's two all-to-alls (and their packing) to ``spent``."""
    for name in ("gather_to_owners", "scatter_from_owners"):
        real = getattr(opt, name)

        def timed(*args: Any, _real: Any = real, **kwargs: Any) -> None:
            start = time.perf_counter()
            _real(*args, **kwargs)
            spent.append(time.perf_counter() - start)

        setattr(opt, name, timed)


def _step(model: FSDP, opt: torch.optim.Optimizer, x: torch.Tensor) -> tuple[float, float]:
    start = time.perf_counter()
    model(x, x)[1].backward()
    mid = time.perf_counter()
    opt.step()
    opt.zero_grad()
    end = time.perf_counter()
    return slowest(end - start), slowest(end - mid)


def run(cfg: GPTConfig, batch: int, rounds: int, steps: int) -> dict[str, Any]:
    """Every rank: paired rounds of both configurations, then one counted step each."""
    counter = comm.install()
    shapes = {n: tuple(p.shape) for n, p in GPT(cfg).named_parameters()}
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    runs = {}
    for kind in ("adamw", "muon"):
        model = _model(cfg)
        runs[kind] = (model, _optimizer(model, kind, shapes))
        _step(*runs[kind], x)  # warm-up: optimizer state, buffers
    exchange: list[float] = []
    muon_opt = runs["muon"][1]
    assert isinstance(muon_opt, WholeTensorOptimizer)
    _timed_exchange(muon_opt, exchange)
    times: dict[str, list[float]] = {"adamw": [], "muon": []}
    opt_times: dict[str, list[float]] = {"adamw": [], "muon": []}
    for r in range(rounds):
        for kind in ("adamw", "muon") if r % 2 == 0 else ("muon", "adamw"):
            for _ in range(steps):
                t, o = _step(*runs[kind], x)
                times[kind].append(t)
                opt_times[kind].append(o)
    volume = {}
    for kind in ("adamw", "muon"):
        counter.reset()
        with counter.counting():
            _step(*runs[kind], x)
        volume[kind] = counter.snapshot()["volume_bytes"]
    opt = runs["muon"][1]
    assert isinstance(opt, WholeTensorOptimizer)
    whole = sum(p.numel for p in opt.plan.params)
    n = dist.get_world_size()
    return {
        "times": times,
        "opt_times": opt_times,
        "volume": volume,
        "exchange_bytes": opt.plan.bytes_per_step(4),
        "exchange_s": statistics.median(
            [a + b for a, b in zip(exchange[0::2], exchange[1::2])] or [0.0]
        ),
        "whole_elements": whole,
        "whole_reduce_scatter_bytes": 4 * whole * (n - 1) / n,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per configuration per round")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    args = parser.parse_args(argv)
    cfg = GPTConfig(
        vocab_size=256, block_size=128, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd
    )
    with RankPool(args.world, timeout_s=600) as pool:
        out = pool.run(run, cfg, args.batch, args.rounds, args.steps, timeout_s=3000)[0]
    s = args.steps
    pairs = [
        statistics.median(out["times"]["muon"][i : i + s])
        / statistics.median(out["times"]["adamw"][i : i + s])
        for i in range(0, len(out["times"]["muon"]), s)
    ]
    print(
        f"GPT {args.n_layer} x {args.n_embd}, {args.world} ranks, {args.rounds} paired rounds x {s} steps\n"
    )
    print(
        "| config | step s (median) | optimizer step s (median) | all-gather MB | "
        "reduce-scatter MB | all-to-all MB | total MB |"
    )
    print("|---|---|---|---|---|---|---|")
    for kind in ("adamw", "muon"):
        v = out["volume"][kind]
        gather = v.get("all_gather", 0) + v.get("broadcast", 0)  # gloo: broadcasts
        scatter = v.get("reduce_scatter", 0) + v.get("send", 0)  # gloo: send / recv
        print(
            f"| fsdp + {kind} | {statistics.median(out['times'][kind]):.3f} | "
            f"{statistics.median(out['opt_times'][kind]):.3f} | {gather / 2**20:.2f} | "
            f"{scatter / 2**20:.2f} | {v.get('all_to_all', 0) / 2**20:.2f} | "
            f"{sum(v.values()) / 2**20:.2f} |"
        )
    print(
        f"\nmuon / adamw step time, per round: {[round(p, 3) for p in pairs]}, median {statistics.median(pairs):.3f}"
    )
    print(f"exchange (both all-to-alls, rank 0) s per step, median: {out['exchange_s']:.3f}")
    print(
        f"exchange bytes sent per rank and step: {out['exchange_bytes'] / 2**20:.2f} MB = "
        f"{out['exchange_bytes'] / out['whole_reduce_scatter_bytes']:.2f} x the reduce-scatter of "
        f"the {out['whole_elements']} elements stepped whole"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"whole_tensor-{timestamp()}.json"
    path.write_text(
        json.dumps({"args": vars(args), "machine": machine(), "pairs": pairs, **out}, indent=1)
    )
    print(f"\n{path}")


if __name__ == "__main__":
    main()
