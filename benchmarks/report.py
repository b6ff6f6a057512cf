"""From the runs of :mod:`benchmarks.compare` to summary rows, a Markdown table and plots.

:func:`summarize` turns run records (one per strategy, world size, model size and
round; each with every rank's result or an error) into one row per (world size, model
size, strategy); :func:`render_markdown` prints them; :func:`write_plots` draws the
per-rank model-state bytes against the world size with the ZeRO formula lines, and
the step-time ratio to torch DDP.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks.comm import theory_volume_bytes
from shardkit.extras import require
from shardkit.memory import zero_memory_estimate

BASELINE = "torch DDP"
MIB = 2**20
Row = dict[str, Any]


def _quartiles(times: list[float]) -> tuple[float, float]:
    if len(times) < 2:
        return times[0], times[0]
    q = statistics.quantiles(times, n=4, method="inclusive")
    return q[0], q[2]


def _model_bytes(state: dict[str, int]) -> int:
    """Parameters + gradients + optimizer state (what the ZeRO formula covers)."""
    return state["parameters"] + state["gradients"] + state["optimizer_state"]


def _timing(ok: list[dict[str, Any]], tokens_per_step: int) -> Row:
    times = [t for r in ok for t in r["ranks"][0]["times"]]
    median = statistics.median(times)
    q1, q3 = _quartiles(times)
    return {
        "median_s": median,
        "q1_s": q1,
        "q3_s": q3,
        "min_s": min(times),
        "max_s": max(times),
        "n_steps": len(times),
        "tokens_per_s": tokens_per_step / median,
        "round_medians": {r["round"]: statistics.median(r["ranks"][0]["times"]) for r in ok},
    }


def _memory(ok: list[dict[str, Any]], world: int, psi: int, stage: int | None) -> Row:
    states = [ok[-1]["ranks"][k]["state"] for k in range(world)]
    row: Row = {
        "peak_rss_bytes": [max(r["ranks"][k]["rss_peak"] for r in ok) for k in range(world)],
        "rss_start_bytes": [max(r["ranks"][k]["rss_start"] for r in ok) for k in range(world)],
        "state_bytes": states,
    }
    curves = [_rss_curve(r) for r in ok if all("rss_steps" in k for k in r["ranks"])]
    if curves:
        row["rss_steps_bytes"] = curves  # per round: each step's peak, the largest rank
        row["rss_steps_kind"] = ok[0]["ranks"][0].get("rss_steps_kind", "per step")
    if stage is not None:
        formula = zero_memory_estimate(psi, world, stage, mixed_precision=False).total
        row["formula_bytes"] = formula
        row["state_over_formula"] = max(_model_bytes(s) for s in states) / formula
    return row


def _rss_curve(record: dict[str, Any]) -> list[int]:
    """The peak resident set of every step of one run, the largest rank's (bytes)."""
    return [max(step) for step in zip(*(rank["rss_steps"] for rank in record["ranks"]))]


def _comm(ok: list[dict[str, Any]], world: int, psi: int, stage: int | None) -> Row:
    volumes: list[float] = []
    payload: dict[str, list[float]] = {}
    for r in ok:
        steps = len(r["ranks"][0]["times"])
        for rank in r["ranks"]:
            volumes.append(rank["comm"]["total_volume_bytes"] / steps)
            for kind, b in rank["comm"]["payload_bytes"].items():
                payload.setdefault(kind, []).append(b / steps)
    count = len(volumes)
    row: Row = {
        "comm_volume_bytes": statistics.fmean(volumes),
        "comm_payload_bytes": {k: sum(v) / count for k, v in payload.items()},
    }
    if stage is not None and world > 1:
        theory = theory_volume_bytes(psi, world, stage)
        row["comm_theory_bytes"] = theory
        row["comm_over_theory"] = row["comm_volume_bytes"] / theory
    return row


def _global_losses(ok: list[dict[str, Any]]) -> list[float]:
    """The loss of every step of the first successful run, averaged over the ranks (the
    global batch's loss: every rank holds an equal share; pipe ranks all hold it)."""
    per_rank = [r.get("losses", []) for r in ok[0]["ranks"]]
    return [statistics.fmean(step) for step in zip(*per_rank)]


def _add_loss_check(rows: list[Row]) -> None:
    """``loss_vs_ddp``: the largest difference, over the steps, between this strategy's
    loss and torch DDP's on the same data from the same initial model (0 up to fp32
    rounding for a strategy that trains like DDP)."""
    base = {(r["world_size"], r["model_size"]): r for r in rows if r["strategy"] == BASELINE}
    for row in rows:
        ddp = base.get((row["world_size"], row["model_size"]), {})
        mine, theirs = row.get("losses", []), ddp.get("losses", [])
        if mine and len(mine) == len(theirs):
            row["loss_vs_ddp"] = max(abs(a - b) for a, b in zip(mine, theirs))


def _add_ratios(rows: list[Row]) -> None:
    """``x_ddp`` (ratio of medians) and ``paired`` (per-round ratios) against DDP."""
    base = {(r["world_size"], r["model_size"]): r for r in rows if r["strategy"] == BASELINE}
    for row in rows:
        ddp = base.get((row["world_size"], row["model_size"]))
        if ddp is None or "median_s" not in ddp or "median_s" not in row:
            continue
        row["x_ddp"] = row["median_s"] / ddp["median_s"]
        paired = [
            m / ddp["round_medians"][k]
            for k, m in row["round_medians"].items()
            if k in ddp["round_medians"]
        ]
        if paired:
            row["paired_rounds"] = paired
            row["x_ddp_paired"] = statistics.median(paired)


def _paired(row: Row, base: Row) -> list[float]:
    """``row``'s round medians over ``base``'s, round by round (both ran in each round)."""
    theirs = base.get("round_medians", {})
    return [m / theirs[k] for k, m in row.get("round_medians", {}).items() if k in theirs]


def _add_compile(rows: list[Row]) -> None:
    """For a compiled row (``compiled_from``: its eager row): ``x_eager_paired`` (the
    eager row's step time over this one's, paired by round: the speedup) and
    ``compile_s`` (the median over rounds of this row's first step minus the eager
    row's first step: the compile, excluded from the timed steps)."""
    by_key = {(r["world_size"], r["model_size"], r["strategy"]): r for r in rows}
    for row in rows:
        eager = by_key.get((row["world_size"], row["model_size"], row.get("compiled_from")))
        if eager is None or "round_medians" not in row or "round_medians" not in eager:
            continue
        speedups = [1 / v for v in _paired(row, eager)]
        if speedups:
            row["x_eager_rounds"] = speedups
            row["x_eager_paired"] = statistics.median(speedups)
        firsts = [
            row["first_step_s"][k] - eager["first_step_s"][k]
            for k in row["first_step_s"]
            if k in eager["first_step_s"]
        ]
        if firsts:
            row["compile_s"] = statistics.median(firsts)


def summarize(records: Iterable[dict[str, Any]], batch: int, seq_len: int) -> list[Row]:
    """One row per (world size, model size, strategy), in first-run order.

    Args:
        records: run records (``strategy`` in ``spec``, ``world_size``, ``model_size``,
            ``round``, ``psi``, ``stage`` and ``ranks`` or ``error``).
        batch: sequences per rank; seq_len: tokens per sequence (for tokens/s).

    Returns:
        Rows with the timing (``median_s``, ``q1_s``, ``q3_s``, ``min_s``, ``max_s``,
        ``tokens_per_s``), ratios (``x_ddp``, ``x_ddp_paired``), memory
        (``peak_rss_bytes`` and ``state_bytes`` per rank, ``state_over_formula``) and
        communication (``comm_volume_bytes``, ``comm_over_theory``) fields, the loss
        of every step (``losses``, averaged over ranks) and its largest difference
        from torch DDP's (``loss_vs_ddp``); a strategy that failed in every round has
        ``error`` instead.
    """
    groups: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["world_size"], r["model_size"], r["spec"]["strategy"]), []).append(r)
    rows: list[Row] = []
    for (world, size, name), recs in groups.items():
        psi, stage = recs[0]["psi"], recs[0]["stage"]
        row: Row = {"strategy": name, "world_size": world, "model_size": size, "psi": psi}
        row["stage"] = stage
        ok = [r for r in recs if "ranks" in r]
        errors = [r["error"] for r in recs if "error" in r]
        if errors:
            row["errors"] = errors
        if not ok:
            row["error"] = errors[0]
            rows.append(row)
            continue
        row.update(_timing(ok, world * batch * seq_len))
        row["compiled_from"] = recs[0].get("compiled_from")
        row["first_step_s"] = {
            r["round"]: r["ranks"][0]["warmup_times"][0]
            for r in ok
            if "warmup_times" in r["ranks"][0]
        }
        row.update(_memory(ok, world, psi, stage))
        row.update(_comm(ok, world, psi, stage))
        row["losses"] = _global_losses(ok)
        rows.append(row)
    _add_ratios(rows)
    _add_loss_check(rows)
    _add_compile(rows)
    return rows


def compile_table(rows: list[Row]) -> str:
    """The Markdown table of the compiled rows against their eager rows ("" if none)."""
    compiled = [r for r in rows if "x_eager_paired" in r]
    if not compiled:
        return ""
    lines = [
        "| strategy | N | step s: median | eager row's step s | x eager: paired [rounds] "
        "| compile s (first step over the eager row's) |",
        "|---|---|---|---|---|---|",
    ]
    by_key = {(r["world_size"], r["model_size"], r["strategy"]): r for r in rows}
    for row in compiled:
        eager = by_key[(row["world_size"], row["model_size"], row["compiled_from"])]
        spread = f"{min(row['x_eager_rounds']):.2f}-{max(row['x_eager_rounds']):.2f}"
        lines.append(
            f"| {row['strategy']} | {row['world_size']} | {row['median_s']:.3f} "
            f"| {eager['median_s']:.3f} | {row['x_eager_paired']:.2f} [{spread}] "
            f"| {_fmt(row.get('compile_s'), '.1f')} |"
        )
    return "\n".join(lines)


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _row_cells(row: Row) -> list[str]:
    ratio = _fmt(row.get("x_ddp_paired"))
    if "paired_rounds" in row and len(row["paired_rounds"]) > 1:
        ratio += f" [{min(row['paired_rounds']):.2f}-{max(row['paired_rounds']):.2f}]"
    top = max(row["state_bytes"], key=_model_bytes)
    state = "/".join(f"{top[k] / MIB:.1f}" for k in ("parameters", "gradients", "optimizer_state"))
    comm = row["comm_volume_bytes"] / MIB
    return [
        f"{row['median_s']:.3f} [{row['q1_s']:.3f}-{row['q3_s']:.3f}]",
        f"{_fmt(row.get('x_ddp'))} / {ratio}",
        f"{row['tokens_per_s']:.0f}",
        " / ".join(f"{b / MIB:.0f}" for b in row["peak_rss_bytes"]),
        state,
        _fmt(row.get("state_over_formula")),
        f"{comm:.1f}",
        _fmt(row.get("comm_over_theory")),
        _fmt(row.get("loss_vs_ddp"), ".1e"),
    ]


HEADER = (
    "| strategy | N | model (psi) | step s: median [IQR] | x DDP: medians / paired [rounds] "
    "| tokens/s | peak RSS MiB per rank | params/grads/optim MiB (max rank) | x ZeRO formula "
    "| comm MiB/step/rank | x theory | loss vs DDP |"
)


def table(rows: list[Row], not_installed: Iterable[str] = ()) -> str:
    """The Markdown table of :func:`summarize` rows (+ a row per missing package)."""
    lines = [HEADER, "|" + "---|" * 12]
    for row in rows:
        model = f"{row['model_size']} ({row['psi'] / 1e6:.1f}M)"
        head = [row["strategy"], str(row["world_size"]), model]
        failed = [f"failed: {row['error']}"] + ["-"] * 8 if "error" in row else None
        cells = failed or _row_cells(row)
        lines.append("| " + " | ".join(head + cells) + " |")
    for name in not_installed:
        lines.append(f"| {name} | - | - | not installed | " + " | ".join(["-"] * 8) + " |")
    return "\n".join(lines)


NOTES = """\
- step s: median and interquartile range of the timed steps of all rounds (a step:
  forward, backward, optimizer step, zero_grad; the slowest rank's time).
- x DDP: this median over torch DDP's median in the same run; paired: the median over
  rounds of (this round's median / DDP's median in the same round), [min-max over rounds].
- tokens/s: world size x batch x sequence length / median step time.
- peak RSS: VmHWM of each rank's process (fresh processes per run; the maximum over rounds);
  the -rss.png plot shows it step by step (VmHWM reset before each step).
- params/grads/optim: model-state bytes per rank (shardkit.memory.model_state_bytes of the
  rank's local tensors), the rank with the most; x ZeRO formula: that sum over the fp32
  AdamW formula of the strategy's stage (4 + 4 + 8 bytes per parameter; Rajbhandari et
  al. 2020, sec. 5.1).
- comm: bytes each rank sends per step, counted from the torch.distributed collectives
  issued in the timed steps, as ring-algorithm volume (2 (N-1)/N x payload for an
  all-reduce, (N-1)/N for all-gather, reduce-scatter, broadcast, reduce; benchmarks/comm.py);
  x theory: over the ZeRO paper's volume, 2 psi (N-1)/N x 4 bytes for DDP and stages 1-2,
  3 psi (N-1)/N x 4 bytes for stage 3 (sec. 7). Pipe: activations, no theory.
- loss vs DDP: the largest difference, over every step of the first round (warm-up
  included), between the loss (averaged over ranks: the global batch's) and torch DDP's
  on the same data from the same initial model: fp32 rounding (~1e-6) for a strategy
  that trains like DDP. shardkit fsdp exempts biases and norms from weight decay, as
  the main job does (~1e-6 more); shardkit offload (disk) initialises the model slice
  by slice (other initial weights), so its figure is no parity check."""


COMPILE_NOTES = """\
- a compiled row: its strategy with each transformer block torch.compile-d (inductor) before
  wrapping; its timed steps exclude the compile, which runs in the first warm-up step.
- x eager: the eager row's step time over this row's, paired by round (a speedup: > 1 is faster).
- compile s: this row's first step minus the eager row's first step (median over rounds)."""


def render_markdown(doc: dict[str, Any], not_installed: Iterable[str] = ()) -> str:
    """The results page: command, machine, load averages, the table and its notes."""
    m = doc["machine"]
    load_end = doc.get("loadavg_end", [])
    lines = [
        f"# benchmarks.compare, {doc.get('started', '')}",
        "",
        f"Command: `{doc['command']}`",
        "",
        f"Machine: {m['cpu_count']} CPUs ({m['cpu_model']}), torch {m['torch']}, "
        f"Python {m['python']}; load average (1/5/15 min) at start "
        f"{'/'.join(str(v) for v in m['loadavg'])}, at end {'/'.join(str(v) for v in load_end)}.",
        "",
        table(doc["summary"], not_installed),
        "",
        NOTES,
    ]
    compiled = compile_table(doc["summary"])
    if compiled:
        lines += ["", "## Compiled rows", "", compiled, "", COMPILE_NOTES]
    return "\n".join(lines)


def _memory_plot(ax: Any, rows: list[Row], size: str) -> None:
    mine = [r for r in rows if r["model_size"] == size and "state_bytes" in r]
    if not mine:
        return
    psi = mine[0]["psi"]
    worlds = sorted({r["world_size"] for r in mine} | {1})
    span = list(range(1, max(max(worlds), 4) + 1))
    for stage, style in zip(range(4), ("-", "--", "-.", ":")):
        y = [zero_memory_estimate(psi, n, stage, mixed_precision=False).total / MIB for n in span]
        ax.plot(span, y, style, color="black", lw=0.8, label=f"ZeRO-{stage} formula (fp32)")
    for name in dict.fromkeys(r["strategy"] for r in mine):
        pts = sorted(
            (r["world_size"], max(_model_bytes(s) for s in r["state_bytes"]) / MIB)
            for r in mine
            if r["strategy"] == name
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name, alpha=0.8, ms=7)
    ax.set_title(f"GPT {size} (psi = {psi / 1e6:.1f}M)")
    ax.set_xlabel("world size N")
    ax.set_ylabel("model-state MiB per rank (max rank)")
    ax.set_xticks(span)


def _ratio_plot(ax: Any, rows: list[Row]) -> None:
    timed = [r for r in rows if "x_ddp_paired" in r]
    labels = [f"{r['strategy']} (N={r['world_size']}, {r['model_size']})" for r in timed]
    values = [r["x_ddp_paired"] for r in timed]
    low = [r["x_ddp_paired"] - min(r["paired_rounds"]) for r in timed]
    high = [max(r["paired_rounds"]) - r["x_ddp_paired"] for r in timed]
    ax.barh(range(len(timed)), values, xerr=[low, high], color="tab:blue", alpha=0.7)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(timed)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("step time / torch DDP (paired median over rounds; bars: min-max)")


def _rss_plot(ax: Any, rows: list[Row], world: int, size: str) -> None:
    """Each strategy's peak resident set per step (median over rounds, band: min-max)."""
    for row in rows:
        if (row["world_size"], row["model_size"]) != (world, size) or "rss_steps_bytes" not in row:
            continue
        curves = row["rss_steps_bytes"]
        steps = range(1, min(len(c) for c in curves) + 1)
        per_step = [[c[i - 1] / MIB for c in curves] for i in steps]
        (line,) = ax.plot(steps, [statistics.median(v) for v in per_step], "o-", ms=3)
        line.set_label(row["strategy"])
        low, high = [min(v) for v in per_step], [max(v) for v in per_step]
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
    kind = next((r["rss_steps_kind"] for r in rows if "rss_steps_kind" in r), "per step")
    ax.set_title(f"GPT {size}, N = {world}: peak RSS {kind} (largest rank)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("step (warm-up included)")
    ax.set_ylabel("MiB per rank")


def write_rss_plot(rows: list[Row], stem: Path) -> Path | None:
    """``<stem>-rss.png``: the peak resident set of every step, one panel per (world size,
    model size), a line per strategy; None when no row has the curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(
        dict.fromkeys((r["world_size"], r["model_size"]) for r in rows if "rss_steps_bytes" in r)
    )
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels) + 3, 5), squeeze=False)
    for ax, (world, size) in zip(axes[0], panels):
        _rss_plot(ax, rows, world, size)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    path = Path(f"{stem}-rss.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(rows: list[Row], stem: Path) -> list[Path]:
    """``<stem>-memory.png``, ``<stem>-ratio.png`` and, where the runs recorded it,
    ``<stem>-rss.png`` (:func:`write_rss_plot`) (matplotlib, Agg); the paths.

    Raises:
        MissingDependency: matplotlib is not installed (the ``bench`` extra has it);
            nothing is written.
    """
    require("matplotlib", "plots")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["model_size"] for r in rows))
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes) + 3, 5), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        _memory_plot(ax, rows, size)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    memory = Path(f"{stem}-memory.png")
    fig.savefig(memory, dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(9, 0.35 * max(4, len(rows)) + 1))
    _ratio_plot(ax, rows)
    fig.tight_layout()
    ratio = Path(f"{stem}-ratio.png")
    fig.savefig(ratio, dpi=100)
    plt.close(fig)
    rss = write_rss_plot(rows, stem)
    return [memory, ratio] + ([rss] if rss is not None else [])
