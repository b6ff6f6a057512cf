"""Lose a replica and keep training: ``--fault-tolerant`` against the restart-based path.

Both paths train the same job on loopback: the tiny GPT over 2 replica groups of
``--ranks-per-replica`` ranks (default 2 ranks of hsdp each: global batch
``--batch-size x 2 x ranks``), and lose a rank of the second group at the same point:
after ``--kill-after`` committed steps, at a random point of the next step.

- **fault_tolerant**: two ``torchrun --standalone`` agents (``examples/train_gpt.py
  --fault-tolerant``; one plain process per replica with ``--ranks-per-replica 1``)
  against a quorum store hosted by this process. Replica 1's agent and workers are
  SIGKILLed; the same command starts again ``--delay`` seconds later, heals from
  replica 0 over the network and trains in lockstep to the end.
- **restart_based**: one ``torchrun --max-restarts 1`` agent of all the ranks
  (``--strategy hsdp --dp-replicate 2``, or the strategy over every rank), a
  checkpoint every ``--save-every-restart`` steps, ``--resume``. One worker is
  SIGKILLed; torchrun restarts every worker, which resume from the last checkpoint.
- **joiner_late**: the fault-tolerant kill with the restart ``--late-delay`` seconds
  after the kill instead of ``--delay``: the joiner meets a survivor further ahead
  (``--late-delay 0``: not run).
- **joiner_layout** (with ``--joiner-strategy``): the fault-tolerant kill with the
  restart in another layout, ``--joiner-strategy`` over ``--joiner-ranks`` ranks (one
  plain process for 1): it heals across layouts and trains in lockstep through the
  reduction in the plain model's index space.

Every job and replica runs the same global batch (:func:`global_batch`); a replica of
``W`` ranks runs its half as one micro-batch of ``global_batch / 2 / W`` rows per rank.
The default ``--steps 300`` leaves the joiner time to rejoin: its start-up (``torchrun``,
two interpreters importing torch, the heal) takes 10-40 s on the shared 2-core machine,
while the survivor alone commits a step every 0.1-0.2 s; 80 steps ended before it, 150
before joiner_late's (``--late-delay`` 10 s, was 15).

Each killed run is paired with an uninterrupted run of the same path and flags, and
``--rounds`` rounds run the two paths in ABBA order (fault-tolerant first in even
rounds), so that the machine's load weighs on both alike::

    python -m benchmarks.live_recovery --out DIR --rounds 3

Writes ``DIR/live_recovery-<date>.json``: per round and as medians over rounds, for
each path ``steps_lost`` (steps trained twice: the restart-based path redoes those
since its last checkpoint; 0 when the survivor commits each step 1..steps once),
``wall_s_lost`` (the killed run's wall time minus its uninterrupted pair's: for the
fault-tolerant path the survivor's, replica 0), ``survivor_restarts`` and
``val_loss_rel_diff`` (the final validation loss against the uninterrupted pair's);
for the fault-tolerant paths also ``step_s`` (replica 0's median time per committed
step), ``detect_s`` (from the kill to the survivor's first committed step without
replica 1), ``rejoin_s`` (from the joiner's start to its first committed step: process
start-up, quorum, transfer; None when the survivor finished first), ``rejoin_bytes``
(per joiner rank), ``steps_alone`` and ``alone_step_s`` (the survivor's steps without
replica 1, and their median time), ``steps_lockstep`` and ``lockstep_step_s`` (the
joiner's committed steps, and the survivor's median time per step from the joiner's
first), ``lockstep_equal`` and ``lockstep_max_diff`` (the joiner's final ``model.pt``
against the survivor's: the plain model's consolidated tensors, whatever the layouts;
equal bit for bit, and the largest absolute difference). A replica 0 that committed
every step and wrote its files but then exited non-zero is kept (``exit_codes``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, loadavg, machine, timestamp
from shardkit.distributed.fault_tolerance import host_store

ROOT = Path(__file__).resolve().parent.parent
_STEP_LINE = re.compile(r"step\s+(\d+)/\d+ \| train \d")  # after a progress bar's \r too
_RESUMED = re.compile(
    r"resumed from \S+ at step (\d+)|no checkpoint in \S+; starting from step (0)"
)


def _job_flags(args: argparse.Namespace, out: Path, batch_size: int | None = None) -> list[str]:
    return [
        str(ROOT / "examples" / "train_gpt.py"), "--model-size", "tiny",
        "--seq-len", str(args.seq_len), "--batch-size", str(batch_size or args.batch_size),
        "--global-batch", str(global_batch(args)), "--steps", str(args.steps),
        "--eval-every", "0", "--log-every", "1", "--out-dir", str(out),
    ]  # fmt: skip


def global_batch(args: argparse.Namespace) -> int:
    """Sequences per step, every job and replica alike: ``--batch-size x 2 x
    --ranks-per-replica``; a replica of ``W`` ranks runs it as one micro-batch of
    ``global_batch / 2 / W`` rows per rank."""
    return int(args.batch_size * 2 * args.ranks_per_replica)


def _torchrun(ranks: int, *extra: str) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*command, "--nproc-per-node", str(ranks), *extra]


def _fresh(out: Path) -> Path:
    """``out`` emptied: a run never appends to an earlier run's ``ft_steps.jsonl`` nor
    resumes from its checkpoints (the kill is timed from these files)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


def _start(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with log.open("wb") as handle:
        return subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT)


def _replica(
    args: argparse.Namespace, port: int, replica: int, out: Path, layout: bool = False
) -> subprocess.Popen[bytes]:
    """One fault-tolerant replica group (a torchrun agent, or one plain process); with
    ``layout``, ``--joiner-strategy`` over ``--joiner-ranks`` ranks."""
    _fresh(out)
    strategy, ranks = joiner_layout(args) if layout else (args.strategy, args.ranks_per_replica)
    launcher = _torchrun(ranks) if ranks > 1 else [sys.executable]
    rows = global_batch(args) // 2 // ranks  # one micro-batch per rank, whatever its ranks
    command = [
        *launcher, *_job_flags(args, out, rows), "--strategy", strategy, "--save-every", "0",
        "--fault-tolerant", f"127.0.0.1:{port}", "--replica-id", str(replica),
        "--max-replicas", "2", "--ft-timeout", str(args.ft_timeout),
    ]  # fmt: skip
    return _start(command, out.parent / f"{out.name}.log")


def joiner_layout(args: argparse.Namespace) -> tuple[str, int]:
    """The joiner_layout case's restarted replica: (strategy, ranks)."""
    return args.joiner_strategy, args.joiner_ranks or args.ranks_per_replica


def _restart_job(args: argparse.Namespace, out: Path) -> subprocess.Popen[bytes]:
    """The restart-based job: one torchrun agent of both groups' ranks."""
    _fresh(out)
    layout = ["--strategy", args.strategy]
    if args.strategy == "hsdp":  # 2 replica groups sharded over ranks_per_replica each
        layout += ["--dp-replicate", "2"]
    command = [
        *_torchrun(2 * args.ranks_per_replica, "--max-restarts", "1"), *_job_flags(args, out),
        *layout, "--save-every", str(args.save_every_restart), "--keep", "0", "--resume",
    ]  # fmt: skip
    return _start(command, out.parent / f"{out.name}.log")


def _descendants(pid: int) -> list[int]:
    """``pid``'s children, grandchildren, ... (Linux ``/proc``)."""
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        children = [int(c) for t in tasks for c in (t / "children").read_text().split()]
    except OSError:
        return []
    return [d for c in children for d in (c, *_descendants(c))]


def _kill(pids: list[int]) -> None:
    for target in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)


def _ft_steps(out: Path) -> list[dict[str, Any]]:
    path = out / "ft_steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _logged_steps(log: Path) -> list[int]:
    """The ``step N/`` lines a job's rank 0 printed (``--log-every 1``), in order."""
    return [int(m) for m in _STEP_LINE.findall(log.read_text(errors="replace"))]


def _val_loss(out: Path) -> float:
    return float(json.loads((out / "metrics.json").read_text())["val_loss"][-1][1])


def _wait_until(done: Any, procs: list[subprocess.Popen[bytes]], what: str) -> None:
    while not done():
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process exited before {what}")
        time.sleep(0.05)


def _random_point(args: argparse.Namespace, step_s: float, round_: int) -> None:
    time.sleep(random.Random(args.seed * 1000 + round_).uniform(0.0, max(step_s, 0.0)))


def _finish(
    procs: list[subprocess.Popen[bytes]], args: argparse.Namespace
) -> tuple[list[int], float]:
    """Exit codes, and when replica 0 ended; a joiner still waiting at a quorum after
    replica 0 ended is killed after ``--grace-s`` (code -1: it never finished)."""
    codes = [procs[0].wait(timeout=args.timeout_s)]
    ended = time.time()
    for proc in procs[1:]:
        try:
            codes.append(proc.wait(timeout=args.grace_s))
        except subprocess.TimeoutExpired:
            _kill([proc.pid, *_descendants(proc.pid)])
            proc.wait()
            codes.append(-1)
    return codes, ended


def fault_tolerant(args: argparse.Namespace, work: Path, case: str, round_: int) -> dict[str, Any]:
    """One pair of replicas; ``case``: "uninterrupted", "kill", "late" (a kill with
    the restart ``--late-delay`` seconds later: joiner_late) or "layout" (a kill, the
    restart with ``--joiner-strategy`` over ``--joiner-ranks``: joiner_layout)."""
    store = host_store(0)
    name = f"round{round_}-ft-{case}"
    outs = [work / f"{name}-r0", work / f"{name}-r1"]
    start = time.time()
    procs = [_replica(args, store.port, r, outs[r]) for r in (0, 1)]
    result: dict[str, Any] = {"loadavg": loadavg()}
    joiner_out, joined_at = outs[1], start
    if case != "uninterrupted":
        _wait_until(lambda: len(_ft_steps(outs[1])) >= args.kill_after, procs, "the kill")
        times = [s["time"] for s in _ft_steps(outs[1])]
        _random_point(args, times[-1] - times[-2] if len(times) > 1 else 0.0, round_)
        _kill([procs[1].pid, *_descendants(procs[1].pid)])  # the agent first: no restart
        procs[1].wait()
        result["killed_at"] = time.time()
        time.sleep(args.late_delay if case == "late" else args.delay)
        joiner_out = work / f"{name}-r1-restarted"
        joined_at = time.time()
        procs[1] = _replica(args, store.port, 1, joiner_out, layout=case == "layout")
    codes, ended = _finish(procs, args)
    result["wall_s"] = ended - start  # to the survivor's (replica 0's) exit
    if codes[0] != 0 and not _trained(outs[0], args.steps):
        raise RuntimeError(f"replica 0 exited with {codes[0]}; see {outs[0]}.log")
    result.update(val_loss=_val_loss(outs[0]), exit_codes=codes)
    result["step_s"] = _median_gap(_ft_steps(outs[0]), lambda s: True)
    if case != "uninterrupted":
        result.update(_ft_events(args, outs[0], joiner_out, result.get("killed_at"), joined_at))
    return result


def _trained(out: Path, steps: int) -> bool:
    """Whether a replica committed ``steps`` and wrote ``metrics.json`` and ``model.pt``
    (it may still exit non-zero afterwards: ``exit_codes`` keeps the code)."""
    done = [s["step"] for s in _ft_steps(out)][-1:] == [steps]
    return done and (out / "metrics.json").exists() and (out / "model.pt").exists()


def _median_gap(steps: list[dict[str, Any]], keep: Any) -> float | None:
    """The median time between a committed step and the previous one, over the steps
    ``keep`` accepts (both the step and the one before it); None when none."""
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(steps) if keep(a) and keep(b)]
    return statistics.median(gaps) if gaps else None


def _ft_events(
    args: argparse.Namespace,
    survivor: Path,
    joiner: Path,
    killed_at: float | None,
    joined_at: float,
) -> dict[str, Any]:
    steps = _ft_steps(survivor)
    numbers = [s["step"] for s in steps]
    lost = len(set(range(1, args.steps + 1)) ^ set(numbers)) + len(numbers) - len(set(numbers))
    joined = _ft_steps(joiner)
    alone = [s for s in steps if 1 not in s["members"]]
    after_kill = [s for s in alone if killed_at is not None and s["time"] > killed_at]
    models = [survivor / "model.pt", joiner / "model.pt"]
    diff = _max_difference(*models) if all(p.exists() for p in models) else None
    rejoined = joined[0]["step"] if joined else args.steps + 1  # the joiner's first step
    return {
        "steps_lost": lost,
        "survivor_restarts": 0,  # replica 0's process ran from its start to its exit
        "steps_alone": len(alone),
        "detect_s": after_kill[0]["time"] - killed_at if after_kill and killed_at else None,
        "rejoin_s": joined[0]["time"] - joined_at if joined else None,
        "rejoin_bytes": joined[0]["healed_bytes"] if joined else None,
        "steps_lockstep": len(joined),
        "alone_step_s": _median_gap(steps, lambda s: 1 not in s["members"]),
        "lockstep_step_s": _median_gap(
            steps, lambda s: 1 in s["members"] and s["step"] >= rejoined
        ),
        "lockstep_equal": None if diff is None else diff == 0.0,
        "lockstep_max_diff": diff,
    }


def _max_difference(a: Path, b: Path) -> float:
    """The largest absolute difference between two ``model.pt`` (the plain model's
    consolidated state, whatever the replica's layout); inf if their names or shapes
    differ."""
    import torch

    first, second = torch.load(a), torch.load(b)
    if first.keys() != second.keys() or any(first[k].shape != second[k].shape for k in first):
        return float("inf")
    gaps = [float((first[k] - second[k]).abs().amax()) for k in first if first[k].numel()]
    return max(gaps, default=0.0)


def restart_based(args: argparse.Namespace, work: Path, kill: bool, round_: int) -> dict[str, Any]:
    """One restart-based job; with ``kill``, a worker of the second group is SIGKILLed."""
    out = work / f"round{round_}-restart-{'kill' if kill else 'uninterrupted'}"
    log = out.parent / f"{out.name}.log"
    start = time.time()
    proc = _restart_job(args, out)
    result: dict[str, Any] = {"loadavg": loadavg()}
    if kill:
        _wait_until(lambda: len(_logged_steps(log)) >= args.kill_after, [proc], "the kill")
        _random_point(args, 0.0 if len(_logged_steps(log)) < 2 else args.step_s_hint, round_)
        committed = max(_logged_steps(log))
        workers = sorted(_descendants(proc.pid))
        _kill(workers[-1:])  # the last-started worker: a rank of the second group
        result.update(killed_at=time.time(), committed_at_kill=committed)
    code = proc.wait(timeout=args.timeout_s)
    result["wall_s"] = time.time() - start
    if code != 0:
        raise RuntimeError(f"the restart-based job exited with {code}; see {log}")
    result["val_loss"] = _val_loss(out)
    if kill:
        text = log.read_text(errors="replace")
        resumed = [int(a or b) for a, b in _RESUMED.findall(text)]
        restarted_from = resumed[-1] if len(resumed) > 1 else None
        result.update(
            survivor_restarts=len(resumed) - 1,
            restarted_from_step=restarted_from,
            steps_lost=None if restarted_from is None else committed - restarted_from,
        )
    return result


def _lost(killed: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    return {
        **killed,
        "wall_s_lost": killed["wall_s"] - reference["wall_s"],
        "val_loss_uninterrupted": reference["val_loss"],
        "val_loss_rel_diff": abs(killed["val_loss"] - reference["val_loss"])
        / reference["val_loss"],
    }


def one_round(args: argparse.Namespace, work: Path, round_: int) -> dict[str, Any]:
    """Both paths (uninterrupted, then killed) in ABBA order, then joiner_late and
    joiner_layout (each compared with the round's uninterrupted fault-tolerant run)."""
    paths = ["fault_tolerant", "restart_based"]
    result: dict[str, Any] = {}
    references: dict[str, dict[str, Any]] = {}
    for path in paths if round_ % 2 == 0 else paths[::-1]:
        if path == "fault_tolerant":
            pair = [fault_tolerant(args, work, c, round_) for c in ("uninterrupted", "kill")]
        else:
            pair = [restart_based(args, work, kill, round_) for kill in (False, True)]
        references[path] = pair[0]
        result[path] = _lost(pair[1], pair[0])
        result[path]["uninterrupted_wall_s"] = pair[0]["wall_s"]
    if args.late_delay > 0:
        late = fault_tolerant(args, work, "late", round_)
        result["joiner_late"] = _lost(late, references["fault_tolerant"])
    if args.joiner_strategy is not None:
        other = fault_tolerant(args, work, "layout", round_)
        result["joiner_layout"] = _lost(other, references["fault_tolerant"])
    return result


def medians(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per path, the median over rounds of every numeric key (None when none was)."""
    summary: dict[str, dict[str, float | None]] = {}
    for path in rounds[0]:
        keys = [k for k, v in rounds[0][path].items() if not isinstance(v, (list, dict, str))]
        summary[path] = {}
        for key in keys:
            values = [r[path].get(key) for r in rounds]
            if any(isinstance(v, bool) for v in values):  # lockstep_equal: in every round
                summary[path][key] = float(all(v is True for v in values))
                continue
            numbers = [float(v) for v in values if isinstance(v, (int, float))]
            summary[path][key] = statistics.median(numbers) if numbers else None
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``; None: ``sys.argv``); exits 2 on a joiner whose
    ranks do not split :func:`global_batch`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--out", default=str(RESULTS), help="results folder (default benchmarks/results)")
    add("--rounds", type=int, default=1, help="ABBA rounds of both paths (default 1)")
    add("--steps", type=int, default=300, help="long enough for a rejoin (default 300)")
    add("--strategy", default="hsdp", choices=["ddp", "oss", "sdp", "hsdp"])
    add("--ranks-per-replica", type=int, default=2)
    add("--kill-after", type=int, default=14, help="committed steps before the kill")
    add("--delay", type=float, default=3.0, help="seconds before the killed replica restarts")
    add("--late-delay", type=float, default=10.0, help="the same, joiner_late; 0: no joiner_late")
    add(
        "--joiner-strategy",
        default=None,
        choices=["ddp", "oss", "sdp", "hsdp"],
        help="joiner_layout: the killed replica restarts with this strategy (default: no run)",
    )
    add(
        "--joiner-ranks",
        type=int,
        default=None,
        help="joiner_layout: its number of ranks (default --ranks-per-replica)",
    )
    add("--ft-timeout", type=float, default=5.0)
    add("--seq-len", type=int, default=32)
    add("--batch-size", type=int, default=4)
    add("--save-every-restart", type=int, default=10)
    add("--step-s-hint", type=float, default=0.5, help="restart path: the kill's random window")
    add("--seed", type=int, default=0)
    add("--grace-s", type=float, default=60.0, help="wait for a joiner after replica 0 ended")
    add("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args(argv)
    ranks, rows = args.joiner_ranks or args.ranks_per_replica, global_batch(args) // 2
    if args.joiner_strategy is not None and rows % ranks:
        parser.error(
            f"--joiner-ranks {ranks} does not split a replica's {rows} rows per step "
            f"(--batch-size {args.batch_size} x --ranks-per-replica {args.ranks_per_replica}); "
            f"use a number of ranks that divides {rows}"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    work = out / "live_recovery_runs"
    rounds = [one_round(args, work, r) for r in range(args.rounds)]
    result = {"medians": medians(rounds), "rounds": rounds, "args": vars(args)}
    result["machine"] = machine()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"live_recovery-{timestamp()}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["medians"], indent=1, default=str))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
