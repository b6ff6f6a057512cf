"""Reporting: the link-byte formulas, one summary row per strategy, the markdown table.

[Note: what is measured]
Each strategy runs in fresh processes (one pair of agents per strategy and rate):
build the GPT (same seed everywhere), ``--warmup`` untimed steps, then ``--steps``
timed steps, each forward, backward, optimizer step; a step's time is the slowest
rank's. Bytes across the link are counted by the kernel: the veth's ``tx_bytes``
(``/proc/net/dev`` of each namespace: Ethernet frames, TCP/IP headers included),
read by each node's local rank 0 after a barrier before and after the timed steps;
both directions together, divided by steps (and by the world size for "per rank").
Besides the gradient and parameter traffic this includes the barriers and loss
all-reduces of the timed steps and the agents' rendezvous keep-alives (bytes,
not kilobytes). ``benchmarks.comm`` also counts every collective each rank issues
(ring-model volume, all groups, intra-node included).

Formulas (elements per rank per step, psi parameters, W = R x S ranks, R nodes of S
ranks; the ring model for collectives over all W ranks, node-major, with R edges of
the ring crossing nodes): hybrid (shardkit hsdp, torch HSDP) all-reduces only its
1/S gradient shard across the R replicas: ``2 psi (R - 1) / (R S)``, whatever the
all-reduce algorithm for R = 2. DDP: ``R * 2 psi (W - 1) / W / W``; full shard
(ZeRO-3, gather + gather + reduce-scatter): ``R * 3 psi (W - 1) / W / W``. gloo's
algorithms for the W-rank collectives need not be rings: the measured column says
what they did.

"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.two_nodes.netem import NNODES, NPROC_PER_NODE
from benchmarks.two_nodes.rows import LINK_FORMULA

__all__ = ["bytes_formula", "render_markdown", "summarize"]


# --------------------------------------------------------------------------- formulas
def bytes_formula(
    kind: str, psi: int, replicas: int, shard: int, bytes_per_element: int = 4
) -> float | None:
    """Bytes each rank sends across nodes per step, by the formulas of [Note: what is
    measured]; ``kind``: ``ddp``, ``full_shard``, ``hybrid`` or ``hybrid_half`` (hybrid
    with bf16 / fp16 compression: 2 bytes per element). None for another kind
    (PowerSGD: depends on the shard shapes)."""
    world = replicas * shard
    if kind == "hybrid_half":  # hybrid + bf16 / fp16 compression: 2 bytes per element
        return bytes_formula("hybrid", psi, replicas, shard, bytes_per_element=2)
    if kind == "hybrid":
        elements = 2 * psi * (replicas - 1) / (replicas * shard)
    elif kind == "ddp":
        elements = replicas * 2 * psi * (world - 1) / world / world
    elif kind == "full_shard":
        elements = replicas * 3 * psi * (world - 1) / world / world
    else:
        return None
    return elements * bytes_per_element


# -------------------------------------------------------------------------- summary
def summarize(
    records: list[dict[str, Any]], psi: int, rate: str, replicas: int = NNODES
) -> list[dict[str, Any]]:
    """One row per strategy of one rate (its records of every round together): step
    time (median over every timed step), ratio to DDP (the median over rounds of the
    round's median over DDP's in the same round, and each round's), link bytes per step
    (total and per rank) against the formula, loss vs DDP (largest difference, same
    round)."""
    world = replicas * NPROC_PER_NODE
    names = list(dict.fromkeys(rec["strategy"] for rec in records))
    ok = [rec for rec in records if "times" in rec]
    ddp = {rec.get("round", 0): rec for rec in ok if rec["strategy"] == "torch DDP"}
    rows = []
    for name in names:
        row: dict[str, Any] = {"strategy": name, "rate": rate}
        mine = [rec for rec in ok if rec["strategy"] == name]
        if not mine:
            failed = next(rec for rec in records if rec["strategy"] == name)
            row["status"] = failed.get("error", "not run")
            rows.append(row)
            continue
        times = [t for rec in mine for t in rec["times"]]
        steps = len(times)
        rounds = [
            statistics.median(rec["times"]) / statistics.median(ddp[rec.get("round", 0)]["times"])
            for rec in mine
            if rec.get("round", 0) in ddp
        ]
        nodes = [r for rec in mine for r in rec["ranks"] if r["tx_bytes"] is not None]
        link = sum(r["tx_bytes"] for r in nodes)
        per_rank = link / steps / world
        formula = LINK_FORMULA[name]
        expected = bytes_formula(formula, psi, replicas, NPROC_PER_NODE) if formula else None
        comm_volume = sum(
            statistics.mean(r["comm"]["total_volume_bytes"] for r in rec["ranks"]) for rec in mine
        )
        packets = sum(r.get("tx_packets") or 0 for r in nodes)
        drops = [r.get("tbf_drops") for r in nodes]
        losses = [
            abs(a - b)
            for rec in mine
            if rec.get("round", 0) in ddp
            for a, b in zip(rec["losses"], ddp[rec.get("round", 0)]["losses"])
        ]
        row.update(
            status="ok",
            rounds=len(mine),
            step_s=statistics.median(times),
            step_s_all=times,
            x_ddp=statistics.median(rounds) if rounds else None,
            x_ddp_rounds=rounds,
            link_bytes_per_step=link / steps,
            link_bytes_per_step_per_rank=per_rank,
            formula_bytes_per_rank=expected,
            x_formula=per_rank / expected if expected else None,
            comm_volume_per_step_per_rank=comm_volume / steps,
            link_bytes_per_packet=link / packets if packets else None,
            tbf_drops=sum(drops) if drops and None not in drops else None,
            loss_final=mine[-1]["losses"][-1],
            loss_vs_ddp=max(losses) if losses else None,
        )
        rows.append(row)
    full = next((r for r in rows if r["strategy"] == "shardkit fsdp" and "step_s" in r), None)
    for row in rows:
        if full and "step_s" in row:
            row["x_full_shard_bytes"] = (
                row["link_bytes_per_step"] / full["link_bytes_per_step"]
                if full["link_bytes_per_step"]
                else None
            )
    return rows


def _fmt(value: Any, spec: str) -> str:
    return (
        "-" if value is None or (isinstance(value, float) and math.isnan(value)) else spec % value
    )


def _ratio(row: Mapping[str, Any]) -> str:
    """x DDP, with each round's ratio in brackets where there were several rounds."""
    text = _fmt(row.get("x_ddp"), "%.2f")
    rounds = row.get("x_ddp_rounds") or []
    if len(rounds) > 1:
        text += " [" + ", ".join(f"{r:.2f}" for r in rounds) + "]"
    return text


def render_markdown(rows: list[dict[str, Any]], notes: Sequence[str] = ()) -> str:
    """The table of :func:`summarize`'s rows (all rates)."""
    head = (
        "| link | strategy | step s (median) | x DDP | link MiB/step (both ways) | "
        "per rank MiB | formula MiB/rank | x formula | x full shard | loss vs DDP |"
    )
    lines = [head, "|" + "---|" * 10]
    mib = 2**20
    for row in rows:
        if row.get("status") != "ok":
            status = " ".join(str(row.get("status", "-")).split()).replace("|", "/")[:300]
            lines.append(
                f"| {row['rate']} | {row['strategy']} | {status} | - | - | - | - | - | - | - |"
            )
            continue
        formula = row["formula_bytes_per_rank"]
        lines.append(
            f"| {row['rate']} | {row['strategy']} | {row['step_s']:.3f} "
            f"| {_ratio(row)} | {row['link_bytes_per_step'] / mib:.2f} "
            f"| {row['link_bytes_per_step_per_rank'] / mib:.3f} "
            f"| {_fmt(formula / mib if formula else None, '%.3f')} "
            f"| {_fmt(row['x_formula'], '%.2f')} | {_fmt(row.get('x_full_shard_bytes'), '%.2f')} "
            f"| {_fmt(row['loss_vs_ddp'], '%.1e')} |"
        )
    return "\n".join([*lines, "", *(f"- {n}" for n in notes)]) + "\n"
