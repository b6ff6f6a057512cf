"""Every strategy side by side on the main job's GPT: step time, memory, communication.

Run::

    python -m benchmarks.compare                   # defaults: world size 2, GPT tiny (the main job)
    python -m benchmarks.compare --world-sizes 1 2 4 --model-sizes small medium
    python -m benchmarks.compare --steps 2 --rounds 1 --strategies "torch DDP" "shardkit fsdp"
    make bench                                     # the defaults

Strategies (:mod:`benchmarks.runners`): torch DDP, DDP + torch
``ZeroRedundancyOptimizer``, torch FSDP2 ``fully_shard``, DeepSpeed ZeRO-1/2/3 and
FairScale OSS / ShardedDDP (only where installed; otherwise a "not installed" row),
and shardkit's oss, sdp, fsdp, pipe, offload (the main job's ``--strategy`` registry)
and offload on the disk tier.

[Note: method]
For every (world size, model size), ``--rounds`` rounds run every strategy once, the
order rotating by one from round to round, so that the load from other processes on a
shared machine falls on all strategies alike and none always runs first. Each run is
a fresh set of spawned gloo ranks (one thread each), so the peak RSS per rank
(``VmHWM``) is that run's alone: build the GPT (same seed on every rank), wrap it,
``--warmup`` untimed steps (the first one measures the model-state bytes per rank by
category, :func:`shardkit.memory.model_state_bytes`: parameters, gradients and buffers
after backward, optimizer state after the step), then ``--steps`` timed steps. A step
is forward, backward, optimizer step, ``zero_grad``; its time is the slowest rank's.
Reported over all timed steps of all rounds (``--steps x --rounds``, 10 by default):
median, quartiles and min/max of the step time; tokens/s (world size x batch x
sequence length / median); the ratio to torch DDP's median, and the paired ratio (the
median over rounds of the round's median over DDP's in the same round). Communication
is counted, not estimated (:mod:`benchmarks.comm`): the bytes of every
torch.distributed collective issued in the timed steps, per step and rank, and the
ring-algorithm volume against the ZeRO paper's 2 psi / 3 psi. A failing strategy is a
row with its error.

Output: ``benchmarks/results/compare-<time>.json`` (everything, with the machine, the
load average at start and end and the command), ``.md`` (the table) and PNG plots
(``-memory.png``: model-state bytes per rank vs world size with the ZeRO formula
lines; ``-ratio.png``: step time over torch DDP's; ``-rss.png``: the peak resident set
of every step, per strategy: ``VmHWM`` reset before each step through
``/proc/self/clear_refs``, the largest rank, median and range over rounds).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from benchmarks import comm
from benchmarks.common import (
    add_run_args,
    command,
    local_state_bytes,
    machine,
    peak_rss_bytes,
    slowest,
    start_rss_watchdog,
    timestamp,
)
from benchmarks.report import render_markdown, summarize, write_plots
from benchmarks.runners import BY_NAME, STRATEGIES, Runner, available
from shardkit.extras import MissingDependency
from shardkit.memory import HEAP_TRIM_MODES, set_heap_trim
from shardkit.models import MODEL_SIZES, GPTConfig
from shardkit.testing import RankError, RankTimeoutError, run_distributed

SIZES: dict[str, dict[str, int]] = {
    **{name: {**shape, "vocab_size": 256} for name, shape in MODEL_SIZES.items()},
    # The GPT of /work/shared/ANCHORS.md: 23.2M parameters at T = 128 with the LM head
    # tied to the embedding (ANCHORS.md's 27.4M counts a separate 4.2M head).
    "anchor": {"n_layer": 6, "n_head": 8, "n_embd": 512, "vocab_size": 8192},
}
"""Model sizes: the main job's byte-level ``tiny``/``small``/``medium`` and ``anchor``."""


def model_config(size: str, seq_len: int) -> GPTConfig:
    """The GPT of a named size with ``block_size = seq_len``.

    Raises:
        ValueError: for an unknown size, naming the known ones.
    """
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(SIZES)}")
    return GPTConfig(block_size=seq_len, **SIZES[size])


def num_params(config: GPTConfig) -> int:
    """psi: the GPT's unique parameter elements (the tied LM head counted once).

    Embeddings ``(V + T) C``; per block two LayerNorms (``4 C``), attention
    (``4 C^2 + 4 C``) and MLP (``8 C^2 + 5 C``); the final LayerNorm ``2 C``.
    """
    c = config.n_embd
    per_block = 12 * c * c + 13 * c
    return (config.vocab_size + config.block_size) * c + config.n_layer * per_block + 2 * c


# ---------------------------------------------------------------------------- ranks
def _batch(config: GPTConfig, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(dist.get_rank())
    shape = (batch, config.block_size)
    x = torch.randint(0, config.vocab_size, shape, generator=gen)
    return x, torch.randint(0, config.vocab_size, shape, generator=gen)


def _measured_step(
    runner: Runner, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, dict[str, int]]:
    """One training step that measures the model state: parameters, gradients and
    buffers after backward, optimizer state after the step (bytes per category); the
    loss and the state."""
    loss = runner.forward_backward(x, y)
    state = runner.module_state() if runner.module_state else local_state_bytes(runner.module)
    runner.step_fn()
    state["optimizer_state"] = local_state_bytes(torch.nn.Module(), runner.optimizer_state())[
        "optimizer_state"
    ]
    state["total"] = sum(state[k] for k in ("parameters", "gradients", "optimizer_state"))
    state["total"] += state["buffers"]
    return loss, state


def run_config(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Body of every rank of one run (a fresh process): build, warm up, time, count.

    Args:
        spec: ``strategy`` (a name in :data:`benchmarks.runners.BY_NAME`), ``model``
            (:class:`GPTConfig` fields), ``batch`` (sequences per rank), ``steps``
            (timed), ``warmup`` (untimed, >= 1: the first measures the state), optional
            ``memory_limit_bytes`` (RSS watchdog), ``chunks``, ``offload_dir``,
            ``heap_trim`` (a :func:`shardkit.memory.set_heap_trim` mode; None: the
            library's default).

    Returns:
        ``times`` (s per timed step, slowest rank), ``warmup_times`` (s per warm-up
        step, slowest rank: the first one compiles a compiled row's blocks; it also
        measures the state, a few ms), ``losses`` (this rank's loss of
        every step, warm-up included), ``state`` (bytes by category),
        ``comm`` (:meth:`benchmarks.comm.CommCounter.snapshot` over the timed steps),
        ``rss_start`` / ``rss_peak`` (``VmHWM`` bytes before building / over the run),
        ``rss_steps`` (the peak resident set of every step, warm-up included, bytes;
        ``rss_steps_kind``: "per step", or "running" where the peak cannot be reset).
    """
    rss_start = peak_rss_bytes()
    if spec.get("heap_trim") is not None:
        set_heap_trim(spec["heap_trim"])
    if spec.get("memory_limit_bytes"):
        start_rss_watchdog(int(spec["memory_limit_bytes"]))
    counter = comm.install()
    counter.reset()
    rss_steps: list[int] = []
    try:
        torch.manual_seed(0)
        config = GPTConfig(**spec["model"])
        runner = BY_NAME[spec["strategy"]].build(config, spec)
        x, y = _batch(config, spec["batch"])
        built_peak = peak_rss_bytes()
        per_step = reset_peak_rss()
        dist.barrier()
        first_start = time.perf_counter()
        loss, state = _measured_step(runner, x, y)
        rss_steps.append(peak_rss_bytes())
        losses = [loss]
        warmup_times = [slowest(time.perf_counter() - first_start)]
        for _ in range(spec["warmup"] - 1):
            dist.barrier()
            reset_peak_rss()
            start = time.perf_counter()
            losses.append(runner.train_step(x, y))
            warmup_times.append(slowest(time.perf_counter() - start))
            rss_steps.append(peak_rss_bytes())
        times = []
        for _ in range(spec["steps"]):
            dist.barrier()
            reset_peak_rss()
            with counter.counting():
                start = time.perf_counter()
                losses.append(runner.train_step(x, y))
                elapsed = time.perf_counter() - start
            rss_steps.append(peak_rss_bytes())
            times.append(slowest(elapsed))
    finally:
        comm.uninstall()  # a reused process (a test's rank pool) gets torch's own back
    return {
        "times": times,
        "warmup_times": warmup_times,
        "losses": [float(v) for v in losses],
        "state": state,
        "comm": counter.snapshot(),
        "rss_start": rss_start,
        "rss_peak": max([built_peak, *rss_steps]),
        "rss_steps": rss_steps,
        "rss_steps_kind": "per step" if per_step else "running",
    }


def reset_peak_rss() -> bool:
    """Start this process's ``VmHWM`` afresh from its current resident set (Linux:
    ``5`` written to ``/proc/self/clear_refs``), so that the next reading is the peak
    of what ran in between; False where that is not possible (the readings are then
    the running peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------------- runs
def error_line(err: BaseException) -> str:
    """The last line of a rank's traceback (or the error itself): what went wrong."""
    text = err.remote_traceback if isinstance(err, RankError) else str(err)
    lines = [
        line.strip()
        for line in text.strip().splitlines()
        if line.strip() and not line.startswith("(ranks ")  # RankPool's note on other ranks
    ]
    head = f"rank {err.rank}: " if isinstance(err, RankError) else ""
    return head + (lines[-1] if lines else type(err).__name__)


def run_once(spec: dict[str, Any], world_size: int, timeout_s: float) -> dict[str, Any]:
    """One run in fresh ranks; a failure becomes ``{"error": ...}``, never an exception."""
    record: dict[str, Any] = {"spec": spec, "world_size": world_size}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-") as tmp:
        if spec["strategy"] == "shardkit offload (disk)":
            spec = {**spec, "offload_dir": tmp}
        try:
            record["ranks"] = run_distributed(run_config, world_size, spec, timeout_s=timeout_s)
        except (RankError, RankTimeoutError) as err:
            record["error"] = error_line(err)
    record["wall_s"] = time.perf_counter() - started
    return record


def rotated(names: list[str], round_index: int) -> list[str]:
    """``names`` rotated left by ``round_index`` (the order of one round)."""
    if not names:
        return []
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def run_grid(
    args: argparse.Namespace,
    names: list[str],
    on_run: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every (world size, model size, round, strategy) run, interleaved; the records.

    A strategy that failed in a round is not run again for that (world size, model).
    """
    records: list[dict[str, Any]] = []
    total = len(args.world_sizes) * len(args.model_sizes) * args.rounds * len(names)
    bar = tqdm(total=total, desc="compare", unit="run", dynamic_ncols=True)
    for world_size in args.world_sizes:
        for size in args.model_sizes:
            config = model_config(size, args.seq_len)
            failed: set[str] = set()
            for round_index in range(args.rounds):
                for name in rotated(names, round_index):
                    bar.set_postfix_str(f"N={world_size} {size} {name}")
                    if name in failed:
                        bar.update()
                        continue
                    spec = {
                        "strategy": name,
                        "model": asdict(config),
                        "batch": args.batch,
                        "steps": args.steps,
                        "warmup": args.warmup,
                        "chunks": args.chunks,
                        "heap_trim": args.heap_trim,
                    }
                    record = run_once(spec, world_size, args.timeout)
                    record.update(
                        model_size=size,
                        round=round_index,
                        psi=num_params(config),
                        stage=BY_NAME[name].stage,
                        compiled_from=BY_NAME[name].compiled_from,
                    )
                    if "error" in record:
                        failed.add(name)
                        tqdm.write(f"{name} (N={world_size}, {size}): {record['error']}")
                    records.append(record)
                    if on_run is not None:
                        on_run(record)
                    bar.update()
    bar.close()
    return records


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.compare", description=__doc__.splitlines()[0]
    )
    names = [s.name for s in STRATEGIES]
    add = p.add_argument
    add("--world-sizes", type=int, nargs="+", default=[2], help="default: 2")
    add("--model-sizes", nargs="+", default=["tiny"], choices=sorted(SIZES), help="default tiny")
    default = [s.name for s in STRATEGIES if not s.scale_only and s.compiled_from is None]
    add(
        "--strategies",
        nargs="+",
        default=default,
        choices=names,
        metavar="NAME",
        help="default: all but scale-only and '+ compile' rows",
    )
    add_run_args(p, batch=8)
    add("--render", type=Path, default=None, help="re-render the .md and plots of a results JSON")
    add("--steps", type=int, default=5, help="timed steps per run (default 5)")
    add("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    add("--warmup", type=int, default=1, help="untimed steps per run, >= 1 (default 1)")
    add("--chunks", type=int, default=4, help="pipe: micro-batches per step (default 4)")
    add(
        "--heap-trim",
        default=None,
        choices=HEAP_TRIM_MODES,
        help="shardkit.memory.set_heap_trim mode in every rank (default: the library's)",
    )
    args = p.parse_args(argv)
    if args.warmup < 1:
        p.error(f"--warmup must be >= 1 (the first step measures the state); got {args.warmup}")
    for flag, value in (("--steps", args.steps), ("--rounds", args.rounds)):
        if value < 1:
            p.error(f"{flag} must be >= 1 (a median needs timed steps); got {value}")
    if args.steps * args.rounds < 10:
        print(
            f"note: {args.steps} x {args.rounds} = {args.steps * args.rounds} timed steps per "
            "strategy (fewer than the 10 a reported median needs: a quick run)"
        )
    return args


def write_outputs(doc: dict[str, Any], stem: Path) -> str:
    """Summarize ``doc["records"]``; write ``<stem>.json``, ``<stem>.md`` and the plots;
    return the Markdown page."""
    args = doc["args"]
    doc["summary"] = summarize(doc["records"], args["batch"], args["seq_len"])
    try:
        doc["plots"] = [p.name for p in write_plots(doc["summary"], stem)]
    except MissingDependency as missing:  # the results are written all the same
        print(f"{missing.feature} skipped: {missing.install}")
        doc["plots"] = []
    page = render_markdown(doc, list(doc["not_installed"]))
    Path(f"{stem}.md").write_text(page + "\n")
    Path(f"{stem}.json").write_text(json.dumps(doc, indent=1, default=float) + "\n")
    return page


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the grid, write JSON, Markdown and plots; return the JSON document."""
    args = parse_args(argv)
    if args.render is not None:
        saved: dict[str, Any] = json.loads(args.render.read_text())
        print(write_outputs(saved, args.render.with_suffix("")))
        return saved
    selected = [BY_NAME[n] for n in args.strategies]
    runnable = [s.name for s in selected if available(s)]
    doc: dict[str, Any] = {
        "command": command("benchmarks.compare", argv),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine(),
        "not_installed": {s.name: s.requires for s in selected if not available(s)},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    doc["records"] = run_grid(args, runnable)
    doc["loadavg_end"] = machine()["loadavg"]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"compare-{timestamp()}"
    print(write_outputs(doc, stem))
    print(f"\nwrote {', '.join([f'{stem}.json', f'{stem}.md', *doc['plots']])}")
    return doc


if __name__ == "__main__":
    main()
