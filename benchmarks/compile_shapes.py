"""One transformer block compiled against eager, as the width grows: speedup and ceiling.

Run::

    python -m benchmarks.compile_shapes                   # widths 128 256 512, 8 x 128 tokens
    python -m benchmarks.compile_shapes --widths 512 --rounds 8 --batch 1024 --seq-len 1

[Note: method]
For each width ``C`` (``C / 64`` heads, at least 1; ``--batch`` x ``--seq-len`` tokens;
fp32; one intra-op thread, as every rank of the benchmarks runs), one
:class:`shardkit.models.Block` runs eager, and a copy with the same weights runs
compiled by inductor (``block.compile(dynamic=False)`` after ``torch._dynamo.reset()``:
one graph per width, no dynamic shapes). The copy's first forward + backward compiles
it; that time is reported apart and never timed as a step. Then ``--rounds`` rounds of
``--steps`` forward + backward steps of each, in one process, eager first in even
rounds and compiled first in odd ones (ABAB); each step's wall and CPU time. Reported
per width: median step of each, the paired ratio (median over rounds of the eager
round median over the compiled one) for wall and CPU time, and the profile of
``--profile-steps`` eager steps (``torch.profiler``, self CPU time per operator: wall
time of each operator on the main thread, so on a loaded machine preemption lands on
operators at random; enough steps average it out).

[Note: the ceiling]
Inductor fuses the element-wise work around the matrix multiplies (LayerNorm, GELU,
the residual adds, bias, transposes and copies) and calls the same GEMM and attention
kernels as eager. So a compiled block cannot be faster than the eager block with all of
that work removed: ``ceiling = total self CPU / (GEMM + attention self CPU)`` (Amdahl's
law with the rest sped up infinitely), from the eager profile. GEMMs are the operators
in :data:`GEMM_OPS`, attention the ones in :data:`ATTENTION_OPS`.

Output: a table on stdout and ``benchmarks/results/compile_shapes-<time>.json`` (the
load average at start and end with it: on a shared machine, compare CPU times).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch._dynamo
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import RESULTS, machine, timestamp
from shardkit.models import Block, GPTConfig

GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})
"""Matrix-multiply operators: the linear layers' forward and backward."""
ATTENTION_OPS = frozenset(
    {
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    }
)
"""The attention kernels of ``scaled_dot_product_attention`` on CPU (fused, matmul-bound)."""


def ceiling(self_cpu: dict[str, float]) -> dict[str, float]:
    """From self CPU time per operator (any unit): the GEMM and attention shares of the
    total and the speedup ceiling of compiling (see ``[Note: the ceiling]``).

    Raises:
        ValueError: no GEMM or attention time (nothing a compile must leave alone).
    """
    total = sum(self_cpu.values())
    gemm = sum(t for op, t in self_cpu.items() if op in GEMM_OPS)
    attention = sum(t for op, t in self_cpu.items() if op in ATTENTION_OPS)
    if gemm + attention <= 0:
        raise ValueError(f"no GEMM or attention operator among {sorted(self_cpu)}")
    return {
        "gemm_share": gemm / total,
        "attention_share": attention / total,
        "ceiling": total / (gemm + attention),
    }


def paired_ratio(eager: Iterable[list[float]], compiled: Iterable[list[float]]) -> float:
    """Median over rounds of (eager round median / compiled round median): > 1 when
    compiled is faster."""
    return statistics.median(
        statistics.median(e) / statistics.median(c) for e, c in zip(eager, compiled)
    )


def _step(block: torch.nn.Module, x: torch.Tensor) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    block(x).square().mean().backward()
    block.zero_grad(set_to_none=True)
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(width: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement of one width (see ``[Note: method]``)."""
    torch.manual_seed(0)
    config = GPTConfig(n_embd=width, n_head=max(1, width // 64), block_size=args.seq_len)
    eager = Block(config)
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled.compile(dynamic=False)
    x = torch.randn(args.batch, args.seq_len, width)
    compile_s = _step(compiled, x)[0]
    for _ in range(args.warmup):
        _step(eager, x), _step(compiled, x)
    times: dict[str, dict[str, list[list[float]]]] = {
        kind: {"eager": [], "compiled": []} for kind in ("wall", "cpu")
    }
    blocks = {"eager": eager, "compiled": compiled}
    for r in range(args.rounds):
        for name in ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager"):
            steps = [_step(blocks[name], x) for _ in range(args.steps)]
            times["wall"][name].append([w for w, _ in steps])
            times["cpu"][name].append([c for _, c in steps])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.profile_steps):
            _step(eager, x)
    self_cpu = {e.key: float(e.self_cpu_time_total) for e in prof.key_averages()}
    top = sorted(self_cpu.items(), key=lambda kv: -kv[1])[: args.top]
    return {
        "width": width,
        "heads": config.n_head,
        "params": sum(p.numel() for p in eager.parameters()),
        "compile_s": compile_s,
        "times": times,
        **{f"median_{k}_ms": _medians(times[k]) for k in ("wall", "cpu")},
        "x_eager_wall": paired_ratio(times["wall"]["eager"], times["wall"]["compiled"]),
        "x_eager_cpu": paired_ratio(times["cpu"]["eager"], times["cpu"]["compiled"]),
        "profile_top_us": dict(top),
        **ceiling(self_cpu),
    }


def _medians(per_name: dict[str, list[list[float]]]) -> dict[str, float]:
    return {
        n: 1e3 * statistics.median(t for r in rounds for t in r) for n, rounds in per_name.items()
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure every width; print the table and write the JSON; return the document."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.compile_shapes", description=__doc__.splitlines()[0]
    )
    add = p.add_argument
    add("--widths", type=int, nargs="+", default=[128, 256, 512], help="default 128 256 512")
    add("--batch", type=int, default=8, help="sequences (default 8)")
    add("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    add("--rounds", type=int, default=6, help="ABAB rounds (default 6)")
    add("--steps", type=int, default=3, help="steps per round (default 3)")
    add("--profile-steps", type=int, default=20, help="eager steps profiled (default 20)")
    add("--warmup", type=int, default=2, help="untimed steps of each after the compile")
    add("--threads", type=int, default=1, help="intra-op threads (default 1)")
    add("--top", type=int, default=12, help="operators kept from the profile (default 12)")
    add("--out", default=str(RESULTS), help="results folder (default benchmarks/results)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    doc: dict[str, Any] = {
        "args": vars(args),
        "machine": machine(),
        "loadavg_start": os.getloadavg(),
    }
    doc["widths"] = [measure(w, args) for w in args.widths]
    doc["loadavg_end"] = os.getloadavg()
    print(
        "width  eager ms (cpu)  compiled ms (cpu)  x eager wall/cpu (paired)  compile s  "
        "GEMM / attention share  ceiling"
    )
    for r in doc["widths"]:
        e, c = r["median_cpu_ms"]["eager"], r["median_cpu_ms"]["compiled"]
        print(
            f"{r['width']:5d}  {e:14.1f}  {c:17.1f}  {r['x_eager_wall']:12.2f} / {r['x_eager_cpu']:.2f}"
            f"  {r['compile_s']:9.1f}  {100 * r['gemm_share']:9.0f}% / {100 * r['attention_share']:.0f}%"
            f"  {r['ceiling']:7.2f}"
        )
    path = f"{args.out}/compile_shapes-{timestamp()}.json"
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path} (load average {doc['loadavg_start']} -> {doc['loadavg_end']})")
    return doc


if __name__ == "__main__":
    main()
