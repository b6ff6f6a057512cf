"""The floor of ZeRO-3's step time against DDP's, from the cost of each piece of work.

Run::

    python -m benchmarks.step_floor                  # anchor GPT, 2 ranks
    python -m benchmarks.step_floor --size medium --world-size 2 --repeats 7

FSDP and DDP run the same forward and backward; what differs per step and rank
(psi parameters, N ranks, L units of which the last keeps its full parameters; the
ZeRO paper's accounting, Rajbhandari et al. 2020, sections 5.1 and 7):

- DDP: one all-reduce of the psi-element gradient, an AdamW step over psi elements;
- FSDP: an all-gather of every unit in forward and of L - 1 units again in backward,
  a reduce-scatter of every unit's gradient, an AdamW step over psi / N elements.

Each piece is timed alone in fresh spawned gloo ranks (one thread each), with the
unit sizes of the GPT (the root: embeddings and final norm; one unit per block) and
FSDP's own collectives (``all_gather_flat``, ``reduce_scatter_flat``), as CPU time of
the whole process (gloo's threads included) per rank, median of ``--repeats``: on
CPU ranks that share the machine's cores, every collective's CPU time is step time.
The forward and backward are timed on one rank without communication.

The floor is the step time FSDP would have if nothing else differed (no hooks, no
page faults of the unit buffers, no waits)::

    ddp  = compute + all-reduce + AdamW(psi)
    fsdp = compute + all-gathers + reduce-scatters + AdamW(psi / N)

Output: the table of pieces (ms per step per rank), both sums, ``fsdp / ddp`` and
``benchmarks/results/step_floor-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import RESULTS, machine, timestamp
from benchmarks.compare import SIZES, _batch, model_config
from shardkit.models import GPT, GPTConfig
from shardkit.nn.data_parallel.fully_sharded.collectives import (
    all_gather_flat,
    reduce_scatter_flat,
)
from shardkit.testing import run_distributed


def unit_sizes(config: GPTConfig) -> list[int]:
    """Elements of each FSDP unit of the GPT: the root (token and position embeddings,
    the tied LM head, the final LayerNorm), then one per block."""
    c = config.n_embd
    root = (config.vocab_size + config.block_size) * c + 2 * c
    return [root] + [12 * c * c + 13 * c] * config.n_layer


def _cpu_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median CPU time of ``fn`` (ms, the whole process), after one untimed call; the
    ranks start each call together."""
    fn()
    times = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return 1e3 * statistics.median(times)


def _adamw_ms(sizes: list[int], repeats: int) -> float:
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)
    return _cpu_ms(opt.step, repeats)


def pieces(spec: dict[str, Any]) -> dict[str, float]:
    """Body of every rank: the communication and optimizer pieces (ms per step)."""
    torch.set_num_threads(1)
    config = model_config(spec["size"], spec["seq_len"])
    n, repeats = dist.get_world_size(), spec["repeats"]
    sizes = [-(-s // n) * n for s in unit_sizes(config)]  # padded to N
    fulls = [torch.zeros(s) for s in sizes]
    shards = [torch.randn(s // n) for s in sizes]
    grads = [torch.randn(s) for s in sizes]
    outs = [torch.empty(s // n) for s in sizes]
    flat_grad = torch.randn(sum(sizes))

    def gather(units: list[int]) -> Callable[[], None]:
        def run() -> None:
            for i in units:
                all_gather_flat(fulls[i], shards[i], None)

        return run

    def scatter() -> None:
        pending = [reduce_scatter_flat(o, g, None, async_op=True) for o, g in zip(outs, grads)]
        for p in pending:
            p.wait()

    blocks = list(range(1, len(sizes)))
    return {
        "all-gather forward": _cpu_ms(gather(list(range(len(sizes)))), repeats),
        "all-gather backward": _cpu_ms(gather(blocks[:-1]), repeats),
        "reduce-scatter": _cpu_ms(scatter, repeats),
        "all-reduce": _cpu_ms(lambda: dist.all_reduce(flat_grad), repeats),
        "AdamW psi": _adamw_ms([p.numel() for p in GPT(config).parameters()], repeats),
        "AdamW psi / N": _adamw_ms([s // n for s in sizes], repeats),
    }


def compute_ms(spec: dict[str, Any]) -> float:
    """Forward and backward of the GPT on one rank's batch, no communication (ms)."""
    torch.set_num_threads(1)
    config = model_config(spec["size"], spec["seq_len"])
    torch.manual_seed(0)
    model = GPT(config)
    x, y = _batch(config, spec["batch"])

    def step() -> None:
        model(x, targets=y)[1].backward()
        model.zero_grad(set_to_none=True)

    return _cpu_ms(step, spec["repeats"])


def floor(p: dict[str, float], compute: float) -> dict[str, float]:
    """Both step models (ms) and their ratio."""
    ddp = compute + p["all-reduce"] + p["AdamW psi"]
    fsdp = compute + p["all-gather forward"] + p["all-gather backward"]
    fsdp += p["reduce-scatter"] + p["AdamW psi / N"]
    return {"compute": compute, "ddp": ddp, "fsdp": fsdp, "fsdp / ddp": fsdp / ddp}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse, measure, print the table, write the JSON; return the document."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.step_floor", description=__doc__.splitlines()[0]
    )
    p.add_argument("--size", default="anchor", choices=sorted(SIZES), help="default anchor")
    p.add_argument("--world-size", type=int, default=2, help="default 2")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank (default 8)")
    p.add_argument("--seq-len", type=int, default=128, help="default 128")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per piece (default 5)")
    args = p.parse_args(argv)
    if args.world_size < 2 or args.repeats < 1:
        p.error(f"need --world-size >= 2 and --repeats >= 1; got {args.world_size}, {args.repeats}")
    spec = {"size": args.size, "seq_len": args.seq_len, "batch": args.batch}
    spec["repeats"] = args.repeats
    per_rank = run_distributed(pieces, args.world_size, spec, timeout_s=900)
    measured = {k: max(r[k] for r in per_rank) for k in per_rank[0]}  # the slowest rank
    compute = run_distributed(compute_ms, 1, spec, timeout_s=900)[0]
    result = floor(measured, compute)
    for name, ms in {**measured, **result}.items():
        print(f"{name:>22}: {ms:9.3f}" if name == "fsdp / ddp" else f"{name:>22}: {ms:7.1f} ms")
    doc = {"args": vars(args), "machine": machine(), "pieces_ms": measured, "floor": result}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"step_floor-{timestamp()}.json"
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    return doc


if __name__ == "__main__":
    main()
