"""FSDP's disk tier: a GPT whose model state exceeds the machine's RAM, trained on 2 ranks.

Run::

    python -m benchmarks.bench_fsdp_disk --quick          # a small GPT, 2 steps: a smoke run
    python -m benchmarks.bench_fsdp_disk --n-layer 34 --n-embd 2048 --n-head 16 --steps 3 \\
        --dir /var/tmp/fsdp-disk                            # 1.71B params, 25.5 GiB of state

Each rank builds the GPT on the meta device, wraps every block in an FSDP unit (and the
rest in the root unit) with one :class:`~shardkit.nn.data_parallel.fully_sharded.DiskOffload`,
so each unit is materialised, sharded and written as generation 0 one at a time, then
trains with AdamW (fp32) on one fixed batch of random tokens and targets per rank
(memorised: the loss must fall). Reported per
step and rank: loss (averaged over ranks), step time, bytes read and written
(:class:`~shardkit.nn.data_parallel.fully_sharded.DiskStats`), the time the training
thread waited for reads, and the resident set (``VmRSS`` after the step, ``VmHWM`` peak
of the rank's process). In the same run rank 0 measures the disk's own sequential
read and write bandwidth (:mod:`benchmarks.disk_bandwidth`: ``O_DIRECT``, the tier's
directory, a file as large as one unit's files) before and after training; the
results JSON holds ``disk_read_bytes_per_s``, ``disk_write_bytes_per_s``,
``tier_read_bytes_per_s``, ``tier_write_bytes_per_s`` and ``disk_fraction`` (see
:func:`bandwidth`). Model state: 16 bytes per parameter (fp32 parameter, gradient,
two AdamW moments). The files are deleted at the end.

Markdown goes to stdout and ``benchmarks/results/bench_fsdp_disk-<time>.md``, raw
numbers to the ``.json`` beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import ADAMW, RESULTS, peak_rss_bytes, status_bytes
from benchmarks.disk_bandwidth import measure
from shardkit.models import GPT, Block, GPTConfig
from shardkit.nn.data_parallel.fully_sharded import DiskOffload
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy
from shardkit.testing import run_distributed

GIB = 2**30


def _init(module: nn.Module) -> None:
    """``param_init_fn``: materialise one module's own tensors with the GPT's initialisation."""
    module.to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        else:
            GPT._init_weights(module)


def rank_main(cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank: build on meta, wrap on the disk tier, train ``steps`` steps."""
    rank = dist.get_rank()
    torch.set_num_threads(cfg["threads"])
    config = _gpt_config(cfg, cfg["n_layer"])
    start = time.perf_counter()
    with torch.device("meta"):
        gpt = GPT(config)
    params = gpt.num_parameters()
    disk = DiskOffload(
        cfg["dir"],
        generations=cfg["generations"],
        read_ahead_bytes=cfg.get("read_ahead_mib", 512) * 2**20,
    )
    sampler = _DiskSampler(Path(cfg["dir"])) if rank == 0 else None
    options: dict[str, Any] = {"disk_offload": disk, "param_init_fn": _init}
    with enable_wrap(wrapper_cls=FSDP, **options):
        model = FSDP(auto_wrap(gpt, transformer_auto_wrap_policy({Block})), **options)
    optimizer = disk.optimizer(torch.optim.AdamW, **_adamw(cfg))
    out: dict[str, Any] = {
        "rank": rank,
        "params": params,
        "build_s": time.perf_counter() - start,
        "rss_built": status_bytes("VmRSS"),
        "hwm_built": peak_rss_bytes(),
        "units": len(disk.units),
        "shard_bytes": sum(u.nbytes for u in disk.units),
        "steps": [],
    }
    out["disk_before"] = _measure_disk(disk, cfg)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    y = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    for step in range(cfg["steps"]):
        start, cpu, wall = time.perf_counter(), time.thread_time(), time.time()
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        stats = disk.history[-1]
        out["steps"].append(
            {
                "step": step + 1,
                "loss": float(mean) / dist.get_world_size(),
                "seconds": seconds,
                "thread_cpu_s": cpu,
                "bytes_read": stats.bytes_read,
                "bytes_written": stats.bytes_written,
                "read_wait_s": stats.read_wait_s,
                "io_s": stats.io_seconds,
                "wall": [wall, time.time()],
                "io_busy": [list(period) for period in stats.io_busy],
                "peak_write_behind_bytes": stats.peak_write_behind_bytes,
                "rss": status_bytes("VmRSS"),
                "hwm": peak_rss_bytes(),
            }
        )
        if rank == 0:
            shown = {k: v for k, v in out["steps"][-1].items() if k not in ("wall", "io_busy")}
            print(f"step {step + 1}: {shown}", flush=True)
    if sampler is not None:
        out["peak_disk_bytes"] = sampler.stop()
    out["disk_after"] = _measure_disk(disk, cfg)
    disk.close()
    dist.barrier()
    if cfg.get("floor"):
        out["memory_floor"] = [
            {"n_layer": n, "step_s": _memory_step_s(cfg, n, x, y)} for n in _floor_layers(cfg)
        ]
    return out


def _adamw(cfg: dict[str, Any]) -> dict[str, Any]:
    """The AdamW settings of the run (torch's fused CPU kernel with ``--fused``)."""
    return {**ADAMW, "lr": cfg["lr"], **({"fused": True} if cfg.get("fused") else {})}


def _gpt_config(cfg: dict[str, Any], n_layer: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=cfg["vocab"],
        block_size=cfg["seq"],
        n_layer=n_layer,
        n_head=cfg["n_head"],
        n_embd=cfg["n_embd"],
    )


def _floor_layers(cfg: dict[str, Any]) -> list[int]:
    """The depths the in-memory floor is measured at: the run's own when its model state
    fits in a third of the RAM, else the two deepest that fit (half and all of it),
    from which :func:`memory_floor` extrapolates linearly in the number of layers."""
    block = 12 * cfg["n_embd"] ** 2 + 13 * cfg["n_embd"]
    fits = max(2, int(_mem_total() / 3 / (16 * block)))
    if cfg["n_layer"] <= fits:
        return [cfg["n_layer"]]
    return [max(1, fits // 2), fits]


def _memory_step_s(cfg: dict[str, Any], n_layer: int, x: torch.Tensor, y: torch.Tensor) -> float:
    """The same training step with the model state in memory (FSDP, the same units and
    AdamW, no disk tier): median seconds of steps 2-3, the slowest rank's."""
    with torch.device("meta"):
        gpt = GPT(_gpt_config(cfg, n_layer))
    options: dict[str, Any] = {"param_init_fn": _init}
    with enable_wrap(wrapper_cls=FSDP, **options):
        model = FSDP(auto_wrap(gpt, transformer_auto_wrap_policy({Block})), **options)
    optimizer = torch.optim.AdamW(model.parameters(), **_adamw(cfg))
    times = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        times.append(float(seconds))
    del model, optimizer
    return sorted(times[1:])[len(times[1:]) // 2]


def memory_floor(cfg: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The in-memory step time of the run's GPT (measured, or extrapolated linearly in
    the layer count from two smaller depths when its state does not fit in RAM); None
    without ``--floor``. Not a lower bound of the disk tier's step: the tier steps each
    unit inside backward, in-memory FSDP steps the whole shard after it."""
    floor = ranks[0].get("memory_floor")
    if not floor:
        return None
    if len(floor) == 1:
        return {"memory_step_s": floor[0]["step_s"], "extrapolated_from": None}
    (n1, t1), (n2, t2) = ((f["n_layer"], f["step_s"]) for f in floor)
    per_layer = (t2 - t1) / (n2 - n1)
    return {
        "memory_step_s": t2 + per_layer * (cfg["n_layer"] - n2),
        "extrapolated_from": {str(n1): t1, str(n2): t2},
    }


class _DiskSampler:
    """Rank 0: the bytes of every rank's files in ``directory``, sampled every 0.5 s
    on a thread; :meth:`stop` returns the largest sample (the disk the tier needed)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.5):
            total = 0
            for root, _, names in os.walk(self.directory):
                for name in names:
                    try:
                        total += os.stat(os.path.join(root, name)).st_size
                    except FileNotFoundError:
                        continue
            self.peak = max(self.peak, total)

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak


def _measure_disk(disk: DiskOffload, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Rank 0 measures the disk alone (the other ranks wait) in the tier's directory,
    with a file as large as the largest unit's files (shard + AdamW's two moments),
    at least ``--probe-mib``; None on other ranks."""
    dist.barrier()
    result = None
    if dist.get_rank() == 0:
        unit = 3 * max(u.nbytes for u in disk.units)
        result = measure(disk.directory, max(unit, cfg["probe_mib"] * 2**20)).to_json()
    dist.barrier()
    return result


def bandwidth(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The disk's bandwidth (best of the measurements before and after training) and
    the tier's: every rank's bytes of a step over the slowest rank's step time,
    median over the steps after the first (the first has no optimizer state to read).

    ``disk_fraction``: the tier's bytes per second over the disk's for the same mix of
    reads and writes, ``(R / disk_read + W / disk_write) / step_s``; 1.0 is a step that
    keeps the disk busy at its own speed from start to end. ``io_fraction``: the same
    over the seconds the tier's I/O ran (``io_s``, the slowest rank's): how close to the
    disk's speed the tier's reads and writes go while they run, whatever the compute.
    ``disk_fraction_ceiling``: ``disk_time_s`` (the disk alone, ``R / disk_read + W /
    disk_write``) over the longer of it and ``thread_cpu_s``, the CPU seconds of the
    slowest rank's training thread in the step (``time.thread_time``: its compute,
    optimizer steps, copies and page faults, not its waits): a step is at least as long
    as either, so no tier can keep the disk busier than this on this CPU.
    ``disk_busy_fraction``: the share of the step during which some rank's tier had a
    read or write running (:func:`disk_busy_s`), whatever the disk's speed: 1.0 leaves
    the disk no idle moment, so the rest of the gap to ``disk_fraction`` is the disk's
    own speed at the time against the probes'."""
    probes = [r[k] for r in ranks for k in ("disk_before", "disk_after") if r.get(k)]
    disk_read = max(p["read_bytes_per_s"] for p in probes)
    disk_write = max(p["write_bytes_per_s"] for p in probes)
    steps = range(1 if len(ranks[0]["steps"]) > 1 else 0, len(ranks[0]["steps"]))
    per_step = []
    for i in steps:
        read = sum(r["steps"][i]["bytes_read"] for r in ranks)
        written = sum(r["steps"][i]["bytes_written"] for r in ranks)
        seconds = max(r["steps"][i]["seconds"] for r in ranks)
        io_s = max(r["steps"][i].get("io_s", seconds) for r in ranks)
        cpu = max(r["steps"][i].get("thread_cpu_s", 0.0) for r in ranks)
        busy = disk_busy_s([r["steps"][i] for r in ranks])
        per_step.append(
            (read / seconds, written / seconds, read, written, seconds, io_s, cpu, busy)
        )
    per_step.sort(key=lambda t: t[4])
    tier_read, tier_write, read, written, seconds, io_s, cpu, busy = per_step[len(per_step) // 2]
    disk_s = read / disk_read + written / disk_write
    return {
        "disk_read_bytes_per_s": disk_read,
        "disk_write_bytes_per_s": disk_write,
        "disk_direct_io": all(p["direct"] for p in probes),
        "tier_read_bytes_per_s": tier_read,
        "tier_write_bytes_per_s": tier_write,
        "step_s": seconds,
        "disk_fraction": (read / disk_read + written / disk_write) / seconds,
        "io_s": io_s,
        "io_fraction": (read / disk_read + written / disk_write) / io_s,
        "disk_time_s": disk_s,
        "thread_cpu_s": cpu,
        "disk_fraction_ceiling": disk_s / max(disk_s, cpu, 1e-9),
        "disk_busy_s": busy,
        "disk_busy_fraction": busy / seconds if busy is not None else None,
    }


def disk_busy_s(steps: list[dict[str, Any]]) -> float | None:
    """Seconds of one step (the ranks' records of it) during which a read or write of
    some rank's tier ran: the union of the ranks' ``io_busy`` periods (wall clock),
    clipped to the step's span from the first rank's start to the last rank's end.
    None for records without the periods."""
    if any("io_busy" not in s or "wall" not in s for s in steps):
        return None
    lo, hi = min(s["wall"][0] for s in steps), max(s["wall"][1] for s in steps)
    periods = sorted((max(a, lo), min(b, hi)) for s in steps for a, b in s["io_busy"])
    busy, reach = 0.0, lo
    for a, b in periods:
        start = max(a, reach)
        if b > start:
            busy += b - start
            reach = b
    return busy


def report(cfg: dict[str, Any], ranks: list[dict[str, Any]]) -> str:
    """The Markdown table of a run."""
    params = ranks[0]["params"]
    state = 16 * params
    bw = bandwidth(ranks)
    floor = memory_floor(cfg, ranks)
    lines = [
        f"# FSDP disk tier: GPT {cfg['n_layer']} x {cfg['n_embd']} on {cfg['world']} ranks",
        "",
        f"- parameters: {params:,} ({params / 1e9:.2f}B); model state (fp32 AdamW, 16 B "
        f"per parameter): {state / GIB:.1f} GiB; machine RAM: "
        f"{_mem_total() / GIB:.1f} GiB",
        f"- units: {ranks[0]['units']} per rank; shard per rank {ranks[0]['shard_bytes'] / GIB:.2f}"
        f" GiB; batch {cfg['batch']} x {cfg['seq']} tokens per rank; {cfg['threads']} thread(s)"
        f" per rank; AdamW lr {cfg.get('lr', 3e-4):g}",
        "- disk (O_DIRECT, one unit's size, best of before/after): read "
        f"{bw['disk_read_bytes_per_s'] / 1e9:.2f} GB/s, write "
        f"{bw['disk_write_bytes_per_s'] / 1e9:.2f} GB/s; tier (all ranks, median step "
        f"{bw['step_s']:.2f} s): read {bw['tier_read_bytes_per_s'] / 1e9:.2f} GB/s, write "
        f"{bw['tier_write_bytes_per_s'] / 1e9:.2f} GB/s: {bw['disk_fraction']:.0%} of the "
        f"disk's bandwidth for that mix ({bw['io_fraction']:.0%} while the tier's I/O ran, "
        f"{bw['io_s']:.2f} s of the step)"
        + (
            f"; some rank's reads or writes ran {bw['disk_busy_s']:.2f} s of the step "
            f"({bw['disk_busy_fraction']:.0%})"
            if bw.get("disk_busy_s") is not None
            else ""
        ),
        f"- generations: {cfg.get('generations', 'step')}; disk used by the tier (all ranks, "
        f"sampled every 0.5 s): peak {ranks[0].get('peak_disk_bytes', 0) / GIB:.1f} GiB",
        "- build (meta -> generation 0 on disk): "
        + ", ".join(f"rank {r['rank']} {r['build_s']:.0f} s" for r in ranks),
        *_floor_lines(bw, floor),
        "",
        "| step | loss | rank | step s | read GiB | written GiB | read wait s | RSS MiB | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for index in range(len(ranks[0]["steps"])):
        for r in ranks:
            s = r["steps"][index]
            lines.append(
                f"| {s['step']} | {s['loss']:.4f} | {r['rank']} | {s['seconds']:.1f} | "
                f"{s['bytes_read'] / GIB:.2f} | {s['bytes_written'] / GIB:.2f} | "
                f"{s['read_wait_s']:.1f} | {s['rss'] / 2**20:.0f} | {s['hwm'] / 2**20:.0f} |"
            )
    return "\n".join(lines) + "\n"


def _floor_lines(bw: dict[str, Any], floor: dict[str, Any] | None) -> list[str]:
    """The report's lines on what bounds the step: the disk alone and the training
    thread's CPU seconds; and the same step in memory (with ``--floor``)."""
    disk_s, cpu = bw["disk_time_s"], bw["thread_cpu_s"]
    lines = [
        f"- bound: the disk alone needs {disk_s:.2f} s for the step's bytes; the slowest "
        f"rank's training thread ran {cpu:.2f} s on its core (compute, optimizer, copies, "
        f"page faults; not its waits): a step is at least as long as either, so at most "
        f"{bw['disk_fraction_ceiling']:.0%} of the disk's bandwidth over a step on this CPU "
        f"(reached: {bw['disk_fraction']:.0%})"
    ]
    if floor is not None:
        memory = floor["memory_step_s"]
        how = (
            "measured"
            if floor["extrapolated_from"] is None
            else "extrapolated from "
            + ", ".join(f"{n} layers {t:.2f} s" for n, t in floor["extrapolated_from"].items())
        )
        lines.append(
            f"- the same step in memory (FSDP, AdamW after backward, no disk tier; {how}): "
            f"{memory:.2f} s; disk-tier step / in-memory step {bw['step_s'] / memory:.2f}"
        )
    return lines


def _mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--n-layer", type=int, default=34)
    add("--n-embd", type=int, default=2048)
    add("--n-head", type=int, default=16)
    add("--vocab", type=int, default=256)
    add("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    add("--batch", type=int, default=1, help="sequences per rank (default 1)")
    add("--steps", type=int, default=3)
    add("--lr", type=float, default=ADAMW["lr"], help="AdamW learning rate")
    add("--world", type=int, default=2)
    add("--threads", type=int, default=1, help="intra-op threads per rank (default 1)")
    add("--dir", default=None, help="parent of the offload directory (default: a temp dir)")
    add("--timeout", type=float, default=4 * 3600.0, help="seconds for the whole run")
    add("--probe-mib", type=int, default=64, help="smallest disk probe file (MiB)")
    add(
        "--generations",
        choices=("step", "unit"),
        default="step",
        help="DiskOffload(generations=): 'unit' keeps one generation on disk (default step)",
    )
    add("--fused", action="store_true", help="AdamW(fused=True): torch's vectorised CPU kernel")
    add(
        "--read-ahead-mib",
        type=int,
        default=512,
        help="DiskOffload(read_ahead_bytes=) in MiB: optimizer state the forward reads ahead",
    )
    add(
        "--floor",
        action="store_true",
        help="also time the same step with the model state in memory (FSDP without the "
        "tier; extrapolated from two smaller depths when it does not fit)",
    )
    add("--quick", action="store_true", help="GPT 2 x 128, 2 steps: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.n_layer, args.n_embd, args.n_head, args.steps = 2, 128, 4, 2
    parent = Path(args.dir or tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="fsdp-disk-", dir=parent))
    cfg = {**vars(args), "dir": str(directory), "seq": args.seq}
    try:
        ranks = run_distributed(
            rank_main, args.world, cfg, timeout_s=args.timeout, num_threads=args.threads
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    text = report(cfg, ranks)
    print(text)
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        stem = RESULTS / f"bench_fsdp_disk-{time.strftime('%Y%m%d-%H%M%S')}"
        stem.with_suffix(".md").write_text(text)
        stem.with_suffix(".json").write_text(
            json.dumps(
                {
                    "config": cfg,
                    **bandwidth(ranks),
                    "memory_floor": memory_floor(cfg, ranks),
                    "ranks": ranks,
                },
                indent=1,
            )
        )
        print(f"wrote {stem}.md / .json")


if __name__ == "__main__":
    main()
