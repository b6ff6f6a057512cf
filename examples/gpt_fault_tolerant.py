"""The main job's ``--fault-tolerant`` mode: lose a replica, keep training, no restart.

Each process is one data-parallel replica (``--replica-id i`` of ``--max-replicas M``,
a plain ``python`` or a one-process ``torchrun`` per replica, so a replica's own world
size is 1); the replicas meet only at a quorum store (``--fault-tolerant HOST:PORT``,
served by ``python examples/gpt_fault_tolerant.py serve --port PORT``). Every step the
live replicas agree on a quorum, average their gradients over it
(:class:`shardkit.distributed.fault_tolerance.FaultTolerantReplicas`), and step; a
replica that dies or stalls is dropped for that step, and a restarted one receives the
model, optimizer, LR schedule, history and step count from a live replica.

Data: replica ``i`` takes rows ``i G / M .. (i + 1) G / M`` of step ``s``'s global
batch ``G`` (the main job's sampler with ``M`` data-parallel ranks); with a replica
missing, the step trains on the survivors' rows only. Validation scores every window
on each replica. Each committed step appends a line to ``--out-dir``'s
``ft_steps.jsonl`` (step, members, unix time, loss, healed bytes).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gpt_data import eval_windows

from shardkit.distributed.fault_tolerance import FaultTolerantReplicas, connect_store, host_store

STRATEGIES = ("ddp",)  # one process per replica: the strategy runs on a world of 1


def flag_error(config: Any, world_size: int) -> str | None:
    """Why the main job's ``config`` cannot run fault-tolerant at this world size, or None."""
    store, replica_id, max_replicas = config.fault_tolerant, config.replica_id, config.max_replicas
    if store is None:
        if replica_id or max_replicas != 1:
            return "--replica-id / --max-replicas need --fault-tolerant HOST:PORT"
        return None
    host, _, port = store.rpartition(":")
    if not host or not port.isdigit():
        return f"--fault-tolerant {store}: expected HOST:PORT of the quorum store, e.g. 127.0.0.1:29600"
    if config.strategy.name not in STRATEGIES:
        return (
            f"--fault-tolerant runs --strategy {'/'.join(STRATEGIES)}, not {config.strategy.name}"
        )
    if world_size != 1:
        return (
            f"--fault-tolerant: this replica has {world_size} ranks; launch one process "
            "per replica (--nproc-per-node 1), each with its own --replica-id"
        )
    if not 0 <= replica_id < max_replicas:
        return f"--replica-id {replica_id} is not in [0, --max-replicas {max_replicas})"
    if config.resume or config.save_every or config.stop_after is not None:
        return (
            "--fault-tolerant writes no checkpoints (a restarted replica receives the state "
            "from a live one): pass --save-every 0, without --resume / --stop-after"
        )
    return None


def train_loop(
    run: Any,
    out_dir: Path,
    report: Callable[[Any, float | None], None],
    say: Callable[[Any, str], None],
) -> FaultTolerantReplicas:
    """Train ``run`` (the main job's ``Run``) to ``--steps`` as one fault-tolerant
    replica; ``report(run, tokens_per_s)`` evaluates and prints, ``say`` prints."""
    config, strategy = run.config, run.strategy
    n_val = config.eval_batches * run.plan.global_batch
    run.val = eval_windows(run.val_tokens, n_val, config.seq_len, 0, 1)  # every window

    def state_dict() -> dict[str, Any]:
        return {
            "strategy": strategy.state_dict(),
            "scheduler": run.scheduler.state_dict(),
            "history": asdict(run.history),
        }

    def load_state_dict(state: Any) -> None:
        strategy.load_state_dict(state["strategy"])
        run.scheduler.load_state_dict(state["scheduler"])
        for name, values in state["history"].items():
            setattr(run.history, name, values)

    ft = FaultTolerantReplicas(
        connect_store(config.fault_tolerant),
        config.replica_id,
        state_dict=state_dict,
        load_state_dict=load_state_dict,
        timeout_s=config.ft_timeout,
        initial_replicas=config.max_replicas,
        prefix=f"gpt-ft-{config.seed}",
    )
    log = (out_dir / "ft_steps.jsonl").open("a")
    try:
        _steps(run, ft, log, report, say)
    finally:
        log.close()
    return ft


def _steps(run: Any, ft: FaultTolerantReplicas, log: Any, report: Any, say: Any) -> None:
    config, strategy = run.config, run.strategy
    tokens_per_replica = run.sampler.rows * config.seq_len
    while ft.step < config.steps:
        healed_before = ft.stats.healed_bytes
        quorum = ft.start_step()
        run.sampler.position = ft.step  # step s's rows of this replica
        x, y = (t.to(run.env.device) for t in run.sampler.next_batch())
        t0 = time.perf_counter()
        strategy.optimizer.zero_grad(set_to_none=True)
        loss = strategy.accumulate(x, y, run.plan.accumulation).item()
        if not ft.average_gradients(strategy.model.parameters()):
            say(run, f"replica {ft.replica_id}: dropped from step {ft.step + 1}; rejoining")
            continue
        strategy.before_step()
        strategy.step()
        run.scheduler.step()
        dt = time.perf_counter() - t0
        run.step, run.steps_this_run = ft.step, run.steps_this_run + 1
        run.train_time_s += dt
        run.history.train_loss.append([run.step, loss])
        members = list(ft.quorum.members) if ft.quorum else list(quorum.members)
        line = {"step": run.step, "members": members, "time": time.time(), "loss": loss}
        line["healed_bytes"] = ft.stats.healed_bytes - healed_before
        log.write(json.dumps(line) + "\n")
        log.flush()
        if config.log_every and run.step % config.log_every == 0:
            say(run, f"step {run.step:5d}/{config.steps} | train {loss:.4f} | replicas {members}")
        if (config.eval_every and run.step % config.eval_every == 0) or run.step == config.steps:
            report(run, len(members) * tokens_per_replica / dt)


def serve(port: int) -> None:
    """Host the quorum store on ``port`` until killed (it must outlive the replicas)."""
    store = host_store(port)
    print(f"quorum store on port {store.port}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--port", type=int, default=29600)
    serve(parser.parse_args().port)
