"""Pieces shared by the benchmarks: GPT flags, rank-side measurements, machine description.

Every benchmark in this folder trains the GPT of :mod:`shardkit.models` on
spawned gloo ranks and reports step time, peak RSS and model-state bytes. What they
share lives here, so that a number means the same thing in every table:

- :func:`add_gpt_args` / :func:`gpt_config_from`: the command-line flags of the GPT
  and the run (one spelling for every benchmark).
- :func:`slowest`: a step's time is the slowest rank's (an all-reduce of the maximum).
- :func:`peak_rss_bytes`: ``VmHWM`` of this process, not ``getrusage().ru_maxrss``
  (which Linux carries across ``execve`` from the parent, so a spawned rank would
  report its parent's peak).
- :func:`local_state_bytes`: :func:`shardkit.memory.model_state_bytes` of this rank's
  local tensors, also for torch FSDP2's ``DTensor`` parameters (their local shard).
- :func:`machine`: CPU count and model, torch version, load average: written into
  every result file next to the command that made it.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from shardkit.memory import model_state_bytes
from shardkit.models import GPT, Block, GPTConfig

RESULTS = Path(__file__).resolve().parent / "results"
"""Where every benchmark writes its JSON / Markdown / PNG files."""

ADAMW: dict[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.01}
"""The optimizer settings of every benchmark: AdamW, fp32."""

MIB = 2**20


def add_gpt_args(
    parser: argparse.ArgumentParser,
    *,
    n_layer: int = 6,
    n_embd: int = 512,
    n_head: int = 8,
    vocab: int = 8192,
    seq_len: int = 128,
    batch: int = 8,
    steps: int = 5,
    rounds: int = 2,
) -> None:
    """Add the GPT shape and run-length flags (defaults: the ANCHORS.md GPT, 27.4M params).

    Flags: ``--n-layer --n-embd --n-head --vocab --seq-len`` (the model),
    ``--batch`` (sequences per rank), ``--steps`` (timed steps per configuration and
    round), ``--rounds`` (interleaved rounds).
    """
    add = parser.add_argument
    add("--n-layer", type=int, default=n_layer, help=f"blocks (default {n_layer})")
    add("--n-embd", type=int, default=n_embd, help=f"width (default {n_embd})")
    add("--n-head", type=int, default=n_head, help=f"attention heads (default {n_head})")
    add("--vocab", type=int, default=vocab, help=f"vocabulary size (default {vocab})")
    add("--seq-len", type=int, default=seq_len, help=f"tokens per sequence (default {seq_len})")
    add("--batch", type=int, default=batch, help=f"sequences per rank (default {batch})")
    add("--steps", type=int, default=steps, help=f"timed steps per round (default {steps})")
    add("--rounds", type=int, default=rounds, help=f"interleaved rounds (default {rounds})")


def add_strategy_args(parser: argparse.ArgumentParser) -> None:
    """Add the flags of the benchmarks that build several strategies in the same ranks
    (:mod:`benchmarks.interleaved`, :mod:`benchmarks.profile_step`): ``--strategies``
    (default torch DDP, shardkit sdp, shardkit fsdp), ``--size`` (default anchor),
    ``--warmup`` (untimed steps, default 2) and ``--world-size`` (default 2)."""
    add = parser.add_argument
    add("--strategies", nargs="+", default=["torch DDP", "shardkit sdp", "shardkit fsdp"])
    add("--size", default="anchor", help="model size (default anchor)")
    add("--warmup", type=int, default=2, help="untimed steps (default 2)")
    add("--world-size", type=int, default=2)


def add_run_args(
    parser: argparse.ArgumentParser, *, batch: int, seq_len: int = 128, timeout_s: float = 900.0
) -> None:
    """Add ``--batch`` (sequences per rank), ``--seq-len`` (tokens), ``--timeout``
    (seconds per run, default ``timeout_s``: 900) and ``--out`` (results folder, default
    ``benchmarks/results``)."""
    add = parser.add_argument
    add("--batch", type=int, default=batch, help=f"sequences per rank (default {batch})")
    add("--seq-len", type=int, default=seq_len, help=f"tokens per sequence (default {seq_len})")
    add("--timeout", type=float, default=timeout_s, help=f"seconds per run (default {timeout_s:g})")
    add("--out", type=Path, default=RESULTS, help="results folder (default benchmarks/results)")


def gpt_config_from(args: Mapping[str, Any]) -> GPTConfig:
    """The :class:`GPTConfig` of parsed :func:`add_gpt_args` flags (``vars(namespace)``)."""
    return GPTConfig(
        vocab_size=args["vocab"],
        block_size=args["seq_len"],
        n_layer=args["n_layer"],
        n_head=args["n_head"],
        n_embd=args["n_embd"],
    )


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (a collective: call it on every rank)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def status_bytes(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` / ... of this process from ``/proc/self/status``, in bytes.

    Raises:
        KeyError: if the field is not there (not Linux).
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"{key} not in /proc/self/status")


def peak_rss_bytes() -> int:
    """Peak resident set of this process image (``VmHWM``), in bytes.

    Not ``getrusage().ru_maxrss``: Linux carries ``ru_maxrss`` across ``execve`` from
    the forking parent, so a spawned child of a large process would report the
    parent's peak. ``VmHWM`` belongs to the current address space.
    """
    return status_bytes("VmHWM")


RSS_EXIT_CODE = 86
"""Exit code of a rank that :func:`start_rss_watchdog` ended (over its memory limit)."""


def start_rss_watchdog(limit_bytes: int, interval_s: float = 0.005) -> threading.Thread:
    """End this process (exit code :data:`RSS_EXIT_CODE`) once its resident set
    (``VmRSS``) exceeds ``limit_bytes``; polls every ``interval_s`` seconds in a daemon
    thread. A spike shorter than the interval can slip through: check
    :func:`peak_rss_bytes` against the limit afterwards as well.
    """

    def watch() -> None:
        while True:
            rss = status_bytes("VmRSS")
            if rss > limit_bytes:
                print(
                    f"RSS watchdog: resident set {rss / MIB:.0f} MiB over the limit "
                    f"{limit_bytes / MIB:.0f} MiB",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(RSS_EXIT_CODE)
            time.sleep(interval_s)

    thread = threading.Thread(target=watch, name="rss-watchdog", daemon=True)
    thread.start()
    return thread


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # torch DTensor: this rank's shard
    return cast(torch.Tensor, to_local()) if callable(to_local) else t


def local_state_bytes(
    module: nn.Module, optimizer_state: Mapping[Any, Any] | None = None
) -> dict[str, int]:
    """Model-state bytes this rank holds, by category (``parameters``, ``gradients``,
    ``optimizer_state``, ``buffers``, ``total``; bytes).

    :func:`shardkit.memory.model_state_bytes` over this rank's local tensors: a torch
    ``DTensor`` (FSDP2) counts its local shard. ``optimizer_state`` is the mapping that
    holds this rank's optimizer state (``optimizer.state``; for torch
    ``ZeroRedundancyOptimizer`` its local ``optim.state``); None counts 0.
    """
    holder = nn.Module()
    params = list(module.parameters())
    holder.params = nn.ParameterList(
        [nn.Parameter(_local(p.detach()), requires_grad=False) for p in params]
    )
    for mine, p in zip(holder.params, params):
        if p.grad is not None:
            mine.grad = _local(p.grad)
    for i, b in enumerate(module.buffers()):
        holder.register_buffer(f"b{i}", _local(b))
    state: dict[Any, Any] = {}
    for key, per_param in (optimizer_state or {}).items():
        values = per_param.items() if isinstance(per_param, dict) else [("v", per_param)]
        state[key] = {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in values}
    fake_optimizer = cast(torch.optim.Optimizer, SimpleNamespace(state=state))
    return model_state_bytes(holder, fake_optimizer).as_dict()


def build_torch_fsdp2(model: GPT) -> nn.Module:
    """torch FSDP2: ``fully_shard`` on every :class:`Block`, then on the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return cast(nn.Module, fully_shard(model))


def build_shardkit_fsdp(model: GPT) -> nn.Module:
    """shardkit FSDP: one unit per :class:`Block` (``auto_wrap``) inside a root unit."""
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
    from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy

    with enable_wrap(wrapper_cls=FSDP):
        wrapped = auto_wrap(model, transformer_auto_wrap_policy({Block}))
    return FSDP(wrapped)


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (empty where the OS has none)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


def cpu_model() -> str:
    """The CPU model name from ``/proc/cpuinfo`` (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """A description of this machine for result files (load average at call time)."""
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg": loadavg(),
    }


#: environment variables that change the allocator, hence peak RSS and step time
ALLOCATOR_ENV = (
    "GLIBC_TUNABLES",
    "LD_PRELOAD",
    "MALLOC_ARENA_MAX",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
)


def command(module: str, argv: list[str] | None) -> str:
    """The command line that ran ``python -m module`` with ``argv`` (default sys.argv),
    preceded by the allocator settings of :data:`ALLOCATOR_ENV` that were set."""
    args = sys.argv[1:] if argv is None else argv
    env = [f"{k}={os.environ[k]}" for k in ALLOCATOR_ENV if os.environ.get(k)]
    return shlex.join([*env, "python", "-m", module, *args])


def timestamp() -> str:
    """Local time as ``YYYYmmdd-HHMMSS`` (result file names)."""
    return time.strftime("%Y%m%d-%H%M%S")
