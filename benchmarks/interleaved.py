"""Step time of several strategies in the same ranks, steps interleaved: paired ratios.

Run::

    python -m benchmarks.interleaved                        # DDP, sdp, fsdp; anchor GPT
    python -m benchmarks.interleaved --rounds 4 --steps 3 --strategies "torch DDP" "shardkit fsdp"

:mod:`benchmarks.compare` runs each strategy in fresh ranks, one after the other; on a
machine shared with other jobs the load moves between runs, so small differences (a
few percent) need many rounds. Here one set of spawned gloo ranks (one thread each)
builds every strategy (the main job's registry, AdamW, the GPT and batch of
``benchmarks.compare``), warms each up, then runs ``--rounds`` rounds of ``--steps``
steps; within a step index every strategy runs one training step (forward, backward,
``before_step``, step, ``zero_grad``) back to back, the order rotating by one from
round to round. Each step's time is the slowest rank's. The ratio of a strategy is
paired twice: per step index (its step over the first strategy's step of the same
index and round) and per round (its round median over the first strategy's).

Printed and written to ``benchmarks/results/interleaved-<time>.json``, for the wall time
and the CPU time of a step (all threads of a rank's process, gloo's included; the
slowest rank's): per strategy the median step (ms) and the median over rounds of the
round ratio, with the median of the per-step ratios and their range. With two ranks
on two cores the CPU time is what a quiet machine's wall time is made of (gloo's
threads take their cycles from compute), and other jobs' load moves it far less. Caveat: the strategies share one process (allocator,
caches), which ``benchmarks.compare`` does not; confirm a final number there.

Compiled rows: a name ending in ``+ compile`` is that strategy with each block compiled
first (the main job's ``--compile``; the first warm-up step compiles); ``torch FSDP2``
(``fully_shard`` per block and the root) and ``blocks`` (the transformer blocks'
forward and backward alone) may be given too. With ``blocks`` and ``blocks + compile``
among the strategies, each compiled row gets its ceiling (:func:`compile_ceilings`)::

    python -m benchmarks.interleaved --strategies "shardkit fsdp" "shardkit fsdp + compile" \
        "torch FSDP2" "torch FSDP2 + compile" "blocks" "blocks + compile"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from benchmarks.common import add_run_args, add_strategy_args, slowest, timestamp
from benchmarks.compare import _batch, model_config
from benchmarks.profile_step import COMPILED, _step, _strategy
from shardkit.testing import run_distributed


def interleaved_rank(spec: Mapping[str, Any]) -> dict[str, dict[str, list[list[float]]]]:
    """Body of every rank: ``{"wall" | "cpu": {strategy: [[s per step] per round]}}``,
    the slowest rank's wall time and CPU time (every thread of the process, gloo's
    included: on a loaded machine it moves much less than the wall time); and
    ``"warmup": {strategy: [[s per warm-up step]]}`` (wall, slowest rank: a compiled
    row's first one is its compile, kept out of the timed steps)."""
    config = model_config(spec["size"], spec["seq_len"])
    x, y = _batch(config, spec["batch"])
    names = list(spec["strategies"])
    built = {name: _strategy(name, config, spec) for name in names}
    times: dict[str, dict[str, list[list[float]]]] = {
        kind: {name: [] for name in names} for kind in ("wall", "cpu", "warmup")
    }
    for name in names:  # the first warm-up step of a compiled row compiles its blocks
        warm = []
        for _ in range(spec["warmup"]):
            dist.barrier()
            start = time.perf_counter()
            _step(built[name], x, y)
            warm.append(slowest(time.perf_counter() - start))
        times["warmup"][name].append(warm)
    for round_index in range(spec["rounds"]):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in names:
            times["wall"][name].append([])
            times["cpu"][name].append([])
        for _ in range(spec["steps"]):
            for name in order:
                dist.barrier()
                start, cpu = time.perf_counter(), time.process_time()
                _step(built[name], x, y)
                cpu = time.process_time() - cpu
                times["wall"][name][-1].append(slowest(time.perf_counter() - start))
                times["cpu"][name][-1].append(slowest(cpu))
    return times


def summarize(times: Mapping[str, list[list[float]]]) -> dict[str, dict[str, float]]:
    """Per strategy: median step (ms), round-paired and step-paired ratios to the first."""
    names = list(times)
    base = times[names[0]]
    out = {}
    for name in names:
        rounds = times[name]
        per_round = [statistics.median(r) / statistics.median(b) for r, b in zip(rounds, base)]
        per_step = [t / b for r, br in zip(rounds, base) for t, b in zip(r, br)]
        out[name] = {
            "median_ms": 1e3 * statistics.median([t for r in rounds for t in r]),
            "round_ratio": statistics.median(per_round),
            "step_ratio": statistics.median(per_step),
            "step_ratio_min": min(per_step),
            "step_ratio_max": max(per_step),
            "rounds": len(rounds),
        }
    return out


def compile_ceilings(summary: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per compiled row ``"<X> + compile"`` run with its eager row ``X`` and with the
    ``blocks`` rows (the transformer blocks' forward and backward alone, eager and
    compiled, :func:`benchmarks.profile_step._strategy`): ``x_eager`` (X's median step
    over its own, measured) and ``ceiling``: X's step with the blocks' eager time
    replaced by their compiled time, ``t_X / (t_X - t_blocks + t_blocks_compiled)``,
    the speedup compiling the blocks can give X when nothing else in the step changes
    (communication, the LM head and loss, the optimizer: what compile does not touch).
    Empty without both ``blocks`` rows."""
    blocks, blocks_compiled = summary.get("blocks"), summary.get(f"blocks{COMPILED}")
    if blocks is None or blocks_compiled is None:
        return {}
    saved = blocks["median_ms"] - blocks_compiled["median_ms"]
    out = {}
    for name, row in summary.items():
        eager = summary.get(name.removesuffix(COMPILED))
        if not name.endswith(COMPILED) or name.startswith("blocks") or eager is None:
            continue
        out[name] = {
            "x_eager": eager["median_ms"] / row["median_ms"],
            "ceiling": eager["median_ms"] / (eager["median_ms"] - saved),
            "blocks_share": blocks["median_ms"] / eager["median_ms"],
        }
    return out


def paired_x_eager(times: Mapping[str, list[list[float]]]) -> dict[str, float]:
    """Per compiled row ``"<X> + compile"`` run with its eager row ``X``: the median over
    rounds of (X's round median / the compiled row's round median), both from the same
    rounds of the same ranks (> 1: compiled is faster)."""
    out = {}
    for name, rounds in times.items():
        eager = times.get(name.removesuffix(COMPILED))
        if name.endswith(COMPILED) and eager is not None:
            out[name] = statistics.median(
                statistics.median(e) / statistics.median(c) for e, c in zip(eager, rounds)
            )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.interleaved", description=__doc__)
    add_strategy_args(parser)
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--steps", type=int, default=3, help="steps per round (default 3)")
    add_run_args(parser, batch=8, timeout_s=3600)
    args = parser.parse_args(argv)
    spec = {
        "strategies": args.strategies,
        "size": args.size,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    load_start = list(os.getloadavg())
    times = run_distributed(interleaved_rank, args.world_size, spec, timeout_s=args.timeout)[0]
    warmup = times.pop("warmup")
    summary = {kind: summarize(per_kind) for kind, per_kind in times.items()}
    for name, (steps,) in warmup.items():
        print(f"{name}: warm-up steps {', '.join(f'{t:.1f}' for t in steps)} s (wall)")
    for kind, rows in summary.items():
        head = f"{kind + ' time':<16}{'median ms':>11}{'x first (rounds)':>18}"
        print(f"{head}{'x first (steps)':>17}  range")
        for name, row in rows.items():
            print(
                f"{name:<16}{row['median_ms']:11.0f}{row['round_ratio']:18.3f}{row['step_ratio']:17.3f}"
                f"  [{row['step_ratio_min']:.2f}, {row['step_ratio_max']:.2f}]"
            )
    paired = {kind: paired_x_eager(per_kind) for kind, per_kind in times.items()}
    for kind, ratios in paired.items():
        for name, ratio in ratios.items():
            print(f"{kind}: {name} {ratio:.3f}x its eager step (paired by round)")
    ceilings = {kind: compile_ceilings(rows) for kind, rows in summary.items()}
    for kind, rows in ceilings.items():
        for name, c in rows.items():
            print(
                f"{kind}: {name} {c['x_eager']:.3f}x its eager step; ceiling {c['ceiling']:.3f}x "
                f"(blocks {100 * c['blocks_share']:.0f}% of the eager step)"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"interleaved-{timestamp()}.json"
    record = {
        "args": {**vars(args), "out": str(args.out)},
        "times": times,
        "warmup_s": {name: steps for name, (steps,) in warmup.items()},
        "loadavg_start_end": [load_start, list(os.getloadavg())],
        "summary": summary,
        "x_eager_paired": paired,
        "compile_ceilings": ceilings,
    }
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
