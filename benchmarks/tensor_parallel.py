"""Tensor parallel against torch's own, on the main job's GPT: step time, bytes, traffic.

Run::

    python -m benchmarks.tensor_parallel                       # tiny and small, 2 rounds
    python -m benchmarks.tensor_parallel --model-sizes small --rounds 3

Strategies, every one in the same run:

- ``plain``: the GPT on one rank (the reference for step time and loss).
- ``shardkit tp``: ``tp.parallelize(model, tp.gpt_plan(), process_group=world)`` on
  ``--tp`` ranks (attention split by heads, MLP column-then-row, the token embedding
  vocabulary-parallel with the tied LM head column-parallel, logits all-gathered).
- ``torch tp``: ``torch.distributed.tensor.parallel.parallelize_module`` on a 1-D
  ``DeviceMesh`` of ``--tp`` ranks with ``ColwiseParallel`` on ``attn.qkv`` and
  ``mlp.0`` and ``RowwiseParallel`` on ``attn.proj`` and ``mlp.2`` (torch's own
  plan; embedding, LM head and LayerNorms replicated). Two adaptations, both what
  torchtitan does for its Llama: torch's column split is contiguous, so the fused
  ``qkv`` rows are reordered first to ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (rank r's
  contiguous block is then the q, k and v of its own heads; the plain model's output
  is unchanged), and the attention's ``n_head`` is set to the local head count.

[Note: method]
As :mod:`benchmarks.compare`: every run is a fresh set of spawned gloo ranks (one
thread each); ``--rounds`` rounds run every strategy once, the order rotating from
round to round. In a run: build the GPT (seed 0, the same batch of ``--batch``
sequences on every rank: tensor-parallel ranks share their input), one measured step
(per-rank parameter bytes; this rank's local shard of a ``DTensor``), one counted step
(untimed), ``--warmup - 1`` more untimed steps, then ``--steps`` timed steps. A step is
forward, backward, AdamW (:data:`benchmarks.common.ADAMW`), ``zero_grad``; its time is
the slowest rank's. Reported: the median over every timed step of every round, the
ratio to the plain model's median, and the paired ratio (the median over rounds of
the round's median over the plain model's median in the same round); the same for
shardkit over torch.

Communication is counted in the counted step by a dispatch mode that sees every
collective operator below ``torch.distributed`` and DTensor: ``c10d`` (what
``torch.distributed.all_reduce`` issues: shardkit) and ``_c10d_functional`` (what
DTensor's redistribution issues: torch's tensor parallel, which
:mod:`benchmarks.comm`'s Python wrappers do not see). An operator applied to a DTensor
is let through (``NotImplemented``) so that it is counted once it has become the
collectives on local tensors, as torch's ``CommDebugMode`` does. Payload bytes as in
:mod:`benchmarks.comm` (an all-gather counts the gathered tensor). For shardkit the
:mod:`benchmarks.comm` counter runs as well, as a cross-check.

Megatron-LM's count (Shoeybi et al. 2019, section 3) per step and rank:
``4 L`` all-reduces of ``b s h`` elements (2 per layer in forward, 2 in backward);
shardkit's plan adds the vocabulary-parallel embedding's all-reduce (forward), the LM
head input's (backward) and the all-gather of the logits (``b s V``), as
``tests/nn/tensor_parallel/test_gpt_plan.py`` counts them; torch's plan leaves the
embedding and head replicated, so its count is the ``4 L`` alone.

Output: ``benchmarks/results/tensor_parallel-<time>.json`` (everything, with the
machine and the command) and ``.md`` (the table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import comm
from benchmarks.common import (
    ADAMW,
    RESULTS,
    command,
    local_state_bytes,
    machine,
    slowest,
    timestamp,
)
from benchmarks.compare import SIZES, error_line, model_config, rotated
from shardkit.models import GPT, Block, GPTConfig
from shardkit.testing import RankError, RankTimeoutError, run_distributed

STRATEGIES = ("plain", "shardkit tp", "torch tp")
"""Strategy names, in the order of the table."""

F32 = 4


# ---------------------------------------------------------------------------- counting
def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _kind(name: str) -> str | None:
    """The collective kind of a ``c10d`` / ``_c10d_functional`` operator name, or None."""
    for prefix, kind in (
        ("allreduce", "all_reduce"),
        ("all_reduce", "all_reduce"),
        ("allgather", "all_gather"),
        ("_allgather", "all_gather"),
        ("all_gather", "all_gather"),
        ("reduce_scatter", "reduce_scatter"),
        ("_reduce_scatter", "reduce_scatter"),
        ("alltoall", "all_to_all"),
        ("all_to_all", "all_to_all"),
        ("broadcast", "broadcast"),
    ):
        if name.startswith(prefix):
            return kind
    return None


class CollectiveCounter(TorchDispatchMode):
    """Counts the collective operators dispatched inside it (see the module note).

    ``records`` holds ``(phase, kind, payload bytes)``; set :attr:`phase` to label them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, str, int]] = []
        self.phase = "forward"

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor lower it to collectives on local tensors
        out = func(*args, **(kwargs or {}))
        namespace = getattr(func, "namespace", "")
        if namespace in ("c10d", "_c10d_functional"):
            name = func._overloadpacket.__name__
            kind = _kind(name)
            if kind is not None:
                self.records.append((self.phase, kind, self._payload(namespace, name, args)))
        return out

    @staticmethod
    def _payload(namespace: str, name: str, args: tuple[Any, ...]) -> int:
        if namespace == "_c10d_functional":
            if name.startswith("all_gather"):  # (input, group_size, group_name)
                return _nbytes(args[0]) * int(args[1])
            return _nbytes(args[0])
        if name in ("allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_"):
            return _nbytes(args[0])  # the gathered output
        if name.startswith(("reduce_scatter", "_reduce_scatter")):
            return _nbytes(args[1])  # the unscattered input
        return _nbytes(args[0])

    def summary(self) -> dict[str, Any]:
        """Calls and payload bytes by ``"<phase> <kind>"``, and the total bytes."""
        calls: dict[str, int] = {}
        payload: dict[str, int] = {}
        for phase, kind, size in self.records:
            key = f"{phase} {kind}"
            calls[key] = calls.get(key, 0) + 1
            payload[key] = payload.get(key, 0) + size
        return {"calls": calls, "payload_bytes": payload, "total_bytes": sum(payload.values())}


def megatron_bytes(config: GPTConfig, batch: int, seq_len: int, tp: int) -> dict[str, int]:
    """Bytes per step and rank (fp32) of Megatron-LM's count and of each plan's.

    ``core``: ``4 L b s h`` elements (2 all-reduces per layer in forward, 2 in
    backward); ``shardkit tp``: the core, plus the embedding's and the LM head
    input's all-reduces (``2 b s h``) and the logits' all-gather (``b s V``);
    ``torch tp``: the core (embedding and head replicated). ``tp`` is unused by the
    payload count (an all-reduce's payload does not depend on the degree) but kept for
    the record.
    """
    bsh = batch * seq_len * config.n_embd
    core = 4 * config.n_layer * bsh * F32
    logits = batch * seq_len * config.vocab_size * F32
    return {
        "core": core,
        "shardkit tp": core + 2 * bsh * F32 + logits,
        "torch tp": core,
        "tp": tp,
    }


# ---------------------------------------------------------------------------- ranks
def _torch_tp(model: GPT, tp: int) -> nn.Module:
    """torch's colwise / rowwise plan on ``model`` over a 1-D mesh (see the module doc)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (tp,))
    c = model.config.n_embd
    plan: dict[str, Any] = {}
    for i, block in enumerate(model.blocks):
        attn = cast(Block, block).attn
        if attn.n_head % tp != 0:
            raise ValueError(f"n_head {attn.n_head} is not divisible by the degree {tp}")
        qkv = attn.qkv
        assert isinstance(qkv, nn.Linear)
        with torch.no_grad():  # [q | k | v] -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
            w = qkv.weight.view(3, tp, c // tp, c).transpose(0, 1).reshape(3 * c, c)
            qkv.weight.copy_(w.clone())
            b = qkv.bias.view(3, tp, c // tp).transpose(0, 1).reshape(3 * c)
            qkv.bias.copy_(b.clone())
        attn.n_head //= tp
        plan[f"blocks.{i}.attn.qkv"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.proj"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.0"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.2"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _build(strategy: str, config: GPTConfig) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(config)
    if strategy == "plain":
        return model
    if strategy == "shardkit tp":
        from shardkit.nn import tensor_parallel as tp

        return tp.parallelize(model, tp.gpt_plan(), process_group=dist.group.WORLD)
    if strategy == "torch tp":
        return _torch_tp(model, dist.get_world_size())
    raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")


def run_strategy(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Body of every rank of one run: build, measure, count, warm up, time.

    Args:
        spec: ``strategy``, ``model`` (:class:`GPTConfig` fields), ``batch``,
            ``steps`` (timed), ``warmup`` (untimed after the measured and counted
            steps, >= 0).

    Returns:
        ``times`` (s per timed step, slowest rank), ``losses`` (every step's loss),
        ``param_bytes`` (this rank's), ``state`` (bytes by category after the first
        step), ``counted`` (:meth:`CollectiveCounter.summary` of the counted step) and,
        for shardkit, ``comm`` (:mod:`benchmarks.comm` over the same step).
    """
    config = GPTConfig(**spec["model"])
    model = _build(spec["strategy"], config)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    gen = torch.Generator().manual_seed(1234)  # the same batch on every rank
    shape = (spec["batch"], config.block_size)
    x = torch.randint(0, config.vocab_size, shape, generator=gen)
    y = torch.randint(0, config.vocab_size, shape, generator=gen)
    losses: list[float] = []

    def step(counter: CollectiveCounter | None = None) -> None:
        loss = model(x, y)[1]
        assert loss is not None
        if counter is not None:
            counter.phase = "backward"
        loss.backward()
        if counter is not None:
            counter.phase = "step"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))

    loss = model(x, y)[1]  # the measured step
    assert loss is not None
    loss.backward()
    state = local_state_bytes(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    losses.append(float(loss.detach()))

    counter = CollectiveCounter()
    py_counter = comm.install()
    py_counter.reset()
    try:
        with py_counter.counting(), counter:
            step(counter)
    finally:
        comm.uninstall()
    for _ in range(spec["warmup"]):
        step()
    times = []
    for _ in range(spec["steps"]):
        if dist.get_world_size() > 1:
            dist.barrier()
        start = time.perf_counter()
        step()
        times.append(slowest(time.perf_counter() - start))
    return {
        "times": times,
        "losses": losses,
        "param_bytes": state["parameters"],
        "state": state,
        "counted": counter.summary(),
        "comm": py_counter.snapshot(),
    }


# ---------------------------------------------------------------------------- runs
def run_once(spec: dict[str, Any], tp: int, timeout_s: float) -> dict[str, Any]:
    """One run in fresh ranks (1 for ``plain``, ``tp`` otherwise); a failure becomes
    ``{"error": ...}``."""
    world = 1 if spec["strategy"] == "plain" else tp
    record: dict[str, Any] = {"spec": spec, "world_size": world}
    started = time.perf_counter()
    try:
        record["ranks"] = run_distributed(run_strategy, world, spec, timeout_s=timeout_s)
    except (RankError, RankTimeoutError) as err:
        record["error"] = error_line(err)
    record["wall_s"] = time.perf_counter() - started
    return record


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per (model size, strategy): step time, ratios, bytes, traffic, loss."""
    args = doc["args"]
    rows: list[dict[str, Any]] = []
    for size in args["model_sizes"]:
        records = [r for r in doc["records"] if r["model_size"] == size]
        config = model_config(size, args["seq_len"])
        formula = megatron_bytes(config, args["batch"], args["seq_len"], args["tp"])
        by_round: dict[tuple[str, int], float] = {}
        for r in records:
            if "error" not in r:
                by_round[(r["spec"]["strategy"], r["round"])] = statistics.median(
                    r["ranks"][0]["times"]
                )
        plain = [r for r in records if r["spec"]["strategy"] == "plain" and "error" not in r]
        plain_losses = plain[0]["ranks"][0]["losses"] if plain else None
        medians: dict[str, float | None] = {}
        for name in STRATEGIES:
            mine = [r for r in records if r["spec"]["strategy"] == name]
            failed = [r for r in mine if "error" in r]
            row: dict[str, Any] = {"model_size": size, "strategy": name}
            if failed or not mine:
                row["error"] = failed[0]["error"] if failed else "not run"
                rows.append(row)
                medians[name] = None
                continue
            times = [t for r in mine for t in r["ranks"][0]["times"]]
            medians[name] = _median(times)
            ranks = mine[0]["ranks"]
            counted = ranks[0]["counted"]
            row.update(
                world_size=mine[0]["world_size"],
                median_s=medians[name],
                p25_s=statistics.quantiles(times, n=4)[0] if len(times) > 1 else times[0],
                p75_s=statistics.quantiles(times, n=4)[2] if len(times) > 1 else times[0],
                timed_steps=len(times),
                param_bytes=[r["param_bytes"] for r in ranks],
                counted=counted,
                counted_bytes=counted["total_bytes"],
                comm_py_bytes=sum(ranks[0]["comm"]["payload_bytes"].values()),
                formula_bytes=0 if name == "plain" else formula[name],
                core_bytes=0 if name == "plain" else formula["core"],
            )
            row["counted_over_formula"] = (
                row["counted_bytes"] / row["formula_bytes"] if row["formula_bytes"] else None
            )
            paired = [
                by_round[(name, k)] / by_round[("plain", k)]
                for k in range(args["rounds"])
                if (name, k) in by_round and ("plain", k) in by_round
            ]
            row["paired_vs_plain"] = _median(paired)
            if plain_losses is not None:
                losses = ranks[0]["losses"]
                row["loss_first_diff"] = abs(losses[0] - plain_losses[0])
                row["loss_max_diff"] = max(
                    abs(a - b) for a, b in zip(losses, plain_losses, strict=True)
                )
                row["loss_last"] = losses[-1]
            rows.append(row)
        for row in rows:
            if row["model_size"] != size or "error" in row:
                continue
            base = medians.get("plain")
            row["ratio_vs_plain"] = row["median_s"] / base if base else None
            torch_median = medians.get("torch tp")
            if row["strategy"] == "shardkit tp" and torch_median:
                row["ratio_vs_torch"] = row["median_s"] / torch_median
                paired = [
                    by_round[("shardkit tp", k)] / by_round[("torch tp", k)]
                    for k in range(args["rounds"])
                    if ("shardkit tp", k) in by_round and ("torch tp", k) in by_round
                ]
                row["paired_vs_torch"] = _median(paired)
    return rows


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_markdown(doc: Mapping[str, Any]) -> str:
    """The table of :func:`summarize`'s rows, with the command and the machine."""
    args = doc["args"]
    lines = [
        "# Tensor parallel: shardkit vs torch (`parallelize_module`)",
        "",
        f"`{doc['command']}`",
        "",
        f"GPT sizes {', '.join(args['model_sizes'])} (vocab 256), batch {args['batch']} x "
        f"seq {args['seq_len']} (the same on every rank), AdamW fp32, gloo, TP degree "
        f"{args['tp']}; {args['steps']} timed steps x {args['rounds']} rounds; machine: "
        f"{doc['machine']['cpu_count']} CPUs ({doc['machine']['cpu_model']}), torch "
        f"{doc['machine']['torch']}, load {doc['machine']['loadavg']} -> "
        f"{doc.get('loadavg_end')}.",
        "",
        "| size | strategy | ranks | step median ms | vs plain (paired) | vs torch tp (paired)"
        " | param MiB per rank | counted MiB / step | Megatron MiB | counted / Megatron"
        " | loss diff step 1 / max |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    mib = 2**20
    for row in doc["rows"]:
        if "error" in row:
            lines.append(
                f"| {row['model_size']} | {row['strategy']} | | error: {row['error']} "
                "| | | | | | | |"
            )
            continue
        params = " / ".join(f"{b / mib:.2f}" for b in row["param_bytes"])
        vs_torch = (
            f"{row['ratio_vs_torch']:.2f} ({_fmt(row.get('paired_vs_torch'), '.2f')})"
            if row.get("ratio_vs_torch") is not None
            else "-"
        )
        formula = row["formula_bytes"]
        lines.append(
            f"| {row['model_size']} | {row['strategy']} | {row['world_size']} "
            f"| {row['median_s'] * 1e3:.1f} "
            f"| {_fmt(row.get('ratio_vs_plain'), '.2f')} "
            f"({_fmt(row.get('paired_vs_plain'), '.2f')}) | {vs_torch} | {params} "
            f"| {row['counted_bytes'] / mib:.2f} | {formula / mib:.2f} "
            f"| {_fmt(row.get('counted_over_formula'), '.4f')} "
            f"| {_fmt(row.get('loss_first_diff'), '.1e')} / "
            f"{_fmt(row.get('loss_max_diff'), '.1e')} |"
        )
    lines += [
        "",
        "Megatron: shardkit tp = 4 L b s h (2 all-reduces per layer in forward, 2 in "
        "backward) + 2 b s h (embedding, LM head input) + b s V (logits all-gather); "
        "torch tp = 4 L b s h (embedding and head replicated). Counted: the collectives "
        "of one step (c10d and DTensor's functional collectives), payload bytes.",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tensor_parallel", description=__doc__.splitlines()[0]
    )
    add = p.add_argument
    add("--model-sizes", nargs="+", default=["tiny", "small"], choices=sorted(SIZES))
    add("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    add("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    add("--batch", type=int, default=8, help="sequences per step (default 8)")
    add("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    add("--steps", type=int, default=5, help="timed steps per run (default 5)")
    add("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    add("--warmup", type=int, default=1, help="untimed steps after the counted one")
    add("--timeout", type=float, default=900.0, help="seconds per run (default 900)")
    add("--out", default=str(RESULTS), help="results folder (default benchmarks/results)")
    add("--no-write", action="store_true", help="print only, write no files")
    args = p.parse_args(argv)
    if "plain" not in args.strategies:
        p.error("--strategies must include plain (the reference)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every strategy, interleaved; write JSON and Markdown; return the document."""
    from pathlib import Path

    args = parse_args(argv)
    doc: dict[str, Any] = {
        "command": command("benchmarks.tensor_parallel", argv),
        "args": vars(args),
        "machine": machine(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "records": [],
    }
    for size in args.model_sizes:
        config = model_config(size, args.seq_len)
        for round_index in range(args.rounds):
            for name in rotated(list(args.strategies), round_index):
                spec = {
                    "strategy": name,
                    "model": asdict(config),
                    "batch": args.batch,
                    "steps": args.steps,
                    "warmup": args.warmup,
                }
                record = run_once(spec, args.tp, args.timeout)
                record.update(model_size=size, round=round_index)
                if "error" in record:
                    print(f"{name} ({size}): {record['error']}")
                doc["records"].append(record)
    doc["loadavg_end"] = machine()["loadavg"]
    doc["rows"] = summarize(doc)
    page = render_markdown(doc)
    print(page)
    if not args.no_write:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"tensor_parallel-{timestamp()}"
        Path(f"{stem}.md").write_text(page + "\n")
        Path(f"{stem}.json").write_text(json.dumps(doc, indent=1, default=float) + "\n")
        print(f"\nwrote {stem}.json and {stem}.md")
    return doc


if __name__ == "__main__":
    main()
