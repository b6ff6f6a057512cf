"""Step time with a checkpoint every N steps: none, synchronous, asynchronous; paired rounds.

Run::

    python -m benchmarks.async_checkpoint                    # anchor GPT, 2 ranks, every 10
    python -m benchmarks.async_checkpoint --rounds 5 --every 10 --size anchor

One set of spawned gloo ranks (one thread each) trains the anchor GPT of
``benchmarks.compare`` under torch DDP with AdamW. A *window* is ``--every`` training
steps with one universal checkpoint of the model and optimizer (``--keep 1``, in
``--dir``) taken right after the window's first step:

- ``none``: no checkpoint;
- ``sync``: :func:`shardkit.checkpoint.universal.save_universal` (every rank waits
  for the commit);
- ``async``: :class:`shardkit.checkpoint.universal.AsyncCheckpointer` (the state is
  copied to host memory, the write, sha256 and commit overlap the window's next steps);
  the window ends by waiting for the commit, and that wait is counted, so a write
  slower than the window shows up as it would in a run.

A window's time is the sum of its steps' times, each the slowest rank's (wall and CPU
time of the process, the background thread's included). Each round runs one window of
every mode, the order rotating by one per round (after untimed warm-up steps and one
untimed save of each kind); a mode's overhead is the median over rounds of its window
time over the ``none`` window of the same round, minus 1 (paired: the load of other
jobs moves both alike). Also reported: bytes per checkpoint, the caller's blocked time
per save (sync: the whole save; async: building and copying the pieces) and the
background write time.

Printed and written to ``benchmarks/results/async_checkpoint-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import ADAMW, add_run_args, machine, slowest, timestamp
from benchmarks.compare import SIZES, _batch, model_config
from shardkit.checkpoint.universal import AsyncCheckpointer, AsyncSave, save_universal
from shardkit.models import GPT
from shardkit.testing import run_distributed

MODES = ("none", "sync", "async")


class Trainer:
    """The GPT under torch DDP with AdamW, its batch, and both ways to save."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        config = model_config(spec["size"], spec["seq_len"])
        self.x, self.y = _batch(config, spec["batch"])
        self.model = DistributedDataParallel(GPT(config))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **ADAMW)
        self.checkpointer = AsyncCheckpointer()
        self.root = Path(spec["dir"])
        self.step_index = 0
        self.saves: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
        self.handle: AsyncSave | None = None

    def step(self) -> None:
        self.step_index += 1
        _, loss = self.model(self.x, self.y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def save(self, mode: str) -> None:
        root = self.root / mode
        if mode == "sync":
            start = time.perf_counter()
            save_universal(root, self.step_index, self.model, self.optimizer, keep=1)
            self.saves["sync"].append({"blocked_s": time.perf_counter() - start})
        elif mode == "async":
            self.handle = self.checkpointer.save(
                root, self.step_index, self.model, self.optimizer, keep=1
            )

    def finish(self, mode: str) -> None:
        """The end of a window: the async commit waited for (its wait is timed)."""
        if mode == "async" and self.handle is not None:
            start = time.perf_counter()
            self.checkpointer.wait()
            h = self.handle
            self.saves["async"].append(
                {
                    "blocked_s": h.waited_s + h.staged_s,
                    "written_s": h.written_s or 0.0,
                    "end_wait_s": time.perf_counter() - start,
                }
            )


def window(trainer: Trainer, mode: str, every: int) -> tuple[float, float]:
    """One window of ``mode``: (wall s, CPU s), each step the slowest rank's."""
    wall = cpu = 0.0
    for i in range(every):
        dist.barrier()
        start, cpu0 = time.perf_counter(), time.process_time()
        trainer.step()
        if i == 0:
            trainer.save(mode)
        if i == every - 1:
            trainer.finish(mode)
        wall += slowest(time.perf_counter() - start)
        cpu += slowest(time.process_time() - cpu0)
    return wall, cpu


def bench_rank(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Body of every rank: per mode, per round, the window's wall and CPU seconds."""
    trainer = Trainer(spec)
    for _ in range(spec["warmup"]):
        trainer.step()
    for mode in MODES:  # untimed: the staging buffer, the directories, the page cache
        window(trainer, mode, 2)
    trainer.saves = {"sync": [], "async": []}
    times: dict[str, dict[str, list[float]]] = {k: {m: [] for m in MODES} for k in ("wall", "cpu")}
    for r in range(spec["rounds"]):
        for mode in MODES[r % 3 :] + MODES[: r % 3]:
            wall, cpu = window(trainer, mode, spec["every"])
            times["wall"][mode].append(wall)
            times["cpu"][mode].append(cpu)
    staging = trainer.checkpointer.staging_bytes
    trainer.checkpointer.close()
    root = Path(spec["dir"]) / "sync"
    saved = [p for p in root.iterdir() if p.name.startswith("ckpt-")]
    nbytes = sum(f.stat().st_size for f in saved[0].iterdir()) if saved else 0
    return {
        "times": times,
        "saves": trainer.saves,
        "checkpoint_bytes": nbytes,
        "staging_bytes_per_rank": staging,
        "params": sum(p.numel() for p in trainer.model.parameters()),
    }


def summarize(times: Mapping[str, list[float]], every: int) -> dict[str, dict[str, float]]:
    """Per mode: median step (ms) and the round-paired overhead over ``none``."""
    base = times["none"]
    out = {}
    for mode, windows in times.items():
        ratios = [w / b for w, b in zip(windows, base, strict=True)]
        out[mode] = {
            "median_step_ms": 1e3 * statistics.median(windows) / every,
            "overhead": statistics.median(ratios) - 1.0,
            "overhead_min": min(ratios) - 1.0,
            "overhead_max": max(ratios) - 1.0,
        }
    return out


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows) if rows else float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.async_checkpoint", description=__doc__.split("\n")[0]
    )
    add = parser.add_argument
    add("--size", default="anchor", choices=sorted(SIZES), help="model size (default anchor)")
    add("--every", type=int, default=10, help="steps per checkpoint (default 10)")
    add("--rounds", type=int, default=3, help="paired rounds (default 3)")
    add("--warmup", type=int, default=2, help="untimed steps (default 2)")
    add("--world-size", type=int, default=2)
    add("--dir", type=Path, default=None, help="checkpoint root (default: a temporary one)")
    add_run_args(parser, batch=8, timeout_s=3600)
    args = parser.parse_args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="async-ckpt-bench-"))
    spec = {**{k: getattr(args, k) for k in ("size", "every", "rounds", "warmup")}}
    spec.update(seq_len=args.seq_len, batch=args.batch, dir=str(root))
    try:
        out = run_distributed(bench_rank, args.world_size, spec, timeout_s=args.timeout)[0]
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    summary = {kind: summarize(t, args.every) for kind, t in out["times"].items()}
    print(
        f"{args.size} GPT, {out['params'] / 1e6:.1f}M parameters, {args.world_size} ranks, "
        f"a checkpoint every {args.every} steps ({out['checkpoint_bytes'] / 2**20:.0f} MiB; "
        f"staging {out['staging_bytes_per_rank'] / 2**20:.0f} MiB per rank), "
        f"{args.rounds} paired rounds"
    )
    for kind, rows in summary.items():
        print(f"{kind + ' time':<10}{'step ms':>9}{'overhead':>10}  range")
        for mode, row in rows.items():
            print(
                f"{mode:<10}{row['median_step_ms']:9.0f}{100 * row['overhead']:9.1f}%"
                f"  [{100 * row['overhead_min']:.1f}%, {100 * row['overhead_max']:.1f}%]"
            )
    saves = out["saves"]
    print(
        f"per save: sync blocked {_median(saves['sync'], 'blocked_s'):.2f} s; async blocked "
        f"{_median(saves['async'], 'blocked_s'):.2f} s, written in the background in "
        f"{_median(saves['async'], 'written_s'):.2f} s, waited at the window's end "
        f"{_median(saves['async'], 'end_wait_s'):.2f} s"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"async_checkpoint-{timestamp()}.json"
    record = {
        "args": {**vars(args), "out": str(args.out), "dir": str(args.dir)},
        "machine": machine(),
        **out,
        "summary": summary,
    }
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
