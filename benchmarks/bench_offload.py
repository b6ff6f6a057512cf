"""OffloadModel: peak RSS and step time of the plain GPT vs the CPU and disk tiers.

Run::

    python -m benchmarks.bench_offload                 # GPT 8 x 512 (25.5M params), batch 8 x 128
    python -m benchmarks.bench_offload --quick         # a small model, 2 steps: a smoke run
    python -m benchmarks.bench_offload --largest --limit-gb 1.5 --n-layer 16 --n-embd 768

Every configuration runs in its own child process (``python -m benchmarks.bench_offload
--child <json>``), so the child's peak resident set (``getrusage().ru_maxrss``) is that
configuration's alone; ``--rounds`` repeats the whole list in turn, so the load from
other processes on a shared machine falls on all configurations alike. A step is
``zero_grad`` + forward + backward + ``step`` with AdamW; one untimed warm-up step,
then ``--steps`` timed ones. Reported: median step time and its ratio to the plain
model, peak RSS and its growth over the RSS after ``import torch`` and one optimizer
step on a single element (the interpreter, torch with its lazy imports, shardkit: the
same for every configuration), and the model-state bytes
(16 bytes per parameter for fp32 AdamW).

Configurations: ``plain`` (the GPT, no wrapper), ``cpu`` (OffloadModel with
``device == offload_device == cpu``: nothing moves; the cost of the slicing machinery),
``cpu-copy`` (``MemoryTier(cpu, cpu)``: every load/offload really copies, the CUDA code
path), ``disk`` (the disk tier, model built on ``meta`` and initialised slice by slice).
Offloaded configurations use activation checkpointing.

``--largest`` runs one disk-tier step of the given GPT in a child whose address space is
capped with ``RLIMIT_AS`` (``ulimit -v``) at ``--limit-gb``, below the model state, and
the plain model under the same cap (expected to fail with an out-of-memory error).

For the disk configurations the child also measures the disk's own sequential read
and write bandwidth in the tier's directory before and after its steps
(:mod:`benchmarks.disk_bandwidth`: ``O_DIRECT``, a file as large as one slice's files)
and the bytes the tier's files moved per step; the results JSON holds
``disk_read_bytes_per_s``, ``disk_write_bytes_per_s``, ``tier_read_bytes_per_s``,
``tier_write_bytes_per_s`` and ``disk_fraction`` per disk run and, at its top, for the
disk run with the most slices (``--disk-only`` runs only those).

Markdown goes to stdout, raw numbers to ``benchmarks/results/bench_offload-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

from benchmarks.common import ADAMW, RESULTS, peak_rss_bytes
from benchmarks.disk_bandwidth import measure
from shardkit.models import GPT, GPTConfig, gpt_init_fn, gpt_stages
from shardkit.nn.offload import MemoryTier, OffloadModel

MB = 2**20


def _warm_up() -> None:
    """One optimizer step on one element: torch's lazy imports land before the baseline."""
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p])
    p.sum().backward()
    opt.step()


def _build(cfg: dict[str, Any], directory: str) -> tuple[Any, Any, int]:
    """``(loss_fn, optimizer, num_params)`` of one configuration."""
    config = GPTConfig(
        vocab_size=256,
        block_size=cfg["seq"],
        n_layer=cfg["n_layer"],
        n_head=cfg["n_head"],
        n_embd=cfg["n_embd"],
    )
    tier, slices = cfg["tier"], cfg.get("slices", 1)
    adamw = {**ADAMW, **({"fused": True} if cfg.get("fused") else {})}
    if tier == "plain":
        model = GPT(config)
        opt: Any = torch.optim.AdamW(model.parameters(), **adamw)
        return (lambda x, y: model(x, targets=y)[1]), opt, model.num_parameters()
    kwargs: dict[str, Any] = {"num_slices": slices, "checkpoint_activation": True}
    if tier == "disk":
        with torch.device("meta"):
            gpt = GPT(config)
        om = OffloadModel(
            gpt_stages(gpt),
            "cpu",
            offload_dir=directory,
            param_init_fn=gpt_init_fn,
            disk_io_bytes=cfg.get("disk_io_mib", 0) * MB,
            **kwargs,
        )
        opt = om.sliced_optimizer(torch.optim.AdamW, **adamw)
    else:
        gpt = GPT(config)
        target = (
            MemoryTier(torch.device("cpu"), torch.device("cpu")) if tier == "cpu-copy" else "cpu"
        )
        om = OffloadModel(gpt_stages(gpt), "cpu", offload_device=target, **kwargs)
        opt = torch.optim.AdamW(om.parameters(), **adamw)

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(om(x).flatten(0, 1), y.flatten())

    return loss_fn, opt, sum(s.numel() for _, s in om.named_slices())


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """Build one configuration, run its steps; peak RSS and step times (this process)."""
    torch.set_num_threads(cfg.get("threads", 1))
    _warm_up()
    torch.manual_seed(0)
    rss_import = peak_rss_bytes()
    with tempfile.TemporaryDirectory(dir=cfg.get("tmp")) as directory:
        loss_fn, opt, num_params = _build(cfg, directory)
        rss_built = peak_rss_bytes()
        x = torch.randint(0, 256, (cfg["batch"], cfg["seq"]))
        store = getattr(getattr(opt, "tier", None), "store", None)  # the disk tier's files
        probing = store is not None and "probe_mib" in cfg  # not in tests' runs
        probes = [_probe(directory, num_params, cfg)] if probing else []
        times, moved, cpu = [], [], []
        for _ in range(cfg["steps"] + 1):
            before = (store.bytes_read, store.bytes_written) if store is not None else (0, 0)
            start, thread = time.perf_counter(), time.thread_time()
            opt.zero_grad()
            loss_fn(x, x).backward()
            opt.step()
            times.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - thread)
            if store is not None:
                moved.append((store.bytes_read - before[0], store.bytes_written - before[1]))
        if probing:
            probes.append(_probe(directory, num_params, cfg))
    out = {
        **cfg,
        "params": num_params,
        "rss_import": rss_import,
        "rss_built": rss_built,
        "rss_peak": peak_rss_bytes(),
        "times": times[1:],
        "thread_cpu_s": cpu[1:],
    }
    if probes:
        out.update(_bandwidth(probes, times[1:], moved[1:]))
        disk_s, thread_s = out["disk_time_s"], statistics.median(cpu[1:])
        out["disk_fraction_ceiling"] = disk_s / max(disk_s, thread_s, 1e-9)
    return out


def _probe(directory: str, num_params: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """The disk's own bandwidth in the tier's directory, with a file as large as one
    slice's files (parameters and AdamW's two moments: 12 bytes per parameter)."""
    one_slice = 12 * num_params // cfg.get("slices", 1)
    return measure(directory, max(one_slice, cfg.get("probe_mib", 64) * MB)).to_json()


def _bandwidth(
    probes: list[dict[str, Any]], times: list[float], moved: list[tuple[int, int]]
) -> dict[str, Any]:
    """The disk's bandwidth (best of the probes before and after the steps) and the
    tier's (bytes the tier's files moved in a step over the step's time, median step);
    ``disk_fraction`` is ``(R / disk_read + W / disk_write) / step_s`` (1.0: the disk
    busy at its own speed for the whole step)."""
    disk_read = max(p["read_bytes_per_s"] for p in probes)
    disk_write = max(p["write_bytes_per_s"] for p in probes)
    steps = sorted(zip(times, moved, strict=True))
    seconds, (read, written) = steps[len(steps) // 2]
    return {
        "disk_read_bytes_per_s": disk_read,
        "disk_write_bytes_per_s": disk_write,
        "disk_direct_io": all(p["direct"] for p in probes),
        "tier_read_bytes_per_s": read / seconds,
        "tier_write_bytes_per_s": written / seconds,
        "tier_bytes_per_step": [read, written],
        "disk_fraction": (read / disk_read + written / disk_write) / seconds,
        "disk_time_s": read / disk_read + written / disk_write,
    }


def _run_child(
    cfg: dict[str, Any], limit_bytes: int | None = None, env: dict[str, str] | None = None
) -> dict[str, Any]:
    def cap() -> None:
        if limit_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_offload", "--child", json.dumps(cfg)],
        capture_output=True,
        text=True,
        preexec_fn=cap,
        env=None if env is None else {**os.environ, **env},
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {**cfg, "error": tail}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _configs(args: argparse.Namespace) -> list[dict[str, Any]]:
    base = {
        "n_layer": args.n_layer,
        "n_embd": args.n_embd,
        "n_head": args.n_head,
        "seq": args.seq,
        "batch": args.batch,
        "steps": args.steps,
        "tmp": args.tmp,
        "probe_mib": args.probe_mib,
        "disk_io_mib": args.disk_io_mib,
        "fused": args.fused,
    }
    if args.disk_only:
        return [{**base, "tier": "disk", "slices": slices} for slices in args.slices]
    configs = [{**base, "tier": "plain"}]
    for slices in args.slices:
        configs += [{**base, "tier": t, "slices": slices} for t in ("cpu", "disk")]
    configs.append({**base, "tier": "cpu-copy", "slices": max(args.slices)})
    return configs


def _name(cfg: dict[str, Any]) -> str:
    return cfg["tier"] if cfg["tier"] == "plain" else f"{cfg['tier']} n={cfg['slices']}"


def _by_name(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The runs of each configuration (``_name``), over the rounds, in run order."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_name.setdefault(_name(r), []).append(r)
    return by_name


def _table(runs: list[dict[str, Any]]) -> str:
    by_name = _by_name(runs)
    plain = by_name.get("plain") or next(iter(by_name.values()))
    base_time = statistics.median(t for r in plain for t in r["times"])
    base_growth = statistics.median(r["rss_peak"] - r["rss_import"] for r in plain)
    state = 16 * plain[0]["params"]
    lines = [
        f"GPT {plain[0]['n_layer']} x {plain[0]['n_embd']}, {plain[0]['params'] / 1e6:.1f}M "
        f"params, model state (fp32 AdamW) {state / MB:.0f} MB, batch {plain[0]['batch']} x "
        f"{plain[0]['seq']}, 1 thread",
        "",
        "| config | step s (median) | x plain | peak RSS MB | growth over import MB | "
        "x plain growth | state/n MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rs in by_name.items():
        step = statistics.median(t for r in rs for t in r["times"])
        peak = statistics.median(r["rss_peak"] for r in rs)
        growth = statistics.median(r["rss_peak"] - r["rss_import"] for r in rs)
        per_slice = state / rs[0].get("slices", 1) / MB if name != "plain" else state / MB
        lines.append(
            f"| {name} | {step:.2f} | {step / base_time:.2f} | {peak / MB:.0f} | "
            f"{growth / MB:.0f} | {growth / base_growth:.2f} | {per_slice:.0f} |"
        )
    lines += [
        "",
        "| disk tier | disk read GB/s | disk write GB/s | tier read GB/s | "
        "tier write GB/s | fraction of the disk | disk alone s | training thread CPU s | "
        "ceiling | in memory s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rs in by_name.items():
        for r in (r for r in rs if "disk_fraction" in r):
            memory = _memory_step_s(by_name, r)
            thread_s = statistics.median(r["thread_cpu_s"])
            lines.append(
                f"| {name} | {r['disk_read_bytes_per_s'] / 1e9:.2f} | "
                f"{r['disk_write_bytes_per_s'] / 1e9:.2f} | "
                f"{r['tier_read_bytes_per_s'] / 1e9:.2f} | "
                f"{r['tier_write_bytes_per_s'] / 1e9:.2f} | {r['disk_fraction']:.0%} | "
                f"{r['disk_time_s']:.2f} | {thread_s:.2f} | {r['disk_fraction_ceiling']:.0%} | "
                f"{'' if memory is None else f'{memory:.2f}'} |"
            )
    lines += [
        "",
        "disk alone: the seconds the disk needs for the step's bytes at its own speed; "
        "training thread CPU: its CPU seconds in the step (compute, optimizer, copies, page "
        "faults; not waits); ceiling: disk alone / the longer of the two, the most of the "
        "disk's bandwidth a step can use on this CPU; in memory: the median step of the cpu "
        "tier with as many slices (same slicing and checkpointing, nothing moved; not run "
        "with --disk-only)",
    ]
    return "\n".join(lines)


def _memory_step_s(
    by_name: dict[str, list[dict[str, Any]]], disk_run: dict[str, Any]
) -> float | None:
    """The median step of the cpu tier with ``disk_run``'s slices (None if not run)."""
    cpu = by_name.get(f"cpu n={disk_run['slices']}")
    return statistics.median(t for r in cpu for t in r["times"]) if cpu else None


def _disk_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The bandwidth keys of the disk run with the most slices (median fraction over
    its rounds), for the top of the results JSON."""
    disk = [r for r in runs if "disk_fraction" in r]
    if not disk:
        return {}
    most = max(r["slices"] for r in disk)
    chosen = sorted((r for r in disk if r["slices"] == most), key=lambda r: r["disk_fraction"])
    keys = (
        "disk_read_bytes_per_s",
        "disk_write_bytes_per_s",
        "tier_read_bytes_per_s",
        "tier_write_bytes_per_s",
        "disk_fraction",
    )
    summary = {k: chosen[len(chosen) // 2][k] for k in keys}
    by_name = _by_name(runs)
    summary["disk_fraction_ceiling"] = chosen[len(chosen) // 2]["disk_fraction_ceiling"]
    memory = _memory_step_s(by_name, chosen[0])
    if memory is not None:
        summary["memory_step_s"] = memory
    return summary


def _largest(args: argparse.Namespace) -> dict[str, Any]:
    limit = int(args.limit_gb * 2**30)
    cfg = {
        "n_layer": args.n_layer,
        "n_embd": args.n_embd,
        "n_head": args.n_head,
        "seq": args.seq,
        "batch": args.batch,
        "steps": 1,
        "tmp": args.tmp,
    }
    disk = _run_child({**cfg, "tier": "disk", "slices": args.slices[-1]}, limit)
    plain = _run_child({**cfg, "tier": "plain"}, limit)
    return {"limit_bytes": limit, "disk": disk, "plain": plain}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="small model, 2 steps, 1 round")
    parser.add_argument("--largest", action="store_true", help="one disk-tier step under a cap")
    parser.add_argument("--limit-gb", type=float, default=1.5, help="address-space cap (GiB)")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slices", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tmp", default=None, help="where the disk tier writes (default: TMPDIR)")
    parser.add_argument("--disk-only", action="store_true", help="only the disk configurations")
    parser.add_argument(
        "--fused", action="store_true", help="AdamW(fused=True) in every configuration"
    )
    parser.add_argument("--probe-mib", type=int, default=64, help="smallest disk probe (MiB)")
    parser.add_argument(
        "--disk-io-mib",
        type=int,
        default=512,
        help="OffloadModel(disk_io_bytes=...) of the disk configurations, MiB (default 512)",
    )
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.quick:
        args.n_layer, args.n_embd, args.n_head, args.seq, args.batch = 6, 128, 4, 64, 4
        args.steps, args.rounds = 2, 1
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.largest:
        out: dict[str, Any] = _largest(args)
        print(json.dumps(out, indent=1))
    else:
        runs = [_run_child(cfg) for _ in range(args.rounds) for cfg in _configs(args)]
        failed = [r for r in runs if "error" in r]
        if failed:
            raise SystemExit(f"{len(failed)} configurations failed: {failed[0]}")
        print(_table(runs))
        out = {**_disk_summary(runs), "runs": runs}
    path = RESULTS / f"bench_offload-{'largest-' if args.largest else ''}{stamp}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"\nraw numbers: {path}")


if __name__ == "__main__":
    main()
