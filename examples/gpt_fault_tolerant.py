"""The main job's ``--fault-tolerant`` mode: lose a replica, keep training, no restart.

Each replica (``--replica-id i`` of ``--max-replicas M``) is one ``torchrun`` agent
(or a plain ``python`` for a replica of one process) with its own rendezvous; its
``W`` ranks hold one model copy with ``--strategy ddp|oss|sdp|hsdp`` over the
replica's own world (hsdp: fully sharded over the replica's ranks). The replicas meet
only at a quorum store (``--fault-tolerant HOST:PORT``, served by ``python
examples/gpt_fault_tolerant.py serve --port PORT``). Every step the live replicas
agree on a quorum, average their gradients over it
(:class:`shardkit.distributed.fault_tolerance.FaultTolerantReplicas` with the
replica's group and its layout, ``shardkit.checkpoint.universal.gradient_pieces``:
rank ``j`` of each replica with rank ``j`` of the others when every member runs the
same strategy on as many ranks, else in the plain GPT's index space), and step; a
replica that dies or stalls is dropped for that step, and a restarted one (of any
size and strategy) receives the model, optimizer, LR schedule, history and step count
from a live replica, as the parts of a universal checkpoint held in memory
(``shardkit.checkpoint.universal.universal_state``), each of its ranks loading the
pieces its layout needs.

Data: rank ``r`` of replica ``i`` is data-parallel rank ``i W + r`` of ``M W``: it
takes its rows of step ``s``'s global batch ``G`` (the main job's sampler), so replica
``i`` trains on rows ``[i G / M, (i + 1) G / M)`` whatever its ``W``; with a replica
missing, the step trains on the survivors' rows only. ``G`` is ``--global-batch``, by
default ``--batch-size x --grad-accum x M x W``: replicas of different sizes need the
same ``--global-batch``. The quorum refuses a replica whose ``G``, ``M`` or
``--seq-len`` differs from its members' (the later one, or the joiner): it stops with
an error naming both, exit code 2, and the others train on. Validation scores every
window on each replica. Each committed step appends a line to ``--out-dir``'s
``ft_steps.jsonl`` (step, members, unix time, the replica's loss on its rows, healed
bytes; the replica's rank 0 writes it).

Checkpoints: every ``--save-every`` steps (and at the last step) the lowest replica
of the step's quorum writes the universal checkpoint into ``--checkpoint-dir`` (one
directory every replica reaches; default its own ``--out-dir``)
(:meth:`FaultTolerantReplicas.checkpoint`); ``--resume`` loads the newest one there and
starts the replica's manager at its step. A replica that finds none (or an older one)
is behind and heals from the others at the first quorum.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gpt_data import InputError, eval_windows
from gpt_dist import mean_over_ranks

from shardkit.checkpoint.universal import gradient_pieces, load_universal_states, universal_state
from shardkit.distributed.fault_tolerance import (
    FaultTolerantReplicas,
    ReplicaMismatchError,
    connect_store,
    host_store,
)
from shardkit.optim import OSS

STRATEGIES = ("ddp", "oss", "sdp", "hsdp")  # over the replica's own ranks


def data_parallel(config: Any, rank: int, world_size: int) -> tuple[int, int]:
    """This rank's data-parallel rank and size: rank ``r`` of replica ``i`` (of ``M``
    replicas of ``W`` ranks each) is ``i W + r`` of ``M W``."""
    return config.replica_id * world_size + rank, config.max_replicas * world_size


def averaged_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters whose gradients this rank averages across replicas: those its
    optimizer steps (OSS: this rank's partition; FSDP: its flat shards; DDP: all)."""
    if isinstance(optimizer, OSS):
        return list(optimizer.local_params())
    return [p for group in optimizer.param_groups for p in group["params"]]


def batch_schedule(config: Any, global_batch: int) -> dict[str, int]:
    """What every replica must share for its rows and gradients to mean the same: the
    global batch (sequences per step), the replica ids the rows are split over, and
    the tokens per sequence (the quorum refuses a replica that differs)."""
    return {
        "global_batch": global_batch,
        "max_replicas": config.max_replicas,
        "seq_len": config.seq_len,
    }


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
    opt = config.strategy
    if opt.tp > 1 or opt.cp > 1 or opt.moe_experts:
        return (
            f"--fault-tolerant: a replica is data parallel only (got --tp {opt.tp} --cp "
            f"{opt.cp} --moe-experts {opt.moe_experts}); drop --tp, --cp and --moe-experts"
        )
    if min(config.ft_timeout, config.ft_quorum_timeout) <= 0:
        return (
            f"--ft-timeout {config.ft_timeout} and --ft-quorum-timeout "
            f"{config.ft_quorum_timeout}: give seconds > 0"
        )
    if not 0 <= replica_id < max_replicas:
        return f"--replica-id {replica_id} is not in [0, --max-replicas {max_replicas})"
    if config.stop_after is not None or config.async_checkpoint:
        return (
            "--fault-tolerant runs to --steps and writes its checkpoints in the foreground: "
            "drop --stop-after and --async-checkpoint"
        )
    return None


def train_loop(
    run: Any,
    out_dir: Path,
    report: Callable[[Any, float | None], None],
    say: Callable[[Any, str], None],
    save: Callable[[Any, Path], None],
) -> FaultTolerantReplicas:
    """Train ``run`` (the main job's ``Run``, resumed to ``run.step`` or not) to
    ``--steps`` as one fault-tolerant replica; ``report(run, tokens_per_s)`` evaluates
    and prints, ``say`` prints, ``save(run, out_dir)`` writes a checkpoint (collective
    over the replica's ranks)."""
    config, strategy = run.config, run.strategy
    n_val = config.eval_batches * run.plan.global_batch
    run.val = eval_windows(run.val_tokens, n_val, config.seq_len, 0, 1)  # every window

    def state_dict() -> dict[str, Any]:  # this rank's part of a universal checkpoint
        extra = {"scheduler": run.scheduler.state_dict(), "history": asdict(run.history)}
        module, optimizer = strategy.checkpoint_module(), strategy.optimizer
        return universal_state(module, optimizer, step=ft.step, extra=extra)

    def load_state_dict(parts: list[Any]) -> None:  # resharded into this replica's layout
        module, optimizer = strategy.checkpoint_module(), strategy.optimizer
        extra = load_universal_states(parts, module, optimizer).extra(0) or {}
        run.scheduler.load_state_dict(extra["scheduler"])
        for name, values in extra["history"].items():
            setattr(run.history, name, values)

    module, optimizer = strategy.checkpoint_module(), strategy.optimizer
    ft = FaultTolerantReplicas(
        connect_store(config.fault_tolerant),
        config.replica_id,
        state_dict=state_dict,
        load_state_dict=load_state_dict,
        timeout_s=config.ft_timeout,
        quorum_timeout_s=config.ft_quorum_timeout,
        initial_replicas=config.max_replicas,
        prefix=f"gpt-ft-{config.seed}",
        group=dist.group.WORLD if run.env.world_size > 1 else None,
        step=run.step,
        layout=functools.partial(gradient_pieces, module, optimizer),
        batch=batch_schedule(config, run.plan.global_batch),
    )
    log = (out_dir / "ft_steps.jsonl").open("a") if run.env.rank == 0 else None
    try:
        _steps(run, ft, log, report, say, lambda: save(run, out_dir))
    except ReplicaMismatchError as err:  # on every rank of the replica; the others go on
        raise InputError(
            f"--fault-tolerant: {err} (--global-batch, by default --batch-size x "
            "--grad-accum x --max-replicas x ranks; --max-replicas; --seq-len)"
        ) from None
    finally:  # the cross-replica group ends here, not at the interpreter's exit
        ft.close()
        if log is not None:
            log.close()
    return ft


def _steps(
    run: Any, ft: FaultTolerantReplicas, log: Any, report: Any, say: Any, save: Callable[[], None]
) -> None:
    config, strategy = run.config, run.strategy
    tokens_per_replica = run.sampler.rows * config.seq_len
    while ft.step < config.steps:
        healed_before = ft.stats.healed_bytes
        quorum = ft.start_step()
        run.sampler.position = ft.step  # step s's rows of this replica
        x, y = (t.to(run.env.device) for t in run.sampler.next_batch())
        t0 = time.perf_counter()
        strategy.optimizer.zero_grad(set_to_none=True)
        # the replica's loss on its rows: the mean over its ranks (a collective over them)
        loss = mean_over_ranks(strategy.accumulate(x, y, run.plan.accumulation))
        if not ft.average_gradients(averaged_parameters(strategy.optimizer)):
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
        if log is not None:
            log.write(json.dumps(line) + "\n")
            log.flush()
        if config.log_every and run.step % config.log_every == 0:
            say(run, f"step {run.step:5d}/{config.steps} | train {loss:.4f} | replicas {members}")
        if (config.eval_every and run.step % config.eval_every == 0) or run.step == config.steps:
            report(run, len(members) * tokens_per_replica / dt)
        last = run.step == config.steps
        if config.save_every and (run.step % config.save_every == 0 or last):
            ft.checkpoint(save)  # the lowest member writes


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
