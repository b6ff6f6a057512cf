"""Lose a replica and keep training: the main job's ``--fault-tolerant`` mode on loopback.

Two replicas of the tiny GPT (``examples/train_gpt.py --fault-tolerant``, each a
``torchrun --standalone`` agent of ``--ranks-per-replica`` workers running
``--strategy``, default 2 ranks of hsdp; one plain process per replica with
``--ranks-per-replica 1``) train against a quorum store hosted by this process. After
replica 1 commits step ``--kill-after`` its agent and workers are SIGKILLed at a
random point of its next step; it is started again (same replica id, fresh
processes) ``--delay`` seconds later, heals from replica 0 over the network (the
parts of a universal checkpoint) and trains in lockstep to the end. An uninterrupted
pair of replicas with the same flags is the reference::

    python -m benchmarks.live_recovery --out DIR [--steps 20 --kill-after 6 --delay 5]

Writes ``DIR/live_recovery.json``: ``survivor_restarts`` (process restarts of replica
0: 0 when its process ran from start to end), ``steps_lost`` (steps replica 0 committed
twice or never: 0 when its steps are exactly 1..steps), ``detect_s`` (from the kill to
replica 0's first committed step without replica 1), ``rejoin_s`` (from the restart to
the restarted replica's first committed step: process start-up, quorum, transfer),
``rejoin_bytes``, ``val_loss_rel_diff`` (replica 0's final validation loss against the
uninterrupted run's) and ``restart_based`` (what the restart-based path loses for the
same kill: the steps since the last checkpoint every ``--save-every-restart`` steps;
its wall time is not measured here, see ``docs/elastic.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, machine
from shardkit.distributed.fault_tolerance import host_store

ROOT = Path(__file__).resolve().parent.parent


def _replica(
    args: argparse.Namespace, port: int, replica: int, out: Path
) -> subprocess.Popen[bytes]:
    launcher = [sys.executable]
    if args.ranks_per_replica > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone"]
        launcher += ["--nproc-per-node", str(args.ranks_per_replica)]
    command = [
        *launcher, str(ROOT / "examples" / "train_gpt.py"),
        "--fault-tolerant", f"127.0.0.1:{port}", "--replica-id", str(replica),
        "--max-replicas", "2", "--strategy", args.strategy, "--model-size", "tiny",
        "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
        "--steps", str(args.steps), "--eval-every", "0", "--save-every", "0",
        "--ft-timeout", str(args.ft_timeout), "--out-dir", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = (out.parent / f"{out.name}.log").open("wb")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def _descendants(pid: int) -> list[int]:
    """``pid``'s children, grandchildren, ... (Linux ``/proc``)."""
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        children = [int(c) for t in tasks for c in (t / "children").read_text().split()]
    except OSError:
        return []
    return [d for c in children for d in (c, *_descendants(c))]


def _kill_tree(pid: int) -> None:
    """SIGKILL a replica: its process (the torchrun agent) first, so it restarts
    nothing, then its workers (torchrun puts them in sessions of their own)."""
    workers = _descendants(pid)
    for target in (pid, *workers):
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)


def _steps(out: Path) -> list[dict[str, Any]]:
    path = out / "ft_steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _val_loss(out: Path) -> float:
    return float(json.loads((out / "metrics.json").read_text())["val_loss"][-1][1])


def _pair(args: argparse.Namespace, work: Path, name: str, kill: bool) -> dict[str, Any]:
    store = host_store(0)
    outs = [work / f"{name}-r0", work / f"{name}-r1"]
    for out in outs:
        out.mkdir(parents=True, exist_ok=True)
    procs = [_replica(args, store.port, r, outs[r]) for r in (0, 1)]
    result: dict[str, Any] = {}
    if kill:
        while len(_steps(outs[1])) < args.kill_after:
            if procs[1].poll() is not None:
                raise RuntimeError(f"replica 1 exited early: {outs[1]}.log")
            time.sleep(0.05)
        step_s = _steps(outs[1])[-1]["time"] - _steps(outs[1])[-2]["time"]
        time.sleep(random.Random(args.seed).uniform(0.0, step_s))  # a random point of the step
        _kill_tree(procs[1].pid)
        procs[1].wait()
        killed_at = time.time()
        time.sleep(args.delay)
        restarted_at = time.time()
        joiner_out = work / f"{name}-r1-restarted"
        joiner_out.mkdir(parents=True, exist_ok=True)
        procs[1] = _replica(args, store.port, 1, joiner_out)
        result.update(killed_at=killed_at, restarted_at=restarted_at, joiner_out=joiner_out)
    codes = [p.wait(timeout=args.timeout_s) for p in procs]
    if any(codes):
        raise RuntimeError(f"replica exit codes {codes}; see the logs in {work}")
    return {**result, "outs": outs, "val_loss": _val_loss(outs[0])}


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    reference = _pair(args, work, "uninterrupted", kill=False)
    run = _pair(args, work, "kill", kill=True)
    survivor = _steps(run["outs"][0])
    joiner = _steps(run["joiner_out"])
    without = [s for s in survivor if 1 not in s["members"] and s["time"] > run["killed_at"]]
    steps = [s["step"] for s in survivor]
    lost = len(set(range(1, args.steps + 1)) ^ set(steps)) + len(steps) - len(set(steps))
    kill_step = args.kill_after + 1
    last_ckpt = (kill_step - 1) // args.save_every_restart * args.save_every_restart
    return {
        "survivor_restarts": 0,  # replica 0's process ran from start to end (exit code 0)
        "steps_lost": lost,
        "detect_s": without[0]["time"] - run["killed_at"] if without else None,
        "rejoin_s": joiner[0]["time"] - run["restarted_at"] if joiner else None,
        "rejoin_bytes": joiner[0]["healed_bytes"] if joiner else None,
        "steps_without_replica_1": len([s for s in survivor if 1 not in s["members"]]),
        "val_loss": run["val_loss"],
        "val_loss_uninterrupted": reference["val_loss"],
        "val_loss_rel_diff": abs(run["val_loss"] - reference["val_loss"]) / reference["val_loss"],
        "restart_based": {
            "survivor_restarts": 1,
            "steps_lost": kill_step - 1 - last_ckpt,
            "save_every": args.save_every_restart,
            "wall_s_lost": None,  # not measured by this benchmark: see docs/elastic.md
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--strategy", default="hsdp", choices=["ddp", "oss", "sdp", "hsdp"])
    parser.add_argument("--ranks-per-replica", type=int, default=2)
    parser.add_argument("--kill-after", type=int, default=6, help="replica 1's committed steps")
    parser.add_argument("--delay", type=float, default=5.0, help="seconds before the restart")
    parser.add_argument("--ft-timeout", type=float, default=5.0)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--save-every-restart", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=1200.0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    work = out / "live_recovery_runs"
    result = {**measure(args, work), "args": vars(args), "machine": machine()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "live_recovery.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
