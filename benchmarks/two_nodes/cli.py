"""The command line (``python -m benchmarks.two_nodes``): the run over rates and rounds,
``--dry-run``, ``--cleanup``, ``--worker`` (a rank's body); the results files."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.two_nodes.launch import REPO, agent_command, run_strategy
from benchmarks.two_nodes.netem import (
    NNODES,
    NPROC_PER_NODE,
    Interrupted,
    cluster_for,
    emulated_cluster,
    kill_namespace_processes,
    leftover_namespaces,
    parse_rate,
    preflight,
    run_command,
    setup_commands,
    teardown_commands,
)
from benchmarks.two_nodes.report import render_markdown, summarize
from benchmarks.two_nodes.rows import STRATEGY_NAMES, strategies, unavailable_reason
from benchmarks.two_nodes.worker import worker

__all__ = ["main"]


# ------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.two_nodes",
        description="2 nodes x 2 ranks in network namespaces over a tc-capped veth link.",
    )
    add = parser.add_argument
    add("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    add("--rate", nargs="+", default=["1gbit"], help="link rate(s), tc syntax (default 1gbit)")
    add("--model-size", default="tiny", help="GPT size (benchmarks.compare's; default tiny)")
    add("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    add("--batch", type=int, default=4, help="sequences per rank (default 4)")
    add("--steps", type=int, default=3, help="timed steps (default 3)")
    add("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    add("--rounds", type=int, default=1, help="rounds, the order rotated each (default 1)")
    add("--strategies", nargs="+", default=list(STRATEGY_NAMES), help="rows to run")
    add("--timeout", type=float, default=300.0, help="seconds per strategy (default 300)")
    add(
        "--retries",
        type=int,
        default=1,
        help="re-runs of a strategy whose worker crashed in native code (default 1)",
    )
    add("--out", type=Path, default=REPO / "benchmarks" / "results", help="results folder")
    add("--dry-run", action="store_true", help="print the commands and exit")
    add("--cleanup", action="store_true", help="remove namespaces left by a killed run")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        return worker(args.worker)
    unknown = [s for s in args.strategies if s not in STRATEGY_NAMES]
    if unknown:
        print(f"unknown strategies {unknown}; choose from {list(STRATEGY_NAMES)}", file=sys.stderr)
        return 2
    for rate in args.rate:
        parse_rate(rate)
    if args.dry_run:
        cluster = cluster_for(os.getpid(), args.rate[0])
        for cmd in [
            *setup_commands(cluster),
            *(agent_command(cluster, n, "SPEC", "ID") for n in (0, 1)),
        ]:
            print(" ".join(cmd))
        for cmd in teardown_commands(cluster):
            print(" ".join(cmd))
        return 0
    reason = preflight()
    if reason is not None:
        print(f"benchmarks.two_nodes: {reason}", file=sys.stderr)
        return 2
    if args.cleanup:
        for ns in leftover_namespaces():
            kill_namespace_processes(ns)
            run_command(["ip", "netns", "delete", ns], check=False)
            print(f"removed {ns}")
        return 0
    try:
        return _bench(args, argv)
    except Interrupted as err:  # the namespaces are gone already (emulated_cluster)
        print(f"benchmarks.two_nodes: interrupted by {err}; namespaces removed", file=sys.stderr)
        return 130


def _bench(args: argparse.Namespace, argv: list[str] | None) -> int:
    from benchmarks.common import command, machine, timestamp
    from benchmarks.compare import model_config, num_params

    config = model_config(args.model_size, args.seq_len)
    psi = num_params(config)
    spec = {
        "model": dataclasses.asdict(config),
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "pg_timeout": int(args.timeout),
    }
    rows_by_name = strategies()
    notes, records_by_rate = [], {}
    start_machine = machine()
    stamp = timestamp()
    run_list = []
    for name in args.strategies:
        why = unavailable_reason(rows_by_name[name])
        if why:
            notes.append(f"{name}: {why}")
        else:
            run_list.append(name)
    with tempfile.TemporaryDirectory(prefix="shardkit-two-nodes-") as tmp:
        os.chmod(tmp, 0o777)
        for k, rate in enumerate(args.rate):
            cluster = cluster_for(f"{os.getpid()}{k}", rate)
            spec["veths"] = list(cluster.veths)
            records = []
            with emulated_cluster(cluster):
                # round r runs the strategies rotated by r: the load of the moment falls
                # on all of them alike and none always runs first
                order = [
                    (r, run_list[(i + r) % len(run_list)])
                    for r in range(args.rounds)
                    for i in range(len(run_list))
                ]
                for round_index, name in order:
                    print(f"[{rate}] {name} ...", file=sys.stderr, flush=True)
                    rec = run_strategy(cluster, name, spec, Path(tmp), args.timeout)
                    failed: list[str] = []
                    while "error" in rec and rec.get("crashed") and len(failed) < args.retries:
                        failed.append(rec["error"])  # a native crash, not a Python error: again
                        print(f"[{rate}] {name}: {rec['error'][:200]}; again", file=sys.stderr)
                        rec = run_strategy(cluster, name, spec, Path(tmp), args.timeout)
                    rec["failed_attempts"] = failed
                    rec["round"] = round_index
                    print(
                        f"[{rate}] {name}: {rec.get('error') or statistics.median(rec['times'])}",
                        file=sys.stderr,
                        flush=True,
                    )
                    records.append(rec)
            records_by_rate[rate] = records
    rows = []
    for rate, records in records_by_rate.items():
        rows += summarize(records, psi, rate)
    notes = [
        f"GPT {args.model_size}: psi = {psi} parameters; {NNODES} nodes x {NPROC_PER_NODE} "
        f"ranks, batch {args.batch} x {args.seq_len} per rank, {args.steps} timed steps "
        f"after {args.warmup} warm-up in each of {args.rounds} round(s), fp32 AdamW, gloo",
        *notes,
    ]
    table = render_markdown(rows, notes)
    out: dict[str, Any] = {
        "command": command("benchmarks.two_nodes", argv),
        "machine_start": start_machine,
        "machine_end": machine(),
        "psi": psi,
        "model": dataclasses.asdict(config),
        "spec": {k: v for k, v in spec.items() if k != "veths"},
        "rows": rows,
        "records": records_by_rate,
        "notes": notes,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"two_nodes-{stamp}"
    base.with_suffix(".json").write_text(json.dumps(out, indent=1))
    base.with_suffix(".md").write_text(
        f"`{out['command']}`; load average {start_machine['loadavg']} -> "
        f"{out['machine_end']['loadavg']} on {start_machine['cpu_count']} cores\n\n{table}"
    )
    print(table)
    print(f"wrote {base}.json and .md")
    return 0 if any(r.get("status") == "ok" for r in rows) else 1
