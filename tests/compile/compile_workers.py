"""Rank-side workers of the torch.compile tests (top level: pickled to spawned ranks).

Each case builds the tiny GPT twice, eager and compiled in the order users write
(compile each block, then wrap; or wrap, then compile the whole wrapped model), trains
both for ``STEPS`` steps on the same data and returns the largest parameter difference
and what dynamo did: graphs compiled after each step and the graph breaks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
import torch._inductor.config
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel

from shardkit.distributed.hybrid import hybrid_groups
from shardkit.models import GPT, Block, GPTConfig, gpt_stages
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.nn import ShardedDataParallel, checkpoint_wrapper
from shardkit.nn.data_parallel.fully_sharded import MixedPrecision
from shardkit.nn.pipe import PipelineStage, Schedule1F1B, stage_module
from shardkit.nn.tensor_parallel import gpt_plan, parallelize
from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy
from shardkit.optim import OSS

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
LOCAL_BATCH, SEQ, STEPS = 2, 8, 3

Compiler = Callable[[nn.Module], nn.Module]


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(TINY)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + 10 * step + rank)
    x = torch.randint(0, TINY.vocab_size, (LOCAL_BATCH, SEQ), generator=g)
    y = torch.randint(0, TINY.vocab_size, (LOCAL_BATCH, SEQ), generator=g)
    return x, y


def compile_blocks(model: GPT, backend: Any) -> None:
    """Compile each transformer block in place (``Block.compile``: names and class kept)."""
    for block in model.blocks:
        block.compile(backend=backend)


def _fsdp(model: nn.Module, nesting: str, **kwargs: Any) -> FSDP:
    if nesting == "flat":
        return FSDP(model, **kwargs)
    with enable_wrap(wrapper_cls=FSDP, **kwargs):
        wrapped = auto_wrap(model, transformer_auto_wrap_policy({Block}))
    return wrapped if isinstance(wrapped, FSDP) else FSDP(wrapped, **kwargs)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class Run:
    """One model and its optimizer; ``step(i)`` runs training step i on this rank."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def step(self, i: int) -> None:
        x, y = batch(i, dist.get_rank())
        self.model(x, y)[1].backward()
        self.opt.step()
        self.opt.zero_grad()

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


class PipeRun(Run):
    """One stage per rank of ``gpt_stages``; 1F1B, 2 micro-batches."""

    def __init__(self, stages: nn.Sequential, balance: list[int]) -> None:
        part = stage_module(stages, balance, dist.get_rank())
        self.stage = PipelineStage(part)
        self.runner = Schedule1F1B(self.stage, 2, loss_fn=_lm_loss)
        super().__init__(part, _adamw(part.parameters()))

    def step(self, i: int) -> None:
        (x0, y0), (x1, y1) = batch(i, 0), batch(i, 1)  # 2 micro-batches, as other cases
        x, y = torch.cat([x0, x1]), torch.cat([y0, y1])
        self.runner.step(x if self.stage.is_first else None, target=y)
        self.opt.step()
        self.opt.zero_grad()


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def build(case: str, backend: Any) -> Run:
    """The model of ``case``, compiled with ``backend`` (None: eager)."""
    model = tiny_gpt()
    kind, _, variant = case.partition(":")
    if kind == "tp":
        parallelize(model, gpt_plan())
    if backend is not None and (variant != "whole" or kind == "fsdp"):
        compile_blocks(model, backend)
    run = _wrap(kind, variant, model)
    if backend is not None and variant == "whole":
        run.model.compile(backend=backend)
    return run


def _wrap(kind: str, variant: str, model: GPT) -> Run:
    if kind == "fsdp":
        nesting, raf = ("block", "raf") if variant == "whole" else variant.split("-")
        return _fsdp_run(_fsdp(model, nesting, reshard_after_forward=raf == "raf"))
    if kind == "hsdp":
        groups = hybrid_groups(1)
        pg = (groups.shard, groups.replicate)
        return _fsdp_run(_fsdp(model, "block", process_group=pg, sharding_strategy="HYBRID_SHARD"))
    if kind == "fsdp_bf16":
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return _fsdp_run(_fsdp(model, "block", mixed_precision=mp))
    if kind == "ckpt":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
        return _fsdp_run(_fsdp(model, "block")) if variant == "fsdp" else _ddp_run(model)
    if kind == "oss":
        opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)
        return Run(DistributedDataParallel(model), opt)
    if kind == "sdp":
        opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)
        return Run(ShardedDataParallel(model, opt), opt)
    if kind == "tp":
        return Run(model, _adamw(model.parameters()))
    if kind == "pipe":
        return PipeRun(gpt_stages(model), [2, 2])
    raise ValueError(f"unknown case {kind!r}")


def _fsdp_run(model: nn.Module) -> Run:
    return Run(model, _adamw(model.parameters()))


def _ddp_run(model: nn.Module) -> Run:
    return Run(DistributedDataParallel(model), _adamw(model.parameters()))


def compare(cases: list[str], backend: str = "aot_eager") -> dict[str, dict[str, Any]]:
    """Per case: ``diff`` (largest |compiled - eager| parameter after STEPS steps),
    ``moved`` (largest |eager - initial| parameter), ``graphs`` (graphs compiled by the
    case, after each step), ``calls`` (calls of compiled graphs, after each step),
    ``breaks`` (graph-break reasons and counts) and ``cpu_s`` (this rank's CPU time)."""
    # Compile in this process (no pool of compile workers to start); same code.
    torch._inductor.config.compile_threads = 1
    out: dict[str, dict[str, Any]] = {}
    for case in cases:
        try:
            out[case] = _compare_one(case, backend)
        except Exception as err:  # reported per case, so one failure shows every other
            out[case] = {"error": f"{type(err).__name__}: {err}"[:4000]}
    return out


class CountingBackend:
    """A dynamo backend that counts the graphs it compiles and the calls of them."""

    def __init__(self, backend: str) -> None:
        self.inner, self.graphs, self.calls = lookup_backend(backend), 0, 0

    def __call__(self, gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        self.graphs += 1
        compiled = self.inner(gm, inputs)

        def run(*args: Any) -> Any:
            self.calls += 1
            return compiled(*args)

        return run


_COUNTERS: dict[str, CountingBackend] = {}


def _compare_one(case: str, backend: str) -> dict[str, Any]:
    # One backend object for every case: dynamo's cache keys on it, so cases with the
    # same block shapes reuse the graphs compiled by an earlier case.
    counter = _COUNTERS.setdefault(backend, CountingBackend(backend))
    counters.clear()
    graphs0, calls0 = counter.graphs, counter.calls
    eager, compiled = build(case, None), build(case, counter)
    start = eager.params()
    graphs, calls, t0 = [], [], time.process_time()
    for i in range(STEPS):
        eager.step(i)
        compiled.step(i)
        graphs.append(counter.graphs - graphs0)
        calls.append(counter.calls - calls0)
    want, got = eager.params(), compiled.params()
    assert want.keys() == got.keys(), (sorted(want), sorted(got))
    diff = max((want[k].float() - got[k].float()).abs().max().item() for k in want)
    breaks = {str(k): v for k, v in counters["graph_break"].items()}
    moved = max((want[k].float() - start[k].float()).abs().max().item() for k in want)
    return {
        "diff": diff,
        "moved": moved,
        "graphs": graphs,
        "calls": calls,
        "breaks": breaks,
        "cpu_s": time.process_time() - t0,
    }
