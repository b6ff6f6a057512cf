"""One training step of several strategies under ``torch.profiler``, phase by phase.

Run::

    python -m benchmarks.profile_step                       # DDP, sdp, fsdp; anchor GPT
    python -m benchmarks.profile_step --strategies "shardkit fsdp" --steps 5 --top 25

Each strategy runs in fresh spawned gloo ranks (one thread each), on the GPT and batch
of :mod:`benchmarks.compare` (the main job's strategy registry, AdamW). After
``--warmup`` untimed steps, ``--steps`` steps run under the profiler (CPU activities),
each split into labelled phases: ``step::forward``, ``step::backward``,
``step::optimizer`` (``before_step``, ``step``, ``zero_grad``). The wrappers' own
``record_function`` labels (``FSDP::pre_forward``, ``FSDP::post_backward``,
``FSDP::finalize_backward``, ...) and every operator show inside them.

A name ending in ``+ compile`` builds the strategy with each block compiled first (the
main job's ``--compile``; the warm-up compiles), and the output says what dynamo did
(graphs compiled, graph breaks) after the warm-up and after the
profiled steps: equal counts mean nothing recompiled. ``torch FSDP2`` and ``blocks``
(the transformer blocks alone, the part compile speeds) may be given as well.

Output (rank 0's profile; the step time is the slowest rank's): per strategy, the mean
milliseconds per step of each phase, and the top ``--top`` entries by self CPU time and
the wrappers' labels by total CPU time; also ``benchmarks/results/profile-<time>.json``.
Self CPU time is the main thread's: gloo's collectives run on gloo's own threads, so
a collective shows as the time the main thread spent issuing or waiting for it
(``aten::wait`` / the wrappers' wait labels), which is what the step pays.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.common import (
    ADAMW,
    add_run_args,
    add_strategy_args,
    build_torch_fsdp2,
    slowest,
    timestamp,
)
from benchmarks.compare import _batch, model_config
from benchmarks.runners import EXAMPLES_DIR, _registry_config
from shardkit.models import GPT
from shardkit.testing import run_distributed

# the main job's modules as runners imports them (examples/ on sys.path), one copy each
assert str(EXAMPLES_DIR) in sys.path
from gpt_compile import compile_blocks  # noqa: E402  (examples/gpt_compile.py)
from strategies import STRATEGIES as MAIN_JOB  # noqa: E402  (examples/strategies.py)
from strategies import Strategy  # noqa: E402

PHASES = ("step::forward", "step::backward", "step::optimizer")
"""The labels one step is split into."""


COMPILED = " + compile"
"""A strategy name ending in it: the main job's ``--compile`` (each block compiled with
inductor before the strategy wraps the model), e.g. ``"shardkit fsdp + compile"``."""


class _Blocks(nn.Module):
    """The GPT's transformer blocks alone: ``(idx, targets) -> (h, mean of h^2)``, the
    embedding run without gradient (the part of a step that compiling the blocks speeds)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.wte, self.blocks = model.wte, model.blocks

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            h = self.wte(idx)
        for block in self.blocks:
            h = block(h)
        return h, h.square().mean()


class _BlocksOnly:
    """:class:`_Blocks` as a strategy of :func:`_step`, with no optimizer step (only
    ``zero_grad``)."""

    def __init__(self, model: GPT) -> None:
        self.module = _Blocks(model)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.0)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def before_step(self) -> None:
        pass

    def step(self) -> None:
        pass


def _strategy(name: str, config: Any, spec: Mapping[str, Any]) -> Any:
    """The main job's strategy ``name`` ("torch DDP", "shardkit <key>"), torch FSDP2
    ("torch FSDP2": ``fully_shard`` per Block and the root, AdamW) or "blocks" (the
    transformer blocks' forward and backward alone, no wrapper, no communication, no
    optimizer step), each optionally ``+ compile``."""
    base = name.removesuffix(COMPILED)
    torch.manual_seed(0)
    model = GPT(config)
    if name.endswith(COMPILED):
        compile_blocks(model)
    if base == "blocks":
        return _BlocksOnly(model)
    if base == "torch FSDP2":
        module = build_torch_fsdp2(model)
        return Strategy(module, torch.optim.AdamW(module.parameters(), **ADAMW))
    key = "ddp" if base == "torch DDP" else base.removeprefix("shardkit ")
    return MAIN_JOB[key](model, _registry_config(key, spec), torch.device("cpu"))


def dynamo_counts() -> dict[str, int]:
    """What ``torch.compile`` did in this process so far: graphs compiled
    (``unique_graphs``: a recompile adds one) and graph breaks."""
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def _step(strategy: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    with record_function(PHASES[0]):
        _, loss = strategy.module(x, targets=y)
    with record_function(PHASES[1]):
        strategy.backward(loss)
    with record_function(PHASES[2]):
        strategy.before_step()
        strategy.step()
        strategy.optimizer.zero_grad(set_to_none=True)


def _row(event: Any, steps: int) -> dict[str, Any]:
    return {
        "name": event.key,
        "self_ms": event.self_cpu_time_total / 1e3 / steps,
        "total_ms": event.cpu_time_total / 1e3 / steps,
        "calls": event.count / steps,
    }


def profile_rank(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Body of every rank: build, warm up, time ``spec["steps"]`` plain steps, then
    profile as many; rank 0 returns the tables (ms per step)."""
    config = model_config(spec["size"], spec["seq_len"])
    strategy = _strategy(spec["strategy"], config, spec)
    x, y = _batch(config, spec["batch"])
    for _ in range(spec["warmup"]):
        _step(strategy, x, y)
    after_warmup = dynamo_counts()
    times = []
    for _ in range(spec["steps"]):
        dist.barrier()
        start = time.perf_counter()
        _step(strategy, x, y)
        times.append(slowest(time.perf_counter() - start))
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(spec["steps"]):
            _step(strategy, x, y)
    dist.barrier()
    events = prof.key_averages()
    steps = spec["steps"]
    rows = sorted((_row(e, steps) for e in events), key=lambda r: -r["self_ms"])
    labels = [r for r in rows if "::" in r["name"] and not r["name"].startswith("aten::")]
    return {
        "times": times,
        "dynamo": {"after_warmup": after_warmup, "after_profile": dynamo_counts()},
        "phases": {r["name"]: r["total_ms"] for r in rows if r["name"] in PHASES},
        "top_self": rows[: spec["top"]],
        "labels": sorted(labels, key=lambda r: -r["total_ms"]),
    }


def _print(name: str, result: dict[str, Any]) -> None:
    times = sorted(result["times"])
    print(f"\n== {name}: step median {1e3 * times[len(times) // 2]:.1f} ms (slowest rank)")
    print("   phases: " + ", ".join(f"{k} {v:.1f}" for k, v in result["phases"].items()))
    print(f"   torch.compile: {result['dynamo']}")
    print(f"   {'top self CPU (ms/step)':<46}{'self':>8}{'total':>9}{'calls':>7}")
    for row in result["top_self"]:
        print(
            f"   {row['name'][:46]:<46}{row['self_ms']:8.2f}{row['total_ms']:9.2f}{row['calls']:7.0f}"
        )
    print("   labels by total CPU (ms/step)")
    for row in result["labels"]:
        print(
            f"   {row['name'][:46]:<46}{row['self_ms']:8.2f}{row['total_ms']:9.2f}{row['calls']:7.0f}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_step", description=__doc__)
    add_strategy_args(parser)
    parser.add_argument("--steps", type=int, default=5, help="timed and profiled steps")
    parser.add_argument("--top", type=int, default=20, help="rows of the self-time table")
    add_run_args(parser, batch=8, timeout_s=900)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for name in args.strategies:
        spec = {
            "strategy": name,
            "size": args.size,
            "seq_len": args.seq_len,
            "batch": args.batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "top": args.top,
        }
        results[name] = run_distributed(
            profile_rank, args.world_size, spec, timeout_s=args.timeout
        )[0]
        _print(name, results[name])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"profile-{timestamp()}.json"
    path.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, **results}, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
