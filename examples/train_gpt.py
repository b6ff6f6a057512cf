"""The main job: a GPT-2-style byte-level language model trained on real text.

Runs unchanged under torchrun (one node or many) and as a plain script (one rank)::

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --strategy ddp
    python examples/train_gpt.py --steps 50

gloo on CPU, NCCL with one GPU per rank when CUDA is available. The ``--strategy``
flag picks an entry of ``examples/strategies.py``. Rank 0 shows a progress bar, a line
every ``--eval-every`` steps (train and validation loss, tokens/s, model-state bytes
of every rank) and writes ``metrics.json`` to ``--out-dir``; checkpoints go there too
(``examples/gpt_checkpoint.py``). Bad input ends with one line on stderr and exit
code 2. Options and numbers: ``docs/train_gpt.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gpt_checkpoint import (
    find_resume_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from gpt_data import VOCAB_SIZE, BatchSampler, InputError, eval_windows, load_bytes, split_tokens
from gpt_dist import Env, all_gather_ints, mean_over_ranks, setup_distributed
from strategies import META_INIT, PRECISIONS, STRATEGIES, Strategy, build_strategy, option_error
from tqdm import tqdm

from shardkit.checkpoint.atomic import atomic_save, atomic_write
from shardkit.memory import ModelStateBytes
from shardkit.models import GPT, MODEL_SIZES, gpt_config

PROG = "train_gpt.py"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, no usage block
        raise InputError(f"{message} (see --help)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; raises :class:`InputError` (one line) on a bad flag."""
    p = _Parser(prog=PROG, description="Train a byte-level GPT on text, N ranks.")
    add = p.add_argument
    add("--strategy", default="ddp", help=f"one of {sorted(STRATEGIES)} (default ddp)")
    add("--model-size", default="tiny", choices=sorted(MODEL_SIZES), help="default tiny")
    add("--steps", type=_positive, default=500, help="optimizer steps (default 500)")
    add("--batch-size", type=_positive, default=8, help="sequences per rank (default 8)")
    add("--seq-len", type=_positive, default=128, help="tokens per sequence (default 128)")
    add("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    add("--warmup-steps", type=_non_negative, default=None, help="default 10%% of --steps")
    add("--seed", type=int, default=0, help="default 0")
    add("--out-dir", default="runs/gpt", help="checkpoints, metrics.json (default runs/gpt)")
    add("--eval-every", type=_non_negative, default=50, help="0: at the end only (default 50)")
    add("--eval-batches", type=_positive, default=4, help="val batches per rank (default 4)")
    add("--log-every", type=_non_negative, default=0, help="train-loss lines; 0: off")
    add("--save-every", type=_non_negative, default=100, help="0: never (default 100)")
    add("--keep", type=_non_negative, default=2, help="checkpoints kept; 0: all (default 2)")
    add("--stop-after", type=_positive, default=None, help="end this run after this step")
    add("--resume", action="store_true", help="continue from the latest checkpoint")
    add("--data", default=None, help="a text file or a directory of .txt files")
    add("--chunks", type=_positive, default=4, help="pipe: micro-batches per step (default 4)")
    add("--schedule", default="1f1b", choices=["gpipe", "1f1b"], help="pipe (default 1f1b)")
    add("--precision", default="fp32", choices=list(PRECISIONS), help="ddp/oss/sdp/fsdp")
    add("--activation-checkpointing", action="store_true", help="recompute each Block")
    add("--offload-dir", default=None, help="offload: disk-tier directory (default: CPU memory)")
    # Test-only fault injection (tests/examples/test_restart.py): see fault_point().
    add("--fault-kill-at-step", type=_non_negative, default=None, help=argparse.SUPPRESS)
    add("--fault-rank", type=_non_negative, default=0, help=argparse.SUPPRESS)
    add("--fault-nan-at-step", type=_non_negative, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.strategy not in STRATEGIES:
        raise InputError(
            f"unknown --strategy {args.strategy!r}; choose one of {sorted(STRATEGIES)}"
        )
    problem = option_error(args)
    if problem is not None:
        raise InputError(problem)
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.steps // 10)
    return args


@dataclass
class History:
    """What metrics.json reports and checkpoints carry: ``[step, value]`` pairs."""

    train_loss: list[list[float]] = field(default_factory=list)
    val_loss: list[list[float]] = field(default_factory=list)
    tokens_per_s: list[list[float]] = field(default_factory=list)


@dataclass
class Run:
    """Everything the training loop touches."""

    args: argparse.Namespace
    env: Env
    model: GPT
    strategy: Strategy
    scheduler: torch.optim.lr_scheduler.LambdaLR
    sampler: BatchSampler
    val: tuple[torch.Tensor, torch.Tensor]
    num_params: int  # of the whole model, counted before a strategy shards it
    history: History = field(default_factory=History)
    step: int = 0
    steps_this_run: int = 0
    train_time_s: float = 0.0  # seconds in this run's training steps (no eval, no saves)


def lr_factor(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``floor`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_run(args: argparse.Namespace, env: Env, train: torch.Tensor, val: torch.Tensor) -> Run:
    """Model (same seed on every rank), strategy, LR schedule, data sampler."""
    torch.manual_seed(args.seed)
    random.seed(args.seed + env.rank)
    config = gpt_config(args.model_size, vocab_size=VOCAB_SIZE, block_size=args.seq_len)
    if args.strategy in META_INIT:  # the strategy allocates only this rank's part
        with torch.device("meta"):
            model = GPT(config)
    else:
        model = GPT(config).to(env.device)
    num_params = model.num_parameters()
    strategy = build_strategy(model, args, env.device)  # + precision, checkpointing
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        strategy.optimizer, lambda s: lr_factor(s, args.warmup_steps, args.steps)
    )
    sampler = BatchSampler(train, args.batch_size, args.seq_len, args.seed, env.rank)
    n_val = args.eval_batches * args.batch_size * env.world_size
    val_xy = eval_windows(val, n_val, args.seq_len, env.rank, env.world_size)
    return Run(args, env, model, strategy, scheduler, sampler, val_xy, num_params)


def checkpoint_payload(run: Run) -> dict[str, Any]:
    """This rank's complete resumable state."""
    return {
        "step": run.step,
        "strategy": run.strategy.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "sampler": run.sampler.state_dict(),
        "rng": rng_state(run.env.device),
        "history": asdict(run.history),
    }


def restore(run: Run, payload: dict[str, Any]) -> None:
    """Inverse of :func:`checkpoint_payload`."""
    run.step = int(payload["step"])
    run.strategy.load_state_dict(payload["strategy"])
    run.scheduler.load_state_dict(payload["scheduler"])
    run.sampler.load_state_dict(payload["sampler"])
    run.history = History(**payload["history"])
    set_rng_state(payload["rng"], run.env.device)


def model_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that fix the model's shapes (kept in each checkpoint's manifest)."""
    return {"model_size": args.model_size, "seq_len": args.seq_len}


def maybe_resume(run: Run, out_dir: Path) -> None:
    """Restore the newest intact checkpoint (a damaged newer one: warn and skip it)."""
    ckpt = find_resume_checkpoint(out_dir, run.env.world_size, lambda line: warn(run, line))
    if ckpt is None:
        say(run, f"--resume: no checkpoint in {out_dir}; starting from step 0")
        return
    env = run.env
    shapes = model_flags(run.args)
    restore(
        run,
        load_checkpoint(ckpt, env.rank, env.world_size, run.args.strategy, env.device, shapes),
    )
    say(run, f"resumed from {ckpt} at step {run.step}")


def say(run: Run, line: str) -> None:
    """Print on rank 0 without breaking the progress bar."""
    if run.env.rank == 0:
        tqdm.write(line, file=sys.stdout)


def warn(run: Run, line: str) -> None:
    """One line on rank 0's stderr: ``train_gpt.py: warning: ...``."""
    if run.env.rank == 0:
        tqdm.write(f"{PROG}: warning: {line}", file=sys.stderr)


def fault_point(run: Run) -> None:
    """Test-only: SIGKILL this process in the middle of step ``--fault-kill-at-step + 1``.

    Only rank ``--fault-rank``, and only on torchrun's first attempt
    (``TORCHELASTIC_RESTART_COUNT`` unset or 0), so the restarted job runs through.
    Called between the backward pass and the optimizer step.
    """
    args = run.args
    if args.fault_kill_at_step is None or run.step != args.fault_kill_at_step:
        return
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if run.env.rank == args.fault_rank and first_attempt:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


class NonFiniteLossError(Exception):
    """A step's loss is NaN or infinite on some rank; no rank took the step."""


def fault_loss(run: Run, loss: torch.Tensor) -> torch.Tensor:
    """Test-only: the loss of step ``--fault-nan-at-step`` is NaN on ``--fault-rank``."""
    args = run.args
    if run.step + 1 == args.fault_nan_at_step and run.env.rank == args.fault_rank:
        return loss * float("nan")
    return loss


def finite_mean_loss(run: Run, loss: torch.Tensor) -> float:
    """The loss averaged over ranks (one all-reduce, before the backward pass).

    A NaN or inf on any rank makes the mean non-finite on every rank, so all ranks
    agree to stop before the optimizer step: the model and the checkpoints keep the
    last good state. With a loss scaler (``--precision fp16``) the scaler skips such a
    step instead (its gradients are not finite), on every rank.

    Raises:
        NonFiniteLossError: no scaler and the mean is not finite.
    """
    mean = mean_over_ranks(loss)
    if math.isfinite(mean) or getattr(run.strategy, "scaler", None) is not None:
        return mean
    raise NonFiniteLossError(
        f"step {run.step + 1}: the training loss is {mean} (mean over the "
        f"{run.env.world_size} ranks); stopped before the optimizer step, so the model "
        "and the last checkpoint are untouched (--resume continues from it). Lower --lr, "
        "check the data, or use --precision fp16, whose loss scaler skips such steps"
    )


def train_step(run: Run) -> float:
    """One optimizer step on this rank's next batch; the loss averaged over ranks.

    Raises:
        NonFiniteLossError: the loss is NaN or inf on a rank (see :func:`finite_mean_loss`).
    """
    x, y = (t.to(run.env.device, non_blocking=True) for t in run.sampler.next_batch())
    run.strategy.optimizer.zero_grad(set_to_none=True)
    _, loss = run.strategy.module(x, targets=y)
    loss = fault_loss(run, loss)
    mean = finite_mean_loss(run, loss)
    run.strategy.backward(loss)  # loss scaling with --precision fp16
    fault_point(run)
    run.strategy.before_step()  # the gradient-clipping hook (strategies.py)
    run.strategy.step()
    run.scheduler.step()
    return mean


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Mean validation loss over the fixed windows of every rank."""
    module, (val_x, val_y), bs = run.strategy.module, run.val, run.args.batch_size
    module.eval()
    total = torch.zeros(2, dtype=torch.float64, device=run.env.device)
    for i in range(0, len(val_x), bs):
        x, y = val_x[i : i + bs].to(run.env.device), val_y[i : i + bs].to(run.env.device)
        _, loss = module(x, targets=y)
        total += torch.stack([loss.double() * len(x), torch.tensor(len(x), device=x.device)])
    module.train()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def gather_state_bytes(run: Run) -> list[dict[str, int]]:
    """Every rank's model-state bytes (parameters, gradients, optimizer state, buffers)."""
    mine = run.strategy.model_state_bytes()
    fields = [mine.parameters, mine.gradients, mine.optimizer_state, mine.buffers]
    return [ModelStateBytes(*f).as_dict() for f in all_gather_ints(fields, run.env.device)]


def format_bytes(per_rank: list[dict[str, int]]) -> str:
    mb = [
        f"r{r} {b['parameters'] / 2**20:.1f}/{b['gradients'] / 2**20:.1f}/{b['optimizer_state'] / 2**20:.1f}"
        for r, b in enumerate(per_rank)
    ]
    return "state MiB p/g/o " + " ".join(mb)


def report(run: Run, tokens_per_s: float | None) -> None:
    """Evaluate, record, and print the periodic line (collective)."""
    val = evaluate(run)
    run.history.val_loss.append([run.step, val])
    state = gather_state_bytes(run)
    train = f"{run.history.train_loss[-1][1]:.4f}" if run.history.train_loss else "  -   "
    speed = "-" if tokens_per_s is None else f"{tokens_per_s:,.0f}"
    say(
        run,
        f"step {run.step:5d}/{run.args.steps} | train {train} | val {val:.4f} | "
        f"{speed} tok/s | {format_bytes(state)}",
    )


def train_loop(run: Run, out_dir: Path) -> None:
    """Steps ``run.step + 1 .. stop``: train, report, checkpoint."""
    args, tokens_per_step = run.args, run.args.batch_size * run.args.seq_len * run.env.world_size
    stop = min(args.steps, args.stop_after or args.steps)
    if run.step == 0:
        report(run, None)
    bar = tqdm(total=stop, initial=run.step, disable=run.env.rank != 0, desc="train", ncols=90)
    window_s, window_steps = 0.0, 0
    try:  # closed also when a step raises, so an error line starts a line of its own
        while run.step < stop:
            t0 = time.perf_counter()
            loss = train_step(run)
            dt = time.perf_counter() - t0
            run.step, run.steps_this_run = run.step + 1, run.steps_this_run + 1
            run.train_time_s, window_s, window_steps = (
                run.train_time_s + dt,
                window_s + dt,
                window_steps + 1,
            )
            run.history.train_loss.append([run.step, loss])
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            tps = window_steps * tokens_per_step / window_s
            if args.log_every and run.step % args.log_every == 0:
                say(run, f"step {run.step:5d}/{args.steps} | train {loss:.4f} | {tps:,.0f} tok/s")
            if (args.eval_every and run.step % args.eval_every == 0) or run.step == args.steps:
                run.history.tokens_per_s.append([run.step, tps])
                report(run, tps)
                window_s, window_steps = 0.0, 0
            end_of_run = run.step == stop and (args.save_every > 0 or stop < args.steps)
            if (args.save_every and run.step % args.save_every == 0) or end_of_run:
                save_checkpoint(
                    out_dir,
                    run.step,
                    checkpoint_payload(run),
                    args.strategy,
                    args.keep,
                    model_flags(args),
                )
    finally:
        bar.close()


def summary(run: Run, wall_s: float) -> dict[str, Any]:
    """metrics.json's content (a collective: it gathers every rank's state bytes)."""
    args, h = run.args, run.history
    tokens = run.steps_this_run * args.batch_size * args.seq_len * run.env.world_size
    return {
        "strategy": args.strategy,
        "world_size": run.env.world_size,
        "model_size": args.model_size,
        "param_count": run.num_params,
        "step": run.step,
        "start_step": run.step - run.steps_this_run,
        "train_loss": h.train_loss,
        "val_loss": h.val_loss,
        "tokens_per_s": h.tokens_per_s,
        "tokens_per_s_run": tokens / run.train_time_s if run.train_time_s else 0.0,
        "train_time_s": run.train_time_s,
        "wall_s": wall_s,
        "model_state_bytes": gather_state_bytes(run),
        "args": vars(args),
    }


def finish(run: Run, out_dir: Path, wall_s: float) -> None:
    """metrics.json and the summary (rank 0); model.pt once the last step is done."""
    metrics = summary(run, wall_s)
    state = run.strategy.consolidated_model_state() if run.step == run.args.steps else None
    if run.env.rank != 0:
        return
    with atomic_write(out_dir / "metrics.json", "w") as handle:
        json.dump(metrics, handle, indent=1)
    if state is not None:
        atomic_save(state, out_dir / "model.pt")
    h = run.history
    say(
        run,
        f"done: step {run.step}, train loss {h.train_loss[0][1]:.4f} -> {h.train_loss[-1][1]:.4f}, "
        f"val loss {h.val_loss[0][1]:.4f} -> {h.val_loss[-1][1]:.4f}, "
        f"{metrics['tokens_per_s_run']:,.0f} tok/s, {wall_s:.1f} s; wrote {out_dir}/metrics.json",
    )


def run_job(args: argparse.Namespace, env: Env, data: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Build, maybe resume, train, write the outputs."""
    start = time.perf_counter()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run = build_run(args, env, *data)
    say(
        run,
        f"{args.model_size} GPT: {run.num_params:,} parameters | strategy "
        f"{args.strategy} | {env.world_size} rank(s) on {env.device.type} | batch "
        f"{args.batch_size}x{args.seq_len} tokens per rank | {len(data[0]):,} train / "
        f"{len(data[1]):,} val tokens",
    )
    if args.resume:
        maybe_resume(run, out_dir)
    train_loop(run, out_dir)
    finish(run, out_dir, time.perf_counter() - start)


def fail(error: Exception, show: bool) -> int:
    if show:
        print(f"{PROG}: error: {error}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run the job; returns the exit code (2 on bad input, printed as one line)."""
    first = os.environ.get("RANK", "0") == "0"
    try:
        args = parse_args(argv)
        text, _ = load_bytes(args.data)
        data = split_tokens(text, args.seq_len)
    except InputError as err:  # the same on every rank: rank 0 says it
        return fail(err, first)
    env = setup_distributed()
    try:
        run_job(args, env, data)
    except InputError as err:
        return fail(err, True)
    except NonFiniteLossError as err:  # every rank stops; rank 0 says it
        return fail(err, env.rank == 0)
    finally:
        if env.owns_group:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
