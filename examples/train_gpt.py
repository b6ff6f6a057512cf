"""The main job: a GPT-2-style byte-level language model trained on real text.

Runs unchanged under torchrun (one node or many) and as a plain script (one rank)::

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --strategy ddp
    python examples/train_gpt.py --steps 50

gloo on CPU, NCCL with one GPU per rank when CUDA is available. The ``--strategy``
flag picks an entry of ``examples/strategies.py`` (``STRATEGIES``); each step is that
strategy's ``train_step(x, y)``. Rank 0 shows a progress bar, a line every
``--eval-every`` steps (train and validation loss, tokens/s, model-state bytes
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
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
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
from gpt_dist import Env, all_gather_ints, setup_distributed
from gpt_report import SAMPLE_PROMPT, StepProfiler, parse_steps, plot_metrics, sample_text
from strategies import (
    PRECISIONS,
    STRATEGIES,
    Strategy,
    StrategyConfig,
    build_strategy,
    option_error,
)
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


@dataclass(frozen=True)
class JobConfig:
    """The main job's options (the command line, typed); defaults are the flags' defaults.

    Attributes:
        strategy: what the strategy reads (:class:`strategies.StrategyConfig`:
            ``--strategy``, ``--lr``, ``--precision``, ...).
        model_size: ``tiny``, ``small`` or ``medium`` (``shardkit.models.MODEL_SIZES``).
        steps: optimizer steps; the LR schedule spans them.
        batch_size: sequences per rank per step.
        seq_len: tokens per sequence (the position embedding's length).
        warmup_steps: linear LR warmup; None: 10% of ``steps`` (:attr:`warmup`).
        seed: model initialisation (same on every rank) and data order.
        out_dir: checkpoints, ``metrics.json``, ``model.pt``.
        eval_every: steps between validation lines; 0: step 0 and the end only.
        eval_batches: validation batches per rank.
        log_every: steps between train-loss lines; 0: off.
        save_every: steps between checkpoints; 0: never.
        keep: checkpoints kept; 0: all.
        stop_after: end this run after this step (None: at ``steps``).
        data: a text file or a directory of ``.txt`` files; None: the default text.
        profile_steps: ``"a:b"``: a ``torch.profiler`` trace of steps a..b per rank
            (``trace-rank<r>.json`` in ``out_dir``); None: no profiling.
    """

    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    model_size: str = "tiny"
    steps: int = 500
    batch_size: int = 8
    seq_len: int = 128
    warmup_steps: int | None = None
    seed: int = 0
    out_dir: str = "runs/gpt"
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 0
    save_every: int = 100
    keep: int = 2
    stop_after: int | None = None
    data: str | None = None
    profile_steps: str | None = None

    @property
    def warmup(self) -> int:
        """LR warmup steps: ``warmup_steps``, by default 10% of ``steps`` (at least 1)."""
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 10)

    @property
    def resume(self) -> bool:
        """``--resume``: continue from the newest intact checkpoint in ``out_dir``."""
        return self.strategy.resume

    def flags(self) -> dict[str, Any]:
        """Every option by its flag's name (``--strategy`` is the strategy's name), as
        ``metrics.json`` records them."""
        job = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "strategy"}
        strategy = asdict(self.strategy)
        return {"strategy": strategy.pop("name"), **job, **strategy, "warmup_steps": self.warmup}

    @classmethod
    def from_flags(cls, flags: dict[str, Any]) -> JobConfig:
        """The config of parsed flags (``vars(namespace)``): the strategy's fields go to
        :class:`StrategyConfig` (``strategy`` to its ``name``), the rest here."""
        own = {f.name for f in fields(StrategyConfig)} - {"name"}
        strategy = StrategyConfig(name=flags["strategy"], **{k: flags[k] for k in own})
        job = {k: v for k, v in flags.items() if k not in own and k != "strategy"}
        return cls(strategy=strategy, **job)


def parse_args(argv: list[str] | None) -> JobConfig:
    """The command line as a :class:`JobConfig`; raises :class:`InputError` (one line)
    on a bad flag or an option that does not apply to ``--strategy``."""
    job, opt = JobConfig(), StrategyConfig()
    p = _Parser(prog=PROG, description="Train a byte-level GPT on text, N ranks.")
    add = p.add_argument
    add("--strategy", default=opt.name, help=f"one of {sorted(STRATEGIES)} (default {opt.name})")
    add("--model-size", default=job.model_size, choices=sorted(MODEL_SIZES), help="default tiny")
    add("--steps", type=_positive, default=job.steps, help=f"optimizer steps (default {job.steps})")
    add("--batch-size", type=_positive, default=job.batch_size, help="sequences per rank")
    add("--seq-len", type=_positive, default=job.seq_len, help="tokens per sequence")
    add("--lr", type=float, default=opt.lr, help=f"peak learning rate (default {opt.lr})")
    add("--warmup-steps", type=_non_negative, default=None, help="default 10%% of --steps")
    add("--seed", type=int, default=job.seed, help=f"default {job.seed}")
    add("--out-dir", default=job.out_dir, help=f"checkpoints, metrics.json (default {job.out_dir})")
    add("--eval-every", type=_non_negative, default=job.eval_every, help="0: at the end only")
    add("--eval-batches", type=_positive, default=job.eval_batches, help="val batches per rank")
    add("--log-every", type=_non_negative, default=job.log_every, help="train-loss lines; 0: off")
    add("--save-every", type=_non_negative, default=job.save_every, help="0: never")
    add("--keep", type=_non_negative, default=job.keep, help="checkpoints kept; 0: all")
    add("--stop-after", type=_positive, default=None, help="end this run after this step")
    add("--resume", action="store_true", help="continue from the latest checkpoint")
    add("--data", default=None, help="a text file or a directory of .txt files")
    add("--chunks", type=_positive, default=opt.chunks, help="pipe: micro-batches per step")
    add("--schedule", default=opt.schedule, choices=["gpipe", "1f1b"], help="pipe")
    add("--precision", default=opt.precision, choices=list(PRECISIONS), help="ddp/oss/sdp/fsdp")
    add("--activation-checkpointing", action="store_true", help="recompute each Block")
    add("--offload-dir", default=None, help="offload: disk-tier directory (default: CPU memory)")
    add("--shard-size", type=_positive, default=None, help="hsdp: ranks per shard group")
    add("--tp", type=_positive, default=opt.tp, help="ddp/oss/sdp/fsdp: tensor-parallel degree")
    add(
        "--grad-compression",
        default=None,
        choices=["bf16", "fp16", "powersgd", "int8"],
        help="ddp/oss/sdp/fsdp/hsdp: compress the gradient reduction (hsdp: across nodes)",
    )
    add("--profile-steps", default=None, metavar="A:B", help="torch.profiler trace of steps A..B")
    config = JobConfig.from_flags(vars(p.parse_args(argv)))
    if config.profile_steps is not None:
        try:
            parse_steps(config.profile_steps)
        except ValueError as err:
            raise InputError(str(err)) from None
    problem = option_error(config.strategy)
    if problem is not None:
        raise InputError(problem)
    return config


@dataclass
class History:
    """What metrics.json reports and checkpoints carry: ``[step, value]`` pairs."""

    train_loss: list[list[float]] = field(default_factory=list)
    val_loss: list[list[float]] = field(default_factory=list)
    tokens_per_s: list[list[float]] = field(default_factory=list)


@dataclass
class Run:
    """Everything the training loop touches."""

    config: JobConfig
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


def chunks_error(config: JobConfig, world_size: int) -> str | None:
    """Why pipe's ``--chunks`` cannot split the global batch, or None when it can."""
    rows = config.batch_size * world_size  # the pipeline runs the global batch
    if config.strategy.name == "pipe" and config.strategy.chunks > rows:
        return (
            f"--chunks {config.strategy.chunks} is more micro-batches than the {rows} rows "
            f"of a step's batch (--batch-size {config.batch_size} x {world_size} ranks); "
            f"use --chunks <= {rows} or a larger --batch-size"
        )
    return None


def tp_error(config: JobConfig, world_size: int) -> str | None:
    """Why ``--tp`` does not fit the launch or the model, or None when it does."""
    degree = config.strategy.tp
    if world_size % degree:
        return (
            f"--tp {degree} does not divide the world size {world_size}; launch a multiple "
            f"of {degree} ranks or choose a --tp that divides {world_size}"
        )
    heads = MODEL_SIZES[config.model_size]["n_head"]
    if heads % degree or VOCAB_SIZE % degree:
        return (
            f"--tp {degree} does not divide the {config.model_size} GPT's {heads} attention "
            f"heads and {VOCAB_SIZE}-token vocabulary; choose a --tp that divides both"
        )
    return None


def data_parallel(config: JobConfig, env: Env) -> tuple[int, int]:
    """This rank's data-parallel rank and the data-parallel size: under ``--tp`` the
    ``tp`` consecutive ranks of one tensor-parallel group feed the same rows."""
    return env.rank // config.strategy.tp, env.world_size // config.strategy.tp


def build_run(config: JobConfig, env: Env, train: torch.Tensor, val: torch.Tensor) -> Run:
    """Model (same seed on every rank), strategy, LR schedule, data sampler (one per
    data-parallel rank)."""
    torch.manual_seed(config.seed)
    random.seed(config.seed + env.rank)
    shape = gpt_config(config.model_size, vocab_size=VOCAB_SIZE, block_size=config.seq_len)
    if STRATEGIES[config.strategy.name].meta_init == "default":  # allocates its part only
        with torch.device("meta"):
            model = GPT(shape)
    else:
        model = GPT(shape).to(env.device)
    num_params = model.num_parameters()
    strategy = build_strategy(model, config.strategy, env.device)  # + precision, checkpointing
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        strategy.optimizer, lambda s: lr_factor(s, config.warmup, config.steps)
    )
    dp_rank, dp_size = data_parallel(config, env)
    sampler = BatchSampler(train, config.batch_size, config.seq_len, config.seed, dp_rank)
    n_val = config.eval_batches * config.batch_size * dp_size
    val_xy = eval_windows(val, n_val, config.seq_len, dp_rank, dp_size)
    return Run(config, env, model, strategy, scheduler, sampler, val_xy, num_params)


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


def model_flags(config: JobConfig) -> dict[str, Any]:
    """The flags that fix the model's shapes (kept in each checkpoint's manifest)."""
    return {"model_size": config.model_size, "seq_len": config.seq_len, "tp": config.strategy.tp}


def maybe_resume(run: Run, out_dir: Path) -> None:
    """Restore the newest intact checkpoint (a damaged newer one: warn and skip it)."""
    ckpt = find_resume_checkpoint(out_dir, run.env.world_size, lambda line: warn(run, line))
    if ckpt is None:
        say(run, f"--resume: no checkpoint in {out_dir}; starting from step 0")
        return
    env = run.env
    shapes, strategy = model_flags(run.config), run.config.strategy.name
    restore(
        run,
        load_checkpoint(ckpt, env.rank, env.world_size, strategy, env.device, shapes),
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


class NonFiniteLossError(Exception):
    """A step's loss is NaN or infinite on some rank; no rank took the step."""


def train_step(run: Run) -> float:
    """One optimizer step on this rank's next batch; the loss averaged over ranks.

    ``Strategy.train_step`` all-reduces the loss before the optimizer step: a NaN or
    inf on any rank makes the mean non-finite on every rank, so all ranks agree to skip
    the step, and the model and the checkpoints keep the last good state. With a loss
    scaler (``--precision fp16``) the scaler skips such a step instead (its gradients
    are not finite), on every rank, and training goes on.

    Raises:
        NonFiniteLossError: no scaler and the mean loss is not finite.
    """
    x, y = (t.to(run.env.device, non_blocking=True) for t in run.sampler.next_batch())
    mean = run.strategy.train_step(x, y)
    if not math.isfinite(mean) and run.strategy.scaler is None:
        raise NonFiniteLossError(
            f"step {run.step + 1}: the training loss is {mean} (mean over the "
            f"{run.env.world_size} ranks); stopped before the optimizer step, so the model "
            "and the last checkpoint are untouched (--resume continues from it). Lower --lr, "
            "check the data, or use --precision fp16, whose loss scaler skips such steps"
        )
    run.scheduler.step()
    return mean


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Mean validation loss over the fixed windows of every rank."""
    module, (val_x, val_y), bs = run.strategy.module, run.val, run.config.batch_size
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
        f"step {run.step:5d}/{run.config.steps} | train {train} | val {val:.4f} | "
        f"{speed} tok/s | {format_bytes(state)}",
    )


def train_loop(run: Run, out_dir: Path) -> None:
    """Steps ``run.step + 1 .. stop``: train, report, checkpoint."""
    config = run.config
    tokens_per_step = config.batch_size * config.seq_len * data_parallel(config, run.env)[1]
    stop = min(config.steps, config.stop_after or config.steps)
    if run.step == 0:
        report(run, None)
    bar = tqdm(total=stop, initial=run.step, disable=run.env.rank != 0, desc="train", ncols=90)
    window_s, window_steps = 0.0, 0
    steps = parse_steps(config.profile_steps) if config.profile_steps else None
    profiler = StepProfiler(steps, out_dir, run.env.rank)
    try:  # closed also when a step raises, so an error line starts a line of its own
        while run.step < stop:
            profiler.before_step(run.step + 1)
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
            profiler.after_step(run.step)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            tps = window_steps * tokens_per_step / window_s
            if config.log_every and run.step % config.log_every == 0:
                say(run, f"step {run.step:5d}/{config.steps} | train {loss:.4f} | {tps:,.0f} tok/s")
            if (
                config.eval_every and run.step % config.eval_every == 0
            ) or run.step == config.steps:
                run.history.tokens_per_s.append([run.step, tps])
                report(run, tps)
                window_s, window_steps = 0.0, 0
            end_of_run = run.step == stop and (config.save_every > 0 or stop < config.steps)
            if (config.save_every and run.step % config.save_every == 0) or end_of_run:
                save_checkpoint(
                    out_dir,
                    run.step,
                    checkpoint_payload(run),
                    config.strategy.name,
                    config.keep,
                    model_flags(config),
                )
    finally:
        bar.close()
        profiler.close()


def summary(run: Run, wall_s: float) -> dict[str, Any]:
    """metrics.json's content (a collective: it gathers every rank's state bytes)."""
    config, h = run.config, run.history
    dp_size = data_parallel(config, run.env)[1]
    tokens = run.steps_this_run * config.batch_size * config.seq_len * dp_size
    return {
        "strategy": config.strategy.name,
        "world_size": run.env.world_size,
        "model_size": config.model_size,
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
        "args": config.flags(),
    }


def finish(run: Run, out_dir: Path, wall_s: float) -> None:
    """metrics.json and the summary (rank 0); model.pt once the last step is done."""
    metrics = summary(run, wall_s)
    state = run.strategy.consolidated_model_state() if run.step == run.config.steps else None
    if run.env.rank != 0:
        return
    with atomic_write(out_dir / "metrics.json", "w") as handle:
        json.dump(metrics, handle, indent=1)
    if state is not None:
        atomic_save(state, out_dir / "model.pt")
    plot_metrics(metrics, out_dir / "loss.png")
    h = run.history
    say(
        run,
        f"done: step {run.step}, train loss {h.train_loss[0][1]:.4f} -> {h.train_loss[-1][1]:.4f}, "
        f"val loss {h.val_loss[0][1]:.4f} -> {h.val_loss[-1][1]:.4f}, "
        f"{metrics['tokens_per_s_run']:,.0f} tok/s, {wall_s:.1f} s; wrote {out_dir}/metrics.json "
        "and loss.png",
    )
    if state is not None:  # the trained model continues a prompt: did it learn?
        config = run.config
        text = sample_text(state, config.model_size, VOCAB_SIZE, config.seq_len, SAMPLE_PROMPT)
        (out_dir / "sample.txt").write_text(text, encoding="utf-8")
        say(run, f"sample (prompt {SAMPLE_PROMPT!r}):\n{text}")


Callback = Callable[[Run], None]
"""Called on every rank with the built :class:`Run`, before resuming and training: a
place to install hooks on ``run.strategy.module`` / ``run.strategy.optimizer``
(profiling, logging; the tests inject faults this way)."""


def run_job(
    config: JobConfig,
    env: Env,
    data: tuple[torch.Tensor, torch.Tensor],
    callbacks: Sequence[Callback] = (),
) -> None:
    """Build, maybe resume, train, write the outputs."""
    start = time.perf_counter()
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run = build_run(config, env, *data)
    degree = config.strategy.tp
    tp_note = f" | tensor parallel {degree} (data parallel {env.world_size // degree})"
    say(
        run,
        f"{config.model_size} GPT: {run.num_params:,} parameters | strategy "
        f"{config.strategy.name}{tp_note if degree > 1 else ''} | {env.world_size} rank(s) on "
        f"{env.device.type} | batch {config.batch_size}x{config.seq_len} tokens per "
        f"{'data-parallel ' if degree > 1 else ''}rank | {len(data[0]):,} train / "
        f"{len(data[1]):,} val tokens",
    )
    for callback in callbacks:
        callback(run)
    if config.resume:
        maybe_resume(run, out_dir)
    train_loop(run, out_dir)
    finish(run, out_dir, time.perf_counter() - start)


def fail(error: Exception, show: bool) -> int:
    if show:
        print(f"{PROG}: error: {error}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None, callbacks: Sequence[Callback] = ()) -> int:
    """Run the job; returns the exit code (2 on bad input, printed as one line).

    Args:
        argv: the command line without the program name; None: ``sys.argv[1:]``.
        callbacks: each called with the built :class:`Run` on every rank (see
            :data:`Callback`). Default none.
    """
    first = os.environ.get("RANK", "0") == "0"
    try:
        config = parse_args(argv)
        text, _ = load_bytes(config.data)
        data = split_tokens(text, config.seq_len)
    except InputError as err:  # the same on every rank: rank 0 says it
        return fail(err, first)
    env = setup_distributed()
    try:
        problem = tp_error(config, env.world_size) or chunks_error(config, env.world_size)
        if problem is not None:  # the same on every rank: rank 0 says it
            return fail(InputError(problem), env.rank == 0)
        run_job(config, env, data, callbacks)
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
