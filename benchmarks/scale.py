"""Largest trainable model: for each strategy, the largest GPT that completes one
training step at world size 2 under a fixed memory limit per rank process.

Run::

    python -m benchmarks.scale                     # quick: 1 GiB per rank, GPTs up to 80M
    python -m benchmarks.scale --limit-gb 2 --max-params 1e9 --strategies "torch DDP" \\
        "shardkit fsdp" "shardkit offload (disk)"  # the full search (tens of minutes)

[Note: method]
The candidate GPTs form a ladder (:data:`LADDER`) that grows by depth and
by width in turn, ``(2 x 128)`` to ``(64 x 1536)``, byte-level vocabulary, sequence
length ``--seq-len``; psi grows by 1.2-1.7x per rung. A candidate is tried in fresh
spawned ranks (:func:`benchmarks.compare.run_once`): build, wrap and one training step
(forward, backward, AdamW step) on ``--batch`` sequences per rank. Each rank runs an RSS
watchdog (:func:`benchmarks.common.start_rss_watchdog`) that ends it as soon as its
resident set passes ``--limit-gb``; a run passes when it completes and every rank's peak
resident set (``VmHWM``) stayed within the limit. The search starts at the largest rung
the ZeRO formula of the strategy's stage (fp32 AdamW) plus a measured baseline predicts
to fit and walks up while runs pass, down while they fail; then ``--refine`` runs bisect
(by psi) between the largest passing and the smallest failing shape, by depth and by
width in steps of 64, so a strategy costs 3-6 runs. Rungs above ``--max-params`` are not
tried (a strategy that passes the last one is reported as "at least").
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.common import MIB, RSS_EXIT_CODE, add_run_args, command, machine, timestamp
from benchmarks.compare import num_params, run_once
from benchmarks.runners import BY_NAME
from shardkit.memory import zero_memory_estimate
from shardkit.models import GPTConfig

LADDER: list[tuple[int, int]] = [
    (2, 128), (2, 192), (3, 192), (4, 256), (4, 320), (6, 320), (6, 384), (8, 448),
    (8, 512), (12, 512), (12, 640), (16, 640), (16, 768), (24, 768), (24, 1024),
    (32, 1024), (32, 1280), (48, 1280), (48, 1536), (64, 1536),
]  # fmt: skip
"""(n_layer, n_embd) rungs, psi increasing; n_head = n_embd / 64."""

DEFAULT_STRATEGIES = [
    "torch DDP",
    "torch FSDP2 fully_shard",
    "shardkit oss",
    "shardkit sdp",
    "shardkit fsdp",
    "shardkit fsdp (meta init)",
    "shardkit offload (disk)",
]
BASELINE_BYTES = 400 * MIB  # a rank before its model: Python, torch, gloo (measured ~350 MiB)
WORLD = 2
MEMORY_ERRORS = ("can't allocate memory", "MemoryError", "out of memory", "Cannot allocate")


def rung_config(rung: int, seq_len: int) -> GPTConfig:
    """The GPT of ladder rung ``rung`` (vocabulary 256, ``block_size = seq_len``)."""
    return shape_config(LADDER[rung], seq_len)


def shape_config(shape: tuple[int, int], seq_len: int) -> GPTConfig:
    """The GPT of ``(n_layer, n_embd)`` (vocabulary 256, ``block_size = seq_len``)."""
    n_layer, n_embd = shape
    return GPTConfig(
        vocab_size=256, block_size=seq_len, n_layer=n_layer, n_head=n_embd // 64, n_embd=n_embd
    )


def predicted_rung(stage: int | None, limit: int, rungs: int, seq_len: int) -> int:
    """The largest rung whose ZeRO formula (fp32 AdamW, N = 2) + baseline fits ``limit``;
    the top rung for strategies without a formula (``stage`` None: pipe, and the
    offload disk tier, whose model state is not resident)."""
    if stage is None:
        return rungs - 1
    best = 0
    for rung in range(rungs):
        psi = num_params(rung_config(rung, seq_len))
        need = zero_memory_estimate(psi, WORLD, stage, mixed_precision=False).total
        if BASELINE_BYTES + need <= limit:
            best = rung
    return best


def verdict(record: dict[str, Any], limit: int) -> str:
    """``pass``, ``memory`` (over the limit) or ``error`` for one run record."""
    if "error" in record:
        text = record["error"]
        over = f"code {RSS_EXIT_CODE}" in text or any(m in text for m in MEMORY_ERRORS)
        return "memory" if over else "error"
    peak = max(r["rss_peak"] for r in record["ranks"])
    return "pass" if peak <= limit else "memory"


def between(
    passed: tuple[int, int], failed: tuple[int, int], seq_len: int
) -> tuple[int, int] | None:
    """The shape halfway (by psi) between a passing and a failing one: depth from
    ``passed[0]`` to ``failed[0]``, width in steps of 64 between theirs; None if none
    lies strictly between."""
    low = num_params(shape_config(passed, seq_len))
    high = num_params(shape_config(failed, seq_len))
    shapes = sorted(
        (num_params(shape_config((n, c), seq_len)), (n, c))
        for n in range(passed[0], failed[0] + 1)
        for c in range(passed[1], failed[1] + 1, 64)
    )
    inside = [shape for psi, shape in shapes if low < psi < high]
    return inside[len(inside) // 2] if inside else None


def _try(name: str, shape: tuple[int, int], args: argparse.Namespace, limit: int) -> dict[str, Any]:
    config = shape_config(shape, args.seq_len)
    spec = {
        "strategy": name,
        "model": asdict(config),
        "batch": args.batch,
        "steps": 0,
        "warmup": 1,
        "chunks": 2,
        "memory_limit_bytes": limit,
    }
    record = run_once(spec, WORLD, args.timeout)
    record.update(shape=shape, psi=num_params(config))
    record["verdict"] = verdict(record, limit)
    if "ranks" in record:
        record["peak_rss_bytes"] = [r["rss_peak"] for r in record["ranks"]]
        record["state_bytes"] = [r["state"] for r in record["ranks"]]
        del record["ranks"]
    return record


def search(name: str, args: argparse.Namespace, limit: int, bar: Any) -> dict[str, Any]:
    """Walk the ladder from the predicted rung to the pass / fail boundary."""
    rungs = sum(
        1 for r in range(len(LADDER)) if num_params(rung_config(r, args.seq_len)) <= args.max_params
    )
    strategy = BY_NAME[name]
    stage = None if strategy.state_on_disk else strategy.stage
    rung = predicted_rung(stage, limit, rungs, args.seq_len)
    tries: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    failed: dict[str, Any] | None = None
    while 0 <= rung < rungs:
        bar.set_postfix_str(f"{name} {LADDER[rung][0]}x{LADDER[rung][1]}")
        record = _try(name, LADDER[rung], args, limit)
        tries.append(record)
        bar.update()
        if record["verdict"] == "pass":
            best = record
            if failed is not None:
                break
            rung += 1
        else:
            failed = record
            if best is not None or record["verdict"] == "error":
                break
            rung -= 1
    for _ in range(args.refine if best is not None and failed is not None else 0):
        assert best is not None and failed is not None
        mid = between(best["shape"], failed["shape"], args.seq_len)
        if mid is None:
            break
        bar.set_postfix_str(f"{name} {mid[0]}x{mid[1]}")
        record = _try(name, mid, args, limit)
        tries.append(record)
        bar.update()
        if record["verdict"] == "pass":
            best = record
        elif record["verdict"] == "memory":
            failed = record
        else:
            break
    return {"strategy": name, "best": best, "first_failure": failed, "tries": tries}


def _why(fail: dict[str, Any]) -> str:
    """The table's reason for a failed run: the watchdog's exit code named, else the error."""
    error = str(fail.get("error", ""))
    if f"code {RSS_EXIT_CODE}" in error:
        rank = error.split(":", 1)[0]  # "rank 0"
        return f"memory: {rank} passed the limit (the RSS watchdog ended it)"
    return fail["verdict"] + (f": {error}" if error else "")


def _shape(record: dict[str, Any] | None) -> str:
    if record is None:
        return "-"
    n_layer, n_embd = record["shape"]
    return f"{n_layer} x {n_embd} ({record['psi'] / 1e6:.1f}M)"


def render(doc: dict[str, Any]) -> str:
    """The Markdown page of a search."""
    results = doc["results"]
    ddp = next((r for r in results if r["strategy"] == "torch DDP" and r["best"]), None)
    lines = [
        f"# benchmarks.scale, {doc['started']}",
        "",
        f"Command: `{doc['command']}`",
        "",
        f"Machine: {doc['machine']['cpu_count']} CPUs ({doc['machine']['cpu_model']}), torch "
        f"{doc['machine']['torch']}; load average at start {doc['machine']['loadavg']}, at end "
        f"{doc['loadavg_end']}. Limit {doc['limit_bytes'] / MIB:.0f} MiB resident per rank, "
        f"world size {WORLD}, batch {doc['args']['batch']} x {doc['args']['seq_len']} tokens per "
        f"rank, ladder capped at {doc['args']['max_params']:.3g} parameters.",
        "",
        "| strategy | largest that trains (layers x width, psi) | peak RSS MiB per rank "
        "| psi / DDP's | first that fails | why | runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        best, fail = r["best"], r["first_failure"]
        rss = " / ".join(f"{b / MIB:.0f}" for b in best["peak_rss_bytes"]) if best else "-"
        ratio = f"{best['psi'] / ddp['best']['psi']:.2f}" if best and ddp else "-"
        if best and fail is None:
            ratio += " (at least: the cap)"
        why = "-" if fail is None else _why(fail)
        lines.append(
            f"| {r['strategy']} | {_shape(best)} | {rss} | {ratio} | {_shape(fail)} "
            f"| {why} | {len(r['tries'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the search for every strategy; write JSON and Markdown; return the JSON."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.scale", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    add = p.add_argument
    add(
        "--strategies",
        nargs="+",
        default=DEFAULT_STRATEGIES,
        choices=list(BY_NAME),
        metavar="NAME",
        help=f"strategies to search, by table name (default: {', '.join(DEFAULT_STRATEGIES)})",
    )
    add("--limit-gb", type=float, default=1.0, help="resident GiB per rank (default 1)")
    add("--max-params", type=float, default=8e7, help="largest psi tried (default 8e7)")
    add("--refine", type=int, default=2, help="runs between the last rungs (default 2)")
    add_run_args(p, batch=2)
    args = p.parse_args(argv)
    limit = int(args.limit_gb * 2**30)
    doc: dict[str, Any] = {
        "command": command("benchmarks.scale", argv),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine(),
        "limit_bytes": limit,
        "started": timestamp(),
    }
    with tqdm(desc="scale", unit="run", dynamic_ncols=True) as bar:
        doc["results"] = [search(name, args, limit, bar) for name in args.strategies]
    doc["loadavg_end"] = machine()["loadavg"]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"scale-{doc['started']}"
    page = render(doc)
    Path(f"{stem}.md").write_text(page + "\n")
    Path(f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(page)
    print(f"\nwrote {stem}.json and {stem}.md")
    return doc


if __name__ == "__main__":
    main()
