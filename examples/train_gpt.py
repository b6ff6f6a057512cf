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
    JobCheckpointer,
    find_resume_checkpoint,
    load_checkpoint,
    reseed,
    rng_state,
    set_rng_state,
)
from gpt_compile import compile_blocks, compile_error
from gpt_context_parallel import CP_METHODS, cp_error
from gpt_data import VOCAB_SIZE, BatchSampler, InputError, eval_windows, load_bytes, split_tokens
from gpt_dist import Env, all_gather_ints, setup_distributed
from gpt_fault_tolerant import data_parallel as ft_data_parallel
from gpt_fault_tolerant import flag_error as ft_flag_error
from gpt_fault_tolerant import train_loop as ft_train_loop
from gpt_moe import (
    AUX_LOSS_COEF,
    MoEGPT,
    MoESettings,
    active_and_total,
    moe_model_flags,
    moe_step_stats,
    top_k_change,
)
from gpt_optimizer import OPTIMIZERS, optimizer_error
from gpt_report import SAMPLE_PROMPT, StepProfiler, parse_steps, plot_metrics, sample_text
from gpt_sequence_parallel import sequence_parallel_error
from strategies import (
    PRECISIONS,
    STRATEGIES,
    Strategy,
    StrategyConfig,
    build_strategy,
    option_error,
    parallel_dims,
)
from tqdm import tqdm

from shardkit.checkpoint.atomic import atomic_save, atomic_write
from shardkit.checkpoint.manifest import MANIFEST_NAME
from shardkit.extras import MissingDependency
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
        strategy: what the strategy reads (:class:`gpt_strategy.StrategyConfig`:
            ``--strategy``, ``--lr``, ``--precision``, ...).
        model_size: ``tiny``, ``small`` or ``medium`` (``shardkit.models.MODEL_SIZES``).
        steps: optimizer steps; the LR schedule spans them.
        batch_size: sequences per micro-batch per data-parallel rank.
        grad_accum: micro-batches per step (gradient accumulation) of a fresh run;
            None: 1, or what ``global_batch`` implies. A resume keeps the checkpoint's
            global batch and derives the accumulation (:func:`batch_plan`).
        global_batch: sequences per step over all ranks, kept when ``--resume`` meets
            another world size; None: ``batch_size x grad_accum x`` data-parallel size.
        seq_len: tokens per sequence (the position embedding's length).
        warmup_steps: linear LR warmup; None: 10% of ``steps`` (:attr:`warmup`).
        seed: model initialisation (same on every rank) and data order.
        out_dir: checkpoints, ``metrics.json``, ``model.pt``.
        eval_every: steps between validation lines; 0: step 0 and the end only.
        eval_batches: validation batches per rank.
        log_every: steps between train-loss lines; 0: off.
        save_every: steps between checkpoints; 0: never.
        async_checkpoint: write the checkpoints in the background
            (:class:`gpt_checkpoint.JobCheckpointer`); needs ``save_every`` > 0.
        keep: checkpoints kept; 0: all.
        checkpoint_dir: where checkpoints are written and ``--resume`` reads them;
            None: ``out_dir``. With ``fault_tolerant``, one directory every replica
            reaches (the lowest replica of each step's quorum writes).
        stop_after: end this run after this step (None: at ``steps``).
        data: a text file or a directory of ``.txt`` files; None: the default text.
        profile_steps: ``"a:b"``: a ``torch.profiler`` trace of steps a..b per rank
            (``trace-rank<r>.json`` in ``out_dir``); None: no profiling.
        fault_tolerant: ``HOST:PORT`` of the quorum store: this process is replica
            ``replica_id`` of ``max_replicas`` (``examples/gpt_fault_tolerant.py``);
            ``ft_timeout`` seconds drop a silent replica; the first quorum waits
            ``ft_quorum_timeout`` seconds for ``max_replicas`` replicas (then closes
            with those that came). None: off.
        compile: ``torch.compile`` each block before wrapping (``gpt_compile``).
        sample_bytes: bytes of text sampled after the last step (``sample.txt``); 0:
            no sample.
    """

    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    model_size: str = "tiny"
    steps: int = 500
    batch_size: int = 8
    grad_accum: int | None = None
    global_batch: int | None = None
    seq_len: int = 128
    warmup_steps: int | None = None
    seed: int = 0
    out_dir: str = "runs/gpt"
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 0
    save_every: int = 100
    async_checkpoint: bool = False
    keep: int = 2
    checkpoint_dir: str | None = None
    stop_after: int | None = None
    data: str | None = None
    profile_steps: str | None = None
    fault_tolerant: str | None = None
    replica_id: int = 0
    max_replicas: int = 1
    ft_timeout: float = 10.0
    ft_quorum_timeout: float = 300.0
    compile: bool = False
    sample_bytes: int = 120

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
    add(
        "--strategy",
        default=None,
        help=f"one of {sorted(STRATEGIES)} (default: pipe with --pp, hsdp with "
        f"--dp-replicate, fsdp with --dp-shard, else {opt.name})",
    )
    add("--model-size", default=job.model_size, choices=sorted(MODEL_SIZES), help="default tiny")
    add("--steps", type=_positive, default=job.steps, help=f"optimizer steps (default {job.steps})")
    add("--batch-size", type=_positive, default=job.batch_size, help="sequences per micro-batch")
    add("--grad-accum", type=_positive, default=None, help="micro-batches per step (default 1)")
    add("--global-batch", type=_positive, default=None, help="sequences per step, all ranks")
    add("--seq-len", type=_positive, default=job.seq_len, help="tokens per sequence")
    add("--lr", type=float, default=opt.lr, help=f"peak learning rate (default {opt.lr})")
    add("--warmup-steps", type=_non_negative, default=None, help="default 10%% of --steps")
    add("--seed", type=int, default=job.seed, help=f"default {job.seed}")
    add("--out-dir", default=job.out_dir, help=f"checkpoints, metrics.json (default {job.out_dir})")
    add("--eval-every", type=_non_negative, default=job.eval_every, help="0: at the end only")
    add("--eval-batches", type=_positive, default=job.eval_batches, help="val batches per rank")
    add("--log-every", type=_non_negative, default=job.log_every, help="train-loss lines; 0: off")
    add("--save-every", type=_non_negative, default=job.save_every, help="0: never")
    add("--async-checkpoint", action="store_true", help="write checkpoints in the background")
    add("--keep", type=_non_negative, default=job.keep, help="checkpoints kept; 0: all")
    add("--checkpoint-dir", default=None, help="checkpoints and --resume (default --out-dir)")
    add("--stop-after", type=_positive, default=None, help="end this run after this step")
    add("--resume", action="store_true", help="continue from the latest checkpoint")
    add("--data", default=None, help="a text file or a directory of .txt files")
    add("--chunks", type=_positive, default=opt.chunks, help="pipe: micro-batches per step")
    add("--schedule", default=opt.schedule, choices=["gpipe", "1f1b"], help="pipe")
    add("--precision", default=opt.precision, choices=list(PRECISIONS), help="ddp/oss/sdp/fsdp")
    add("--activation-checkpointing", action="store_true", help="recompute each Block")
    add(
        "--offload-dir",
        default=None,
        help="offload: disk-tier directory, rank<r>/ per rank (default: CPU memory); "
        "--resume starts it afresh from the checkpoint",
    )
    add("--shard-size", type=_positive, default=None, help="hsdp: ranks per shard group")
    add("--tp", type=_positive, default=opt.tp, help="tensor-parallel degree (not offload)")
    add("--sequence-parallel", action="store_true", help="with --tp: Megatron-LM's sequence split")
    add("--dp-shard", type=_positive, default=None, help="fsdp/hsdp/pipe: ranks sharding")
    add("--dp-replicate", type=_positive, default=None, help="fsdp/hsdp/pipe: replicas")
    add("--pp", type=_positive, default=None, help="pipe: pipeline stages (default: the rest)")
    add(
        "--grad-compression",
        default=None,
        choices=["bf16", "fp16", "powersgd", "int8"],
        help="ddp/oss/sdp/fsdp/hsdp: compress the gradient reduction (hsdp: across nodes)",
    )
    add("--moe-experts", type=_non_negative, default=0, help="experts per MoE MLP; 0: dense")
    add("--moe-top-k", type=_positive, default=opt.moe_top_k, help="MoE: experts per token")
    add("--moe-every", type=_positive, default=opt.moe_every, help="MoE in every N-th block")
    add("--ep", type=_positive, default=opt.ep, help="expert-parallel degree (splits dp_shard)")
    add("--cp", type=_positive, default=opt.cp, help="context-parallel degree (not pipe/offload)")
    add("--cp-method", default=opt.cp_method, choices=list(CP_METHODS), help="--cp attention")
    add("--profile-steps", default=None, metavar="A:B", help="torch.profiler trace of steps A..B")
    add("--fault-tolerant", default=None, metavar="HOST:PORT", help="quorum store: one replica")
    add("--replica-id", type=_non_negative, default=0, help="--fault-tolerant: this replica")
    add("--max-replicas", type=_positive, default=1, help="--fault-tolerant: replica ids")
    add("--ft-timeout", type=float, default=job.ft_timeout, help="seconds: drop a replica")
    add(
        "--ft-quorum-timeout", type=float, default=job.ft_quorum_timeout, help="seconds: 1st quorum"
    )
    add("--compile", action="store_true", help="torch.compile each Block before wrapping")
    add("--optimizer", default=opt.optimizer, choices=list(OPTIMIZERS), help="default adamw")
    add("--sample-bytes", type=_non_negative, default=job.sample_bytes, help="0: no sample")
    flags = vars(p.parse_args(argv))
    flags["strategy"] = flags["strategy"] or shorthand(flags)
    config = JobConfig.from_flags(flags)
    if config.profile_steps is not None:
        try:
            parse_steps(config.profile_steps)
        except ValueError as err:
            raise InputError(str(err)) from None
    opt = config.strategy
    problem = (
        option_error(opt)
        or sequence_parallel_error(opt.sequence_parallel, opt.tp, config.seq_len, opt.name)
        or _cp_error(config)
    )
    if problem is None:
        problem = optimizer_error(
            opt.optimizer, opt.name, opt.tp, opt.cp, opt.moe_experts, opt.precision
        )
    if problem is None and config.compile:
        problem = compile_error(opt.name, opt.moe_experts, opt.cp, opt.sequence_parallel)
    if problem is not None:
        raise InputError(problem)
    if config.async_checkpoint and not config.save_every:
        raise InputError(
            "--async-checkpoint writes the --save-every checkpoints in the background, and "
            "--save-every is 0; give --save-every N > 0 or drop --async-checkpoint"
        )
    return config


def _cp_error(config: JobConfig) -> str | None:
    opt = config.strategy
    heads = MODEL_SIZES[config.model_size]["n_head"]
    moe = opt.moe_experts > 0
    return cp_error(
        opt.cp, opt.cp_method, opt.name, config.seq_len, heads, opt.tp, moe, opt.sequence_parallel
    )


def shorthand(flags: dict[str, Any]) -> str:
    """The ``--strategy`` that a run giving mesh flags only means: ``pipe`` with
    ``--pp``, ``hsdp`` with ``--dp-replicate``, ``fsdp`` with ``--dp-shard``, else
    ``ddp`` (the default)."""
    if flags.get("pp") is not None:
        return "pipe"
    if flags.get("dp_replicate") is not None:
        return "hsdp"
    return "fsdp" if flags.get("dp_shard") is not None else StrategyConfig().name


@dataclass
class History:
    """What metrics.json reports and checkpoints carry: ``[step, value]`` pairs."""

    train_loss: list[list[float]] = field(default_factory=list)
    val_loss: list[list[float]] = field(default_factory=list)
    tokens_per_s: list[list[float]] = field(default_factory=list)
    moe_aux_loss: list[list[float]] = field(default_factory=list)  # summed over layers
    moe_dropped: list[list[float]] = field(default_factory=list)  # share of choices dropped


@dataclass(frozen=True)
class BatchPlan:
    """How a step's global batch is split over micro-batches and data-parallel ranks.

    ``global_batch = micro_batch x accumulation x dp_size`` (sequences). The global
    batch stays fixed for a whole run, resumes at another world size included; the
    accumulation is what changes (:func:`batch_plan`). With ``pipeline`` (``--strategy
    pipe``) the ``dp_size`` ranks only sample the rows: they are all-gathered and the
    whole global batch runs through the ranks' pipeline stages (data-parallel size 1).
    """

    global_batch: int
    micro_batch: int
    accumulation: int
    dp_size: int
    pipeline: bool = False
    pipelines: int = 1

    @property
    def rows(self) -> int:
        """Sequences per data-parallel rank per step: ``micro_batch x accumulation``."""
        return self.micro_batch * self.accumulation

    def describe(self) -> str:
        split = f"global batch {self.global_batch} = {self.micro_batch} x {self.accumulation} "
        if self.pipeline and self.pipelines > 1:
            stages = self.dp_size // self.pipelines
            return (
                f"{split}micro-batch(es) x {self.dp_size} rank(s) sampling rows, each "
                f"{stages} rank(s)' rows through their {stages} pipeline stage(s), "
                f"{self.pipelines} pipelines (data-parallel size {self.pipelines})"
            )
        if self.pipeline:
            return (
                f"{split}micro-batch(es) x {self.dp_size} rank(s) sampling rows, all of them "
                f"through {self.dp_size} pipeline stage(s) (data-parallel size 1)"
            )
        return f"{split}micro-batch(es) x {self.dp_size} data-parallel rank(s)"


def _split_fix(target: int, micro: int, dp_size: int) -> str:
    """What makes ``target`` split into ``micro x accumulation x dp_size``."""
    fixes = []
    if target % micro == 0:
        fixes.append(
            f"launch a data-parallel size that divides {target // micro} "
            f"({target} / --batch-size {micro})"
        )
    if target % dp_size == 0:
        fixes.append(
            f"use a --batch-size that divides {target // dp_size} ({target} / {dp_size} ranks)"
        )
    return " or ".join(fixes) if fixes else f"launch a data-parallel size that divides {target}"


def batch_plan(config: JobConfig, dp_size: int, saved: int | None = None) -> BatchPlan:
    """The :class:`BatchPlan` of ``config`` on ``dp_size`` data-parallel ranks.

    Args:
        saved: the global batch of the checkpoint being resumed (kept); None: a fresh
            run (``--global-batch``, else ``--batch-size x --grad-accum x dp_size``).

    Raises:
        InputError: the global batch is not a whole number of micro-batches per rank
            (the message gives the arithmetic and the fix), ``--global-batch`` differs
            from the checkpoint's, or ``--grad-accum`` contradicts ``--global-batch``.
    """
    micro, pipeline = config.batch_size, config.strategy.name == "pipe"
    pipes = pipelines(config, dp_size)
    if saved is None and config.global_batch is None:
        accumulation = config.grad_accum or 1
        global_batch = micro * accumulation * dp_size
        return BatchPlan(global_batch, micro, accumulation, dp_size, pipeline, pipes)
    if saved is not None and config.global_batch not in (None, saved):
        raise InputError(
            f"--resume: the checkpoint was trained at global batch {saved}, this run asks "
            f"--global-batch {config.global_batch}; drop --global-batch or use another --out-dir"
        )
    target = saved if saved is not None else config.global_batch
    assert target is not None
    source = "--resume: the checkpoint's global batch" if saved is not None else "--global-batch"
    if target % (micro * dp_size):
        raise InputError(
            f"{source} {target} does not split over {dp_size} data-parallel rank(s): "
            f"global batch = --batch-size {micro} x grad-accum x {dp_size} ranks, and "
            f"{target} / ({micro} x {dp_size}) = {target / (micro * dp_size):.4g} is not a "
            f"whole number; {_split_fix(target, micro, dp_size)}"
        )
    accumulation = target // (micro * dp_size)
    if saved is None and config.grad_accum not in (None, accumulation):
        raise InputError(
            f"--global-batch {target} = --batch-size {micro} x --grad-accum {accumulation} x "
            f"{dp_size} data-parallel rank(s), not --grad-accum {config.grad_accum}; "
            "give one of the two"
        )
    return BatchPlan(target, micro, accumulation, dp_size, pipeline, pipes)


def pipelines(config: JobConfig, dp_size: int) -> int:
    """Pipe: the pipelines (the mesh's data-parallel size) among ``dp_size`` ranks
    sampling rows; 1 for another strategy or degrees that do not fit (refused by
    :func:`mesh_error` before a plan is used)."""
    if config.strategy.name != "pipe":
        return 1
    try:
        return parallel_dims(config.strategy, dp_size * config.strategy.tp).dp
    except ValueError:
        return 1


@dataclass
class Run:
    """Everything the training loop touches."""

    config: JobConfig
    env: Env
    model: GPT
    strategy: Strategy
    scheduler: torch.optim.lr_scheduler.LambdaLR
    plan: BatchPlan
    sampler: BatchSampler
    val: tuple[torch.Tensor, torch.Tensor]
    train_tokens: torch.Tensor
    val_tokens: torch.Tensor
    num_params: int  # of the whole model, counted before a strategy shards it
    mesh: dict[str, int]  # the degrees the strategy runs on (pp, dp_replicate, dp_shard, cp, tp)
    moe_params: tuple[int, int] = (0, 0)  # MoE: active (per token) and total parameters
    history: History = field(default_factory=History)
    step: int = 0
    steps_this_run: int = 0
    train_time_s: float = 0.0  # seconds in this run's training steps (no eval, no saves)
    checkpointer: JobCheckpointer = field(default_factory=lambda: JobCheckpointer(False))


def lr_factor(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``floor`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def chunks_error(config: JobConfig, plan: BatchPlan) -> str | None:
    """Why pipe's ``--chunks`` cannot split the global batch, or None when it can."""
    rows = plan.global_batch // plan.pipelines  # a pipeline runs its share of the batch
    if config.strategy.name == "pipe" and config.strategy.chunks > rows:
        return (
            f"--chunks {config.strategy.chunks} is more micro-batches than the {rows} rows "
            f"of a step's batch ({plan.describe()}); use --chunks <= {rows} or a larger "
            "--batch-size"
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


def mesh_error(config: JobConfig, world_size: int) -> str | None:
    """Why the mesh flags (``--pp``, ``--dp-replicate``, ``--dp-shard``, ``--tp``) do not
    fit the world size, or None when they do (:func:`strategies.parallel_dims`)."""
    try:
        dims = parallel_dims(config.strategy, world_size)
    except ValueError as err:
        return f"{err} (the mesh of --strategy {config.strategy.name})"
    if config.strategy.pp is not None and dims.pp > len_stages(config):
        return (
            f"--pp {dims.pp} is more pipeline stages than the {config.model_size} GPT's "
            f"{len_stages(config)} layers (embedding, blocks, head); use --pp <= "
            f"{len_stages(config)}"
        )
    return None


def len_stages(config: JobConfig) -> int:
    """The layers a pipeline splits the GPT into: embedding, each block, head."""
    return MODEL_SIZES[config.model_size]["n_layer"] + 2


def launch_error(config: JobConfig, env: Env) -> str | None:
    """Why the job cannot run at this launch's world size (``--tp``, the global batch,
    pipe's ``--chunks``) or with these paths (``--offload-dir`` a file, ``--resume``
    with ``--out-dir`` a checkpoint directory), or None; the same answer on every rank."""
    problem = tp_error(config, env.world_size) or mesh_error(config, env.world_size)
    problem = problem or ft_flag_error(config, env.world_size)
    if problem is not None:
        return problem
    offload_dir = config.strategy.offload_dir
    if offload_dir is not None and Path(offload_dir).exists() and not Path(offload_dir).is_dir():
        return f"--offload-dir {offload_dir} is not a directory (a disk-tier directory to create or reuse)"
    out_dir = Path(config.out_dir)
    if config.resume and (out_dir / MANIFEST_NAME).is_file():
        return (
            f"--resume: --out-dir {out_dir} is a checkpoint directory (it holds "
            f"{MANIFEST_NAME}), not a run directory; use the run directory that holds "
            f"it and 'latest': --out-dir {out_dir.parent}"
        )
    try:
        plan = batch_plan(config, data_parallel(config, env)[1])
    except InputError as err:
        return str(err)
    return chunks_error(config, plan)


def data_parallel(config: JobConfig, env: Env) -> tuple[int, int]:
    """This rank's data-parallel rank and the data-parallel size: under ``--tp`` the
    ``tp`` consecutive ranks of one tensor-parallel group feed the same rows, under
    ``--cp`` the ``cp x tp`` ranks of one context-parallel group (each then keeps its
    part of every sequence); with ``--fault-tolerant``, the replica id of
    ``--max-replicas``."""
    if config.fault_tolerant is not None:
        return ft_data_parallel(config, env.rank, env.world_size)
    same_rows = config.strategy.tp * config.strategy.cp
    return env.rank // same_rows, env.world_size // same_rows


def build_run(config: JobConfig, env: Env, train: torch.Tensor, val: torch.Tensor) -> Run:
    """Model (same seed on every rank), strategy, LR schedule, data sampler (one per
    data-parallel rank)."""
    torch.manual_seed(config.seed)
    random.seed(config.seed + env.rank)
    shape = gpt_config(config.model_size, vocab_size=VOCAB_SIZE, block_size=config.seq_len)
    meta = STRATEGIES[config.strategy.name].meta_init == "default"
    opt = config.strategy
    if opt.moe_experts:  # each MoE layer from its own seed: the same at every --ep
        moe = MoESettings(opt.moe_experts, opt.moe_top_k, opt.moe_every, config.seed)
        model: GPT = MoEGPT(shape, moe).to(env.device)
    elif meta and opt.tp == 1:  # allocates its part only (--tp splits a real GPT)
        with torch.device("meta"):
            model = GPT(shape)
    else:
        model = GPT(shape).to(env.device)
    num_params = model.num_parameters()
    if config.compile:
        compile_blocks(model)
    moe_params = active_and_total(model) if isinstance(model, MoEGPT) else (0, 0)
    strategy = build_strategy(model, config.strategy, env.device)  # + precision, checkpointing
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        strategy.optimizer, lambda s: lr_factor(s, config.warmup, config.steps)
    )
    plan = batch_plan(config, data_parallel(config, env)[1])
    sampler, val_xy = _data(config, env, plan, train, val)
    dims = parallel_dims(config.strategy, env.world_size)
    mesh = {d: getattr(dims, d) for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
    return Run(
        config,
        env,
        model,
        strategy,
        scheduler,
        plan,
        sampler,
        val_xy,
        train,
        val,
        num_params,
        mesh,
        moe_params,
    )


def _data(
    config: JobConfig, env: Env, plan: BatchPlan, train: torch.Tensor, val: torch.Tensor
) -> tuple[BatchSampler, tuple[torch.Tensor, torch.Tensor]]:
    """This rank's sampler of the global batch, and its validation windows
    (``--eval-batches x`` global batch of them over the data-parallel ranks): both
    functions of the global batch, not of the world size."""
    dp_rank, dp_size = data_parallel(config, env)
    sampler = BatchSampler(train, plan.global_batch, config.seq_len, config.seed, dp_rank, dp_size)
    n_val = config.eval_batches * plan.global_batch
    return sampler, eval_windows(val, n_val, config.seq_len, dp_rank, dp_size)


def set_plan(run: Run, plan: BatchPlan) -> None:
    """Switch ``run`` to ``plan`` (a resume at another world size): a new sampler (at
    position 0) and validation windows.

    Raises:
        InputError: pipe's ``--chunks`` does not fit the plan's global batch.
    """
    problem = chunks_error(run.config, plan)
    if problem is not None:
        raise InputError(problem)
    run.plan = plan
    run.sampler, run.val = _data(run.config, run.env, plan, run.train_tokens, run.val_tokens)


def checkpoint_extra(run: Run) -> dict[str, Any]:
    """This rank's resumable state besides the model and optimizer (the universal
    checkpoint's ``extra``): plain data and tensors."""
    return {
        "model": model_flags(run.config),
        "scheduler": run.scheduler.state_dict(),
        "sampler": run.sampler.state_dict(),  # samples consumed globally, global batch
        "strategy": run.strategy.extra_state(),  # the fp16 loss scaler
        "rng": rng_state(run.env.device),
        "history": asdict(run.history),
        "world_size": run.env.world_size,
        "strategy_name": run.config.strategy.name,  # --strategy (the layout may add +tp<T>)
        "tp": run.config.strategy.tp,
        "mesh": run.mesh,
        "schedule": {"steps": run.config.steps, "warmup": run.config.warmup},
        "moe_top_k": run.config.strategy.moe_top_k,  # may change on resume: warned
    }


def checkpoint_dir(config: JobConfig) -> Path:
    """Where checkpoints go and ``--resume`` reads: ``--checkpoint-dir``, else ``--out-dir``."""
    return Path(config.checkpoint_dir or config.out_dir)


def save(run: Run, out_dir: Path) -> None:
    """This step's checkpoint (collective), into :func:`checkpoint_dir` (``out_dir``
    unless ``--checkpoint-dir`` is given)."""
    strategy = run.strategy
    module = strategy.checkpoint_module()
    extra = checkpoint_extra(run)
    directory = checkpoint_dir(run.config) if run.config.checkpoint_dir else out_dir
    run.checkpointer.save(directory, run.step, module, strategy.optimizer, extra, run.config.keep)


def restore(run: Run, step: int, saved_world_size: int, mine: Any, first: Any) -> None:
    """Set the run's state from a checkpoint's ``extra`` (the model and optimizer are
    loaded already): ``mine`` is this rank's (None for a rank that did not exist when it
    was saved), ``first`` rank 0's.

    The global batch, samples consumed, LR schedule, loss history and loss scaler are
    the same on every rank: rank 0's are used. RNG states: at the same world size each
    rank continues its own streams (bit for bit the uninterrupted run); at another
    size every rank reseeds from ``(seed, step, rank)`` (:func:`gpt_checkpoint.reseed`).

    Raises:
        InputError: the saved global batch does not split over this run's data-parallel
            ranks (:func:`batch_plan`), or pipe's ``--chunks`` does not fit it.
    """
    config, env = run.config, run.env
    plan = batch_plan(config, data_parallel(config, env)[1], first["sampler"]["global_batch"])
    set_plan(run, plan)
    run.step = step
    run.sampler.load_state_dict(first["sampler"])
    run.scheduler.load_state_dict(first["scheduler"])
    schedule_warning = schedule_change(first.get("schedule"), config, step)
    if schedule_warning is not None:
        warn(run, schedule_warning)
    opt = config.strategy
    top_k_warning = top_k_change(first.get("moe_top_k"), opt.moe_experts, opt.moe_top_k)
    if top_k_warning is not None:
        warn(run, top_k_warning)
    run.strategy.load_extra_state(first["strategy"])
    run.history = History(**first["history"])
    if saved_world_size == env.world_size and mine is not None:
        set_rng_state(mine["rng"], env.device)
    else:
        reseed(config.seed, step, env.rank, env.device)


def schedule_change(saved: dict[str, int] | None, config: JobConfig, step: int) -> str | None:
    """A warning if this run's LR schedule (``--steps``, ``--warmup-steps``) differs from
    the checkpoint's ``saved`` one (None: a checkpoint from before it was kept), naming
    the LR factor at ``step`` under each; else None. Extending a run this way is
    allowed, but the learning rate jumps (see docs/train_gpt.md, Pitfalls)."""
    if saved is None or (saved["steps"], saved["warmup"]) == (config.steps, config.warmup):
        return None
    before = lr_factor(step, saved["warmup"], saved["steps"])
    after = lr_factor(step, config.warmup, config.steps)
    return (
        f"--steps {config.steps} --warmup-steps {config.warmup} differ from the "
        f"checkpoint's {saved['steps']} and {saved['warmup']}: the LR schedule changes, at "
        f"step {step} the factor on --lr goes from {before:.3f} to {after:.3f}. To continue "
        "the same schedule, resume with the checkpoint's --steps (and --stop-after to end "
        "earlier)"
    )


def no_step_left(step: int, config: JobConfig) -> str | None:
    """The line saying that a run resumed at ``step`` has no step to run (``step`` is
    at or past ``--steps`` or ``--stop-after``), or None when it has."""
    if step >= config.steps:
        stop, flag = config.steps, "--steps"
    elif config.stop_after is not None and step >= config.stop_after:
        stop, flag = config.stop_after, "--stop-after"
    else:
        return None
    return (
        f"--resume: the checkpoint is at step {step} and {flag} is {stop}: no step left to "
        f"run; this run trains nothing (a {flag} above {step} continues the training)"
    )


def final_losses(history: History, steps_this_run: int) -> str:
    """The losses of the summary line: first -> last of the run; when no step ran, the
    checkpoint's last recorded ones with their steps (not the step-0 validation loss as
    if it were the final one)."""
    train, val = history.train_loss, history.val_loss
    if steps_this_run:
        return (
            f"train loss {train[0][1]:.4f} -> {train[-1][1]:.4f}, "
            f"val loss {val[0][1]:.4f} -> {val[-1][1]:.4f}"
        )
    last = [
        f"{name} {pairs[-1][1]:.4f} (step {int(pairs[-1][0])})"
        for name, pairs in (("train", train), ("val", val))
        if pairs
    ]
    if not last:
        return "no step ran, and the checkpoint records no loss"
    return f"no step ran; the checkpoint's last losses: {', '.join(last)}"


def model_flags(config: JobConfig) -> dict[str, Any]:
    """The flags that fix the model's shapes (kept in each checkpoint; a resume with
    others is refused). ``--tp`` is not one: the universal checkpoint holds the plain
    GPT's tensors, so a resume may change the tensor-parallel degree."""
    moe = moe_model_flags(config.strategy.moe_experts, config.strategy.moe_every)
    return {"model_size": config.model_size, "seq_len": config.seq_len, **moe}


def maybe_resume(run: Run, out_dir: Path) -> None:
    """Restore the newest intact checkpoint (a damaged newer one: warn and skip it),
    written at any world size by any strategy."""
    ckpt = find_resume_checkpoint(out_dir, lambda line: warn(run, line))
    if ckpt is None:
        say(run, f"--resume: no checkpoint in {out_dir}; starting from step 0")
        return
    config, env, strategy = run.config, run.env, run.strategy
    dp_size = data_parallel(config, env)[1]

    def check(first: dict[str, Any]) -> None:  # before loading: refuse what cannot fit
        problem = chunks_error(
            config, batch_plan(config, dp_size, first["sampler"]["global_batch"])
        )
        if problem is not None:
            raise InputError(problem)

    before = run.plan
    module, optimizer = strategy.checkpoint_module(), strategy.optimizer
    loaded = load_checkpoint(ckpt, module, optimizer, model_flags(config), check)
    first: dict[str, Any] = loaded.extra(0) or {}  # present: checked before loading
    restore(run, int(loaded.step), int(loaded.saved_world_size), loaded.extra(env.rank), first)
    say(run, f"resumed from {ckpt} at step {run.step}")
    nothing_left = no_step_left(run.step, config)
    if nothing_left is not None:
        say(run, nothing_left)
    saved = (loaded.saved_world_size, first.get("strategy_name", loaded.saved_strategy))
    if saved != (env.world_size, config.strategy.name):
        say(
            run,
            f"elastic resume: saved by {saved[0]} rank(s) with --strategy {saved[1]}, now "
            f"{env.world_size} with --strategy {config.strategy.name}; {run.plan.describe()}",
        )
    elif run.plan != before:
        say(run, f"resume keeps the checkpoint's {run.plan.describe()}")


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
    mean = run.strategy.train_step(x, y, run.plan.accumulation)
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
    tokens_per_step = run.plan.global_batch * config.seq_len
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
            moe_note = ""
            if isinstance(run.model, MoEGPT):  # the last micro-batch's, mean over ranks
                aux, dropped = moe_step_stats(run.model, run.env.device)
                run.history.moe_aux_loss.append([run.step, aux])
                run.history.moe_dropped.append([run.step, dropped])
                moe_note = f" | aux {aux:.4f} | dropped {dropped:.3f}"
            profiler.after_step(run.step)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            tps = window_steps * tokens_per_step / window_s
            if config.log_every and run.step % config.log_every == 0:
                say(
                    run,
                    f"step {run.step:5d}/{config.steps} | train {loss:.4f}{moe_note} | "
                    f"{tps:,.0f} tok/s",
                )
            if (
                config.eval_every and run.step % config.eval_every == 0
            ) or run.step == config.steps:
                run.history.tokens_per_s.append([run.step, tps])
                report(run, tps)
                window_s, window_steps = 0.0, 0
            end_of_run = run.step == stop and (config.save_every > 0 or stop < config.steps)
            if (config.save_every and run.step % config.save_every == 0) or end_of_run:
                save(run, out_dir)
    finally:
        bar.close()
        profiler.close()


def summary(run: Run, wall_s: float) -> dict[str, Any]:
    """metrics.json's content (a collective: it gathers every rank's state bytes)."""
    config, h = run.config, run.history
    tokens = run.steps_this_run * run.plan.global_batch * config.seq_len
    return {
        "strategy": config.strategy.name,
        "world_size": run.env.world_size,
        "global_batch": run.plan.global_batch,
        "grad_accum": run.plan.accumulation,
        "model_size": config.model_size,
        "param_count": run.num_params,
        "active_param_count": run.moe_params[0] or run.num_params,  # MoE: per token
        "step": run.step,
        "start_step": run.step - run.steps_this_run,
        "train_loss": h.train_loss,
        "val_loss": h.val_loss,
        "tokens_per_s": h.tokens_per_s,
        "moe_aux_loss": h.moe_aux_loss,
        "moe_dropped": h.moe_dropped,
        "tokens_per_s_run": tokens / run.train_time_s if run.train_time_s else 0.0,
        "train_time_s": run.train_time_s,
        "wall_s": wall_s,
        "model_state_bytes": gather_state_bytes(run),
        "args": config.flags(),
    }


def finish(run: Run, out_dir: Path, wall_s: float) -> None:
    """metrics.json and the summary (rank 0); model.pt once the last step is done."""
    metrics = summary(run, wall_s)
    plain = not isinstance(run.model, MoEGPT)  # model.pt and the sample: the plain GPT's
    last = run.step == run.config.steps and plain
    state = run.strategy.consolidated_model_state() if last else None
    if run.env.rank != 0:
        return
    with atomic_write(out_dir / "metrics.json", "w") as handle:
        json.dump(metrics, handle, indent=1)
    if state is not None:
        atomic_save(state, out_dir / "model.pt")
    wrote = f"{out_dir}/metrics.json and loss.png"
    try:
        plot_metrics(metrics, out_dir / "loss.png")
    except MissingDependency as missing:  # an optional package costs its feature only
        warn(run, f"{missing.feature} skipped: {missing.install}")
        wrote = f"{out_dir}/metrics.json"
    losses = final_losses(run.history, run.steps_this_run)
    speed = f"{metrics['tokens_per_s_run']:,.0f} tok/s, " if run.steps_this_run else ""
    say(run, f"done: step {run.step}, {losses}, {speed}{wall_s:.1f} s; wrote {wrote}")
    if not plain:
        say(run, "MoE: no model.pt or sample (the checkpoints hold the experts)")
    config = run.config
    if state is not None and config.sample_bytes:  # the trained model continues a prompt
        text = sample_text(
            state, config.model_size, VOCAB_SIZE, config.seq_len, SAMPLE_PROMPT, config.sample_bytes
        )
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
    """Build, maybe resume, print the banner (with the batch plan that runs), train,
    write the outputs."""
    start = time.perf_counter()
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run = build_run(config, env, *data)
    for callback in callbacks:
        callback(run)
    if config.resume:  # may change the batch plan, or refuse it: the banner comes after
        maybe_resume(run, checkpoint_dir(config))
    degree, cp = config.strategy.tp, config.strategy.cp
    tp_note = f" | tensor parallel {degree} (data parallel {env.world_size // (degree * cp)})"
    cp_note = f" | context parallel {cp} ({config.strategy.cp_method})" if cp > 1 else ""
    mesh = " x ".join(f"{d} {n}" for d, n in run.mesh.items() if n > 1)
    mesh_note = f" | mesh {mesh}" if STRATEGIES[config.strategy.name].composes and mesh else ""
    moe_note = ""
    if isinstance(run.model, MoEGPT):
        s, (active, total) = run.model.moe_settings, run.moe_params
        moe_note = (
            f" | MoE {s.experts} experts top-{s.top_k} every {s.every} block(s), ep "
            f"{config.strategy.ep}, aux loss x {AUX_LOSS_COEF}: {active:,} active / "
            f"{total:,} total parameters"
        )
    say(
        run,
        f"{config.model_size} GPT: {run.num_params:,} parameters | strategy "
        f"{config.strategy.name}{tp_note if degree > 1 else ''}{cp_note}{mesh_note}{moe_note} | "
        f"{env.world_size} rank(s) on "
        f"{env.device.type} | {run.plan.describe()}, {config.seq_len} tokens each | "
        f"{len(data[0]):,} train / "
        f"{len(data[1]):,} val tokens",
    )
    run.checkpointer = JobCheckpointer(config.async_checkpoint)  # collective when async
    if config.fault_tolerant is not None:  # refuses --async-checkpoint
        ft_train_loop(run, out_dir, report, say, save)
    else:
        with run.checkpointer:  # the last background save is committed before finish
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
        problem = launch_error(config, env)
        if problem is not None:  # the same on every rank: rank 0 says it
            return fail(InputError(problem), env.rank == 0)
        run_job(config, env, data, callbacks)
    except InputError as err:  # raised on every rank (the checkpoint checks agree): rank 0 says it
        return fail(err, env.rank == 0)
    except NonFiniteLossError as err:  # every rank stops; rank 0 says it
        return fail(err, env.rank == 0)
    finally:
        if env.owns_group:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
