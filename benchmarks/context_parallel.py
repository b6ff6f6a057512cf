"""Context parallelism: how long a sequence trains per rank at cp = 1, 2, 4.

Run (gloo, one thread per rank)::

    python -m benchmarks.context_parallel                 # cp 1, 2, 4; L 256 .. 4096
    python -m benchmarks.context_parallel --seq-lens 128 256 --steps 1   # quick

One spawn per (cp, method) runs a training step (forward, backward, no optimizer) of a
GPT (``--model-size``) at each ``--seq-lens`` value, ascending, on ``cp`` ranks that
each hold ``L / cp`` tokens of one sequence (``--batch`` rows); cp = 1 is the plain GPT
(SDPA). Per (cp, method, L) it reports:

- **activation MiB per rank**: bytes of the tensors autograd saved for the backward
  (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once, the
  parameters left out), the largest rank's: the activations context parallelism
  divides;
- **peak RSS MiB per rank** (``VmHWM``, monotone over the ascending L of one spawn);
- **step time per token**: the median step (slowest rank) over the global tokens
  ``batch x L``;
- **bytes sent per rank**, counted by wrapping ``torch.distributed.all_to_all_single``
  and ``batch_isend_irecv`` in this process, forward and backward apart, against the
  formulas: Ulysses sends ``(cp - 1)/cp`` of each of its 4 all-to-alls' inputs (q, k,
  v, out: ``batch x L/cp x n_embd`` elements each) per layer and direction; ring sends
  ``cp - 1`` K/V blocks (``2 x batch x L/cp x n_embd``) per layer forward, and in the
  backward those again plus ``cp`` fp32 dK/dV blocks.

The headline, per (cp, method): the longest L whose **peak RSS per rank** fits
``--rss-budget-mib`` (the memory a rank really has), and its ratio to cp = 1 (the
target is at least 3.5x at cp = 4: the activations per rank fall as 1/cp, the rest of
the process does not grow with L); beside it the longest L whose activations fit
``--act-budget-mib``. A spawn stops at the first L over the RSS budget, so give
``--seq-lens`` a grid fine enough to resolve the ratio (e.g. steps of 256 tokens).
Markdown to stdout; the JSON (``benchmarks/results/``, ``--out``) is rewritten after
every spawn, so an interrupted run keeps what it measured. ``--scale-seq-lens`` runs
cp at ``cp x`` each of ``--seq-lens``; ``--steps 0`` runs one forward and backward per
L; ``--timeout`` bounds each spawn (a spawn that times out or dies is recorded under
``errors`` and the run goes on).

[Note: the allocator sets the peak]
With glibc's default malloc the peak RSS of a rank is set less by the bytes it holds
than by heap fragmentation: the large temporaries of a step (attention blocks,
all-to-all buffers, gradients) come from the heap below the dynamic mmap threshold,
and freed holes between live blocks stay resident. The ranks therefore call
``mallopt(M_MMAP_THRESHOLD, --mmap-threshold)`` (default 1 MiB, what
``MALLOC_MMAP_THRESHOLD_=1048576`` does from the environment), so every buffer of a
MiB or more is its own mapping, returned to the OS when freed; ``--mmap-threshold 0``
measures glibc's default. The setting and any allocator variables of the environment
(``LD_PRELOAD``, ``MALLOC_*``, ``GLIBC_TUNABLES``) are recorded in the JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import (
    ALLOCATOR_ENV,
    MIB,
    RESULTS,
    command,
    loadavg,
    machine,
    peak_rss_bytes,
    slowest,
    status_bytes,
    timestamp,
)
from shardkit.distributed.mesh import ParallelDims, ProcessMesh
from shardkit.models import GPT, Block, gpt_config
from shardkit.nn.context_parallel import (
    DistributedAttention,
    RingAttention,
    position_ids,
    split_sequence,
)
from shardkit.testing import RankError, RankTimeoutError, run_distributed

_SENT = {"bytes": 0}


@contextmanager
def _counting() -> Iterator[dict[str, int]]:
    """Count the bytes this rank sends to other ranks through the two exchanges of
    context parallelism, while inside."""
    a2a, batch = dist.all_to_all_single, dist.batch_isend_irecv

    def all_to_all_single(output: torch.Tensor, input: torch.Tensor, *a: Any, **k: Any) -> Any:
        world = dist.get_world_size(k.get("group"))
        _SENT["bytes"] += input.numel() * input.element_size() * (world - 1) // world
        return a2a(output, input, *a, **k)

    def batch_isend_irecv(ops: list[dist.P2POp]) -> Any:
        for op in ops:
            if op.op is dist.isend:
                _SENT["bytes"] += op.tensor.numel() * op.tensor.element_size()
        return batch(ops)

    dist.all_to_all_single, dist.batch_isend_irecv = all_to_all_single, batch_isend_irecv  # type: ignore[assignment]
    try:
        yield _SENT
    finally:
        dist.all_to_all_single, dist.batch_isend_irecv = a2a, batch  # type: ignore[assignment]


@contextmanager
def _saved_bytes(params: set[int]) -> Iterator[dict[str, int]]:
    """The bytes of the distinct storages autograd saves for the backward, but the
    parameters' (``params``: their storages' addresses)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    out = {"bytes": 0}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield out
    out["bytes"] = sum(seen.values())


#: ``mallopt`` parameter number of glibc's ``M_MMAP_THRESHOLD`` (malloc.h)
_M_MMAP_THRESHOLD = -3


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve every allocation of at least ``nbytes`` with its own ``mmap`` in this process
    (glibc ``mallopt(M_MMAP_THRESHOLD)``, what ``MALLOC_MMAP_THRESHOLD_`` sets at start);
    True where glibc accepted it. Freed large buffers then go back to the OS at once
    instead of fragmenting the heap (see ``[Note: the allocator sets the peak]``)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, nbytes))


def _core(method: str, group: dist.ProcessGroup) -> Callable[..., torch.Tensor]:
    if method == "ring":
        return RingAttention(group, causal=True).__call__

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return DistributedAttention(sdpa, group, scatter_idx=1, gather_idx=2).__call__


def _formula(method: str, cp: int, tokens: int, n_embd: int, layers: int) -> dict[str, int]:
    """Bytes each rank sends per step (fp32), forward and backward, by the formulas."""
    if cp == 1:
        return {"forward": 0, "backward": 0}
    local = tokens // cp * n_embd * 4  # one of q, k, v, out on this rank
    if method == "ulysses":
        per_layer = 4 * local * (cp - 1) // cp
        return {"forward": layers * per_layer, "backward": layers * per_layer}
    kv = 2 * local
    return {"forward": layers * (cp - 1) * kv, "backward": layers * ((cp - 1) * kv + cp * kv)}


def run_sweep(method: str, cp: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """On every rank: one step at each ``args.seq_lens`` with the sequence split over
    cp groups of ``cp`` ranks (1: the plain GPT on each rank)."""
    mmap = args.mmap_threshold > 0 and set_mmap_threshold(args.mmap_threshold)
    mesh = ProcessMesh(ParallelDims(world_size=dist.get_world_size(), cp=cp))
    group, rank = mesh.group("cp"), mesh.local_rank("cp")
    zigzag = method == "ring"
    rest = slowest(status_bytes("VmRSS") / MIB)
    rows = []
    for seq in seq_grid(args, cp):
        torch.manual_seed(0)
        shape = gpt_config(args.model_size, block_size=seq)
        model = GPT(shape)
        if cp > 1:
            for block in model.blocks:
                assert isinstance(block, Block)
                block.attn.core = _core(method, group)
        idx = torch.randint(0, 256, (args.batch, seq))
        local = split_sequence(idx, rank, cp, zigzag=zigzag)
        pos = position_ids(seq, rank, cp, zigzag=zigzag)
        times, sent = [], {"forward": 0, "backward": 0}
        act = 0
        for step in range(args.steps + 1):
            start = time.perf_counter()
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            with _counting() as count, _saved_bytes(params) as saved:
                count["bytes"] = 0
                _, loss = model(local, targets=local, position_ids=pos)
                forward_sent = count["bytes"]
            with _counting() as count:
                count["bytes"] = 0
                assert loss is not None
                loss.backward()
                backward_sent = count["bytes"]
            elapsed = slowest(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
            if step or not args.steps:
                times.append(elapsed)
            sent, act = {"forward": forward_sent, "backward": backward_sent}, saved["bytes"]
        step_s = statistics.median(times)
        rss = slowest(peak_rss_bytes() / MIB)
        rows.append(
            {
                "cp": cp,
                "method": method if cp > 1 else "plain",
                "seq_len": seq,
                "activation_mib": slowest(act / MIB),
                "rest_rss_mib": rest,
                "peak_rss_mib": rss,
                "mmap_threshold": args.mmap_threshold if mmap else None,
                "step_s": step_s,
                "us_per_token": 1e6 * step_s / (args.batch * seq),
                "sent_bytes": sent,
                "formula_bytes": _formula(
                    method, cp, args.batch * seq, shape.n_embd, shape.n_layer
                ),
            }
        )
        del model, loss
        if rss > args.rss_budget_mib:
            break
    mesh.destroy()
    return rows


def seq_grid(args: argparse.Namespace, cp: int) -> list[int]:
    """The sequence lengths a ``cp`` spawn runs, ascending: ``args.seq_lens``, times
    ``cp`` with ``args.scale_seq_lens`` (so every cp's grid resolves its ratio to cp 1
    equally finely)."""
    scale = cp if args.scale_seq_lens else 1
    return sorted(seq * scale for seq in args.seq_lens)


def _longest_under(
    rows: list[dict[str, Any]], field: str, budget: float
) -> dict[tuple[int, str], int | None]:
    """Per (cp, method): the longest L whose ``field`` is within ``budget`` (None: not
    even the shortest L measured)."""
    out: dict[tuple[int, str], int | None] = {}
    for r in rows:
        key = (r["cp"], r["method"])
        out.setdefault(key, None)
        if r[field] <= budget:
            out[key] = max(out[key] or 0, r["seq_len"])
    return out


def _ratio(value: int | None, base: int | None) -> float | None:
    return None if value is None or not base else value / base


def longest(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per (cp, method): ``longest_seq_len``, the longest L whose peak RSS per rank fits
    ``args.rss_budget_mib`` (the headline), ``longest_by_activations``, the longest
    whose activations per rank fit ``args.act_budget_mib``, and each as a multiple of
    cp = 1's (``x_cp1_rss``, ``x_cp1_activations``; None without a cp = 1 row or when
    either is None)."""
    by_rss = _longest_under(rows, "peak_rss_mib", args.rss_budget_mib)
    by_act = _longest_under(rows, "activation_mib", args.act_budget_mib)
    base = next(((k, v) for k, v in by_rss.items() if k[0] == 1), None)
    base_rss = base[1] if base else None
    base_act = by_act[base[0]] if base else None
    return [
        {
            "cp": k[0],
            "method": k[1],
            "longest_seq_len": v,
            "x_cp1_rss": _ratio(v, base_rss),
            "longest_by_activations": by_act[k],
            "x_cp1_activations": _ratio(by_act[k], base_act),
        }
        for k, v in sorted(by_rss.items())
    ]


def _cell(value: int | None, ratio: float | None) -> str:
    if value is None:
        return "none"
    return f"{value}" if ratio is None else f"{value} ({ratio:.2f}x)"


def render_markdown(
    rows: list[dict[str, Any]], fits: list[dict[str, Any]], args: argparse.Namespace | None = None
) -> str:
    lines = [
        "| cp | method | L | activations MiB / rank | peak RSS MiB | us / token | sent fwd (counted / formula) | sent bwd (counted / formula) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, f = r["sent_bytes"], r["formula_bytes"]
        lines.append(
            f"| {r['cp']} | {r['method']} | {r['seq_len']} | {r['activation_mib']:.1f} "
            f"| {r['peak_rss_mib']:.0f} | {r['us_per_token']:.1f} "
            f"| {s['forward']} / {f['forward']} | {s['backward']} / {f['backward']} |"
        )
    rss = f" {args.rss_budget_mib:.0f} MiB" if args is not None else ""
    act = f" {args.act_budget_mib:.0f} MiB" if args is not None else ""
    lines += [
        "",
        f"| cp | method | longest L, peak RSS per rank <={rss} (x cp 1) "
        f"| longest L, activations per rank <={act} (x cp 1) |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {f['cp']} | {f['method']} | {_cell(f['longest_seq_len'], f['x_cp1_rss'])} "
        f"| {_cell(f['longest_by_activations'], f['x_cp1_activations'])} |"
        for f in fits
    ]
    return "\n".join(lines)


def write_plot(rows: list[dict[str, Any]], budget_mib: float, path: Path) -> Path | None:
    """``path`` (png): activations and peak RSS per rank against L, a line per (cp,
    method), the RSS budget dashed; None without rows."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for key in dict.fromkeys((r["cp"], r["method"]) for r in rows):
        mine = sorted(
            (r for r in rows if (r["cp"], r["method"]) == key), key=lambda r: r["seq_len"]
        )
        seq = [r["seq_len"] for r in mine]
        label = f"cp {key[0]} {key[1]}"
        axes[0].plot(seq, [r["activation_mib"] for r in mine], "o-", ms=3, label=label)
        axes[1].plot(seq, [r["peak_rss_mib"] for r in mine], "o-", ms=3, label=label)
    axes[0].set_title("activations saved for the backward, per rank")
    axes[1].set_title("peak RSS per rank")
    axes[1].axhline(budget_mib, ls="--", c="gray", label=f"budget {budget_mib:.0f} MiB")
    for ax in axes:
        ax.set_xlabel("sequence length L (tokens)")
        ax.set_ylabel("MiB")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def failure_line(error: str) -> str:
    """The line of a spawn's error to print: its last, unless that only says which other
    ranks failed (then the one before it, the exception, with that note)."""
    lines = [line for line in error.splitlines() if line.strip()]
    if len(lines) > 1 and lines[-1].startswith("(ranks "):
        return f"{lines[-2]} {lines[-1]}"
    return lines[-1] if lines else error


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--methods", nargs="+", choices=["ulysses", "ring"], default=["ulysses", "ring"]
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument(
        "--scale-seq-lens",
        action="store_true",
        help="run each cp at the --seq-lens times cp (the grid scales with the expected fit)",
    )
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument("--batch", type=int, default=1, help="rows per step")
    parser.add_argument(
        "--steps",
        type=int,
        default=2,
        help="timed steps after one warm-up; 0: one step only",
    )
    parser.add_argument("--act-budget-mib", type=float, default=64.0)
    parser.add_argument("--rss-budget-mib", type=float, default=2048.0)
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=2**20,
        help="bytes from which the ranks' glibc malloc mmaps an allocation (mallopt "
        "M_MMAP_THRESHOLD, as MALLOC_MMAP_THRESHOLD_ does); 0 keeps the allocator's default",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per spawn")
    parser.add_argument("--out", default=str(RESULTS))
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps < 0:
        parser.error(f"argument --steps: must be >= 0; got {args.steps}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"context_parallel-{timestamp()}.json"
    doc: dict[str, Any] = {
        "command": command("benchmarks.context_parallel", argv),
        "args": vars(args),
        "allocator": {
            "mmap_threshold": args.mmap_threshold or "glibc default (dynamic)",
            "env": {k: os.environ[k] for k in ALLOCATOR_ENV if os.environ.get(k)},
        },
        "machine": machine(),
        "rows": [],
        "errors": [],
    }
    for cp in args.cps:
        for method in args.methods if cp > 1 else ["plain"]:
            load = loadavg()
            try:
                got = run_distributed(run_sweep, cp, method, cp, args, timeout_s=args.timeout)
                doc["rows"] += [{**r, "loadavg": load} for r in got[0]]
            except (
                RankError,
                RankTimeoutError,
            ) as err:  # a timeout or a rank killed for memory: keep going
                doc["errors"].append({"cp": cp, "method": method, "error": str(err)[-2000:]})
            doc["longest"] = longest(doc["rows"], args)
            path.write_text(json.dumps(doc, indent=1))  # after every spawn
    print(render_markdown(doc["rows"], doc["longest"], args))
    for e in doc["errors"]:
        print(f"cp {e['cp']} {e['method']}: failed: {failure_line(e['error'])}")
    plot = write_plot(doc["rows"], args.rss_budget_mib, path.with_suffix(".png"))
    print(f"written {path}" + (f" and {plot}" if plot else ""))
    return doc


if __name__ == "__main__":
    main()
