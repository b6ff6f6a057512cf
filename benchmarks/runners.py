"""The strategies the benchmarks run side by side, each built as a :class:`Runner` on a rank.

Each entry of :data:`STRATEGIES` builds, on every rank of an initialised process
group, the main job's GPT wrapped one way, and says which ZeRO stage it is (for the
memory formula and the communication theory). shardkit's entries (and torch DDP, the
baseline) are generated from the main job's registry (``examples/strategies.py``, the
``--strategy`` flag of ``examples/train_gpt.py``): one row per spec, with the spec's
ZeRO stage, plus a "meta init" row where the spec's factory takes a GPT built on the
meta device. A runner's step is the strategy's own ``forward_backward`` and ``step``
(the pipeline runs its schedule there), so the benchmark runs exactly what the main job
trains; torch's, DeepSpeed's and FairScale's are built here. DeepSpeed and FairScale entries
are only run where the package imports (:func:`available`); they are written against
the pinned versions of the ``bench`` extra (``pip install -e .[bench]``, see
docs/benchmarks.md), on CPU with gloo; :func:`deepspeed_on_cpu` says what DeepSpeed
needs for that.

Every DDP-based runner gets the counted all-reduce comm hook
(:func:`benchmarks.comm.count_ddp`), so its gradient traffic is counted like the rest.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.comm import count_ddp
from benchmarks.common import ADAMW, MIB, build_torch_fsdp2
from shardkit.memory import _count_new  # the storage-dedup rule of model_state_bytes
from shardkit.models import GPT, GPTConfig, gpt_init_fn, gpt_stages

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES_DIR) not in sys.path:  # the main job's registry is a script, not a package
    sys.path.insert(0, str(EXAMPLES_DIR))

from gpt_compile import compile_blocks  # noqa: E402  (examples/gpt_compile.py)
from strategies import STRATEGIES as MAIN_JOB  # noqa: E402  (examples/strategies.py)
from strategies import OffloadGPT, StrategyConfig  # noqa: E402

__all__ = ["STRATEGIES", "BenchStrategy", "Runner", "available"]


@dataclass
class Runner:
    """One strategy's training step on this rank.

    Attributes:
        module: called as ``module(x, targets=y) -> (logits, loss)``, ``x``, ``y`` of
            shape ``(batch, seq_len)``.
        step_fn: optimizer step and ``zero_grad`` (called after backward).
        optimizer_state: returns the mapping holding this rank's optimizer state.
        backward: how the loss is back-propagated (DeepSpeed: ``engine.backward``).
        module_state: bytes of this rank's parameters, gradients and buffers (the
            categories of :func:`benchmarks.common.local_state_bytes`) where the
            module's own tensors do not show them (DeepSpeed keeps partitions and
            gradient buffers in its optimizer); None: measured from ``module``.
        forward_backward_fn: ``(x, y) -> loss`` doing forward and backward, where the
            strategy has its own (the main job's ``Strategy.forward_backward``: the
            pipeline runs its schedule there); None: ``module`` then ``backward``.
    """

    module: nn.Module
    step_fn: Callable[[], None]
    optimizer_state: Callable[[], Mapping[Any, Any]]
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward
    module_state: Callable[[], dict[str, int]] | None = None
    forward_backward_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward with the loss, then backward; the loss (detached, shape ``()``)."""
        if self.forward_backward_fn is not None:
            return self.forward_backward_fn(x, y)
        _, loss = self.module(x, targets=y)
        self.backward(loss)
        return loss.detach()

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One training step: forward, backward, optimizer step, ``zero_grad``; the loss."""
        loss = self.forward_backward(x, y)
        self.step_fn()
        return loss


Builder = Callable[[GPTConfig, Mapping[str, Any]], Runner]


@dataclass(frozen=True)
class BenchStrategy:
    """A benchmarked strategy.

    Attributes:
        name: the row label.
        stage: ZeRO stage of its model state and communication (0 for DDP); None where
            the formulas do not apply (pipeline).
        build: ``build(config, spec) -> Runner`` on every rank.
        requires: a module that must import for the strategy to run (None: torch and
            shardkit only).
        scale_only: run by ``benchmarks.scale`` but not in ``benchmarks.compare``'s
            default set. Default False.
        state_on_disk: its model state lives on disk, so the ZeRO formula does not
            bound its resident set (``benchmarks.scale`` starts its search at the top
            rung). Default False.
        compiled_from: the eager row this one compiles: the same strategy with each
            transformer block ``torch.compile``-d (inductor) before wrapping. Its first
            warm-up step compiles; the report gives the compile time apart and the
            speedup over that row. Not in ``benchmarks.compare``'s default set (the
            compile takes longer than a default run). None: an eager row.
    """

    name: str
    stage: int | None
    build: Builder
    requires: str | None = None
    scale_only: bool = False
    state_on_disk: bool = False
    compiled_from: str | None = None


def _registry_config(key: str, spec: Mapping[str, Any]) -> StrategyConfig:
    """The main job's options for strategy ``key`` (AdamW at the benchmarks' LR; the
    offload CPU tier: the disk tier is its own entry)."""
    return StrategyConfig(
        name=key,
        lr=ADAMW["lr"],
        chunks=spec.get("chunks", 4),
        schedule=spec.get("schedule", "1f1b"),
    )


def _from_registry(key: str, meta: bool = False, compiled: bool = False) -> Builder:
    """The main job's strategy ``key`` on ``GPT(config)``; with ``meta``, on a GPT built
    on the meta device that the strategy materialises (fsdp: unit by unit, so no rank
    holds the whole model; the initial values differ from ``GPT(config)``'s); with
    ``compiled``, each block compiled before the strategy wraps the model (the main
    job's ``--compile``)."""

    def build(config: GPTConfig, spec: Mapping[str, Any]) -> Runner:
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = GPT(config)
        if compiled:
            compile_blocks(model)
        strategy = MAIN_JOB[key](model, _registry_config(key, spec), torch.device("cpu"))
        count_ddp(strategy.module)
        opt = strategy.optimizer

        def step() -> None:
            strategy.before_step()
            strategy.step()
            opt.zero_grad(set_to_none=True)

        return Runner(
            strategy.module, step, lambda: opt.state, forward_backward_fn=strategy.forward_backward
        )

    build.__name__ = f"build_{key}{'_meta' if meta else ''}{'_compiled' if compiled else ''}"
    return build


def _plain_step(opt: torch.optim.Optimizer) -> Callable[[], None]:
    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _ddp_and(make_optimizer: Callable[[list[nn.Parameter]], Any]) -> Builder:
    """torch DDP with a sharded optimizer whose local optimizer is ``.optim`` (ZeRO-1)."""

    def build(config: GPTConfig, spec: Mapping[str, Any]) -> Runner:
        model = GPT(config)
        module = nn.parallel.DistributedDataParallel(model)
        count_ddp(module)
        opt = make_optimizer(list(model.parameters()))
        return Runner(module, _plain_step(opt), lambda: opt.optim.state)

    return build


def _torch_zero(params: list[nn.Parameter]) -> Any:
    """torch ``ZeroRedundancyOptimizer(AdamW)``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **ADAMW)


def _fairscale_oss(params: list[nn.Parameter]) -> Any:
    """FairScale ``OSS(AdamW)``. Not run where FairScale is not installed."""
    from fairscale.optim import OSS as FairScaleOSS

    return FairScaleOSS(params, optim=torch.optim.AdamW, **ADAMW)


def build_torch_fsdp2_runner(config: GPTConfig, spec: Mapping[str, Any]) -> Runner:
    """torch FSDP2: ``fully_shard`` per Block and the root (ZeRO-3); AdamW."""
    module = build_torch_fsdp2(GPT(config))
    opt = torch.optim.AdamW(module.parameters(), **ADAMW)
    return Runner(module, _plain_step(opt), lambda: opt.state)


def build_torch_fsdp2_compiled(config: GPTConfig, spec: Mapping[str, Any]) -> Runner:
    """torch FSDP2 with each Block compiled before ``fully_shard`` (torchtitan's order)."""
    model = GPT(config)
    compile_blocks(model)
    module = build_torch_fsdp2(model)
    opt = torch.optim.AdamW(module.parameters(), **ADAMW)
    return Runner(module, _plain_step(opt), lambda: opt.state)


SLICE_STATE_BYTES = 512 * MIB
"""Offload disk tier: the most model state (fp32 parameters, gradients and AdamW's two
moments, 16 bytes per parameter) one slice may hold, so that large models get more
slices and a step's resident set stays bounded."""


def offload_slices(gpt: nn.Module, stages: int) -> int:
    """Slices for ``gpt``: at least 4, at most ``stages`` (one per stage), enough that a
    slice's model state stays near :data:`SLICE_STATE_BYTES` (slices are balanced by
    parameter count)."""
    psi = sum(p.numel() for p in gpt.parameters())
    return min(stages, max(4, -(-16 * psi // SLICE_STATE_BYTES)))


def build_offload_disk(config: GPTConfig, spec: Mapping[str, Any]) -> Runner:
    """shardkit OffloadModel on the disk tier: the GPT built on ``meta`` and initialised
    slice by slice, so no rank ever holds the whole model; gradients averaged across
    ranks; ``sliced_optimizer`` steps each slice where it lives
    (:func:`offload_slices` slices)."""
    from shardkit.nn.offload import OffloadModel

    with torch.device("meta"):
        gpt = GPT(config)
    root = spec["offload_dir"]  # the harness creates and removes it
    offload = OffloadModel(
        gpt_stages(gpt),
        "cpu",
        offload_dir=f"{root}/rank{dist.get_rank()}",
        param_init_fn=gpt_init_fn,
        num_slices=offload_slices(gpt, config.n_layer + 2),
        checkpoint_activation=True,
        process_group=dist.group.WORLD,
    )
    opt = offload.sliced_optimizer(torch.optim.AdamW, **ADAMW)
    return Runner(OffloadGPT(offload), _plain_step(opt), lambda: opt.state)


def build_fairscale_sdp(config: GPTConfig, spec: Mapping[str, Any]) -> Runner:
    """FairScale ``ShardedDataParallel`` + ``OSS(AdamW)`` (ZeRO-2). Not run where not
    installed. ``zero_grad(set_to_none=False)``: FairScale's buckets lose gradients set
    to None (ANCHORS.md)."""
    from fairscale.nn.data_parallel import ShardedDataParallel as FairScaleSDP
    from fairscale.optim import OSS as FairScaleOSS

    model = GPT(config)
    opt = FairScaleOSS(model.parameters(), optim=torch.optim.AdamW, **ADAMW)
    module = FairScaleSDP(model, opt)

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=False)

    return Runner(module, step, lambda: opt.optim.state)


def deepspeed_on_cpu() -> None:
    """Prepare DeepSpeed to run on CPU ranks with the gloo group already initialised.

    - ``DS_ACCELERATOR=cpu`` unless set (before ``deepspeed`` is imported).
    - DeepSpeed's communication backend JIT-compiles a shared-memory all-reduce op
      (``deepspeed_shm_comm``, C++ with ninja: minutes on 2 cores, and a killed build
      leaves a lock file in ``~/.cache/torch_extensions`` that makes the next run wait
      forever). It is only used for inference all-reduce; marked incompatible here so
      that training goes through ``torch.distributed`` (and is counted).
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (a tensor, or a list / tuple / dict of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


# Where DeepSpeed's ZeRO optimizers keep gradients (stage 1/2: the reduced partition
# and its per-parameter views; stage 3: one flat buffer of every gradient partition)
# and the fp32 master copy of this rank's partition.
_DS_GRADIENTS = ("grads_in_partition", "averaged_gradients", "grad_partitions_flat_buffer")
_DS_MASTERS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")


def _ds_parameters(module: nn.Module) -> list[torch.Tensor]:
    """Every parameter's local tensor: ZeRO-3's partition (``ds_tensor``) and the
    full tensor where it is held (persistent small parameters)."""
    return [
        t for p in module.parameters() for t in (p, getattr(p, "ds_tensor", None)) if t is not None
    ]


def _unique_bytes(categories: Mapping[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes per category, each storage counted once, in the first category reaching it."""
    seen: set[tuple[str, int, int]] = set()
    return {name: _count_new(tensors, seen) for name, tensors in categories.items()}


def _deepspeed_state(engine: Any) -> tuple[Callable[[], dict[str, int]], Callable[[], Any]]:
    """``(module_state, optimizer_state)`` of a DeepSpeed engine for :class:`Runner`.

    Parameters: the module's tensors (ZeRO-3: with their partitions); gradients: the
    parameters' ``.grad`` and the ZeRO optimizer's gradient buffers; optimizer state:
    the inner optimizer's state plus the fp32 master partition, where that is a copy
    (ZeRO-1/2 copy it even in fp32; ZeRO-3 in fp32 steps the parameter partition).
    """
    opt = engine.optimizer
    module = engine.module

    def params() -> list[torch.Tensor]:
        return _ds_parameters(module)

    def module_state() -> dict[str, int]:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        grads += [t for name in _DS_GRADIENTS for t in _tensors(getattr(opt, name, None))]
        buffers = list(module.buffers())
        return _unique_bytes({"parameters": params(), "gradients": grads, "buffers": buffers})

    def optimizer_state() -> dict[Any, Any]:
        own = {t.untyped_storage().data_ptr() for t in params()}
        masters = [t for name in _DS_MASTERS for t in _tensors(getattr(opt, name, None))]
        extra = {
            f"fp32 master {i}": m
            for i, m in enumerate(masters)
            if m.untyped_storage().data_ptr() not in own
        }
        return {**opt.state, **extra}

    return module_state, optimizer_state


def _deepspeed(stage: int) -> Builder:
    def build(config: GPTConfig, spec: Mapping[str, Any]) -> Runner:
        """DeepSpeed ZeRO on CPU (gloo): fp32, torch AdamW as the client optimizer
        (DeepSpeed's own Adam JIT-compiles a C++ op), no gradient clipping (its
        default is 1.0). Needs the ``bench`` extra."""
        deepspeed_on_cpu()
        import deepspeed

        ds_config = {
            "train_micro_batch_size_per_gpu": spec["batch"],
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        model = GPT(config)
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=torch.optim.AdamW(model.parameters(), **ADAMW),
            config=ds_config,
        )
        module_state, optimizer_state = _deepspeed_state(engine)
        return Runner(engine, engine.step, optimizer_state, engine.backward, module_state)

    build.__name__ = f"build_deepspeed_zero{stage}"
    return build


def _main_job_rows() -> list[BenchStrategy]:
    """One row per strategy of the main job's registry (``ddp`` is "torch DDP"), and a
    scale-only "meta init" row where the spec's factory takes a GPT built on meta."""
    rows = []
    for spec in MAIN_JOB.values():
        name = "torch DDP" if spec.name == "ddp" else f"shardkit {spec.name}"
        rows.append(BenchStrategy(name, spec.zero_stage, _from_registry(spec.name)))
        if spec.meta_init == "optional":
            meta = _from_registry(spec.name, meta=True)
            rows.append(
                BenchStrategy(f"{name} (meta init)", spec.zero_stage, meta, scale_only=True)
            )
    return rows


_BASELINE, *_SHARDKIT = _main_job_rows()

STRATEGIES: list[BenchStrategy] = [
    _BASELINE,
    BenchStrategy("torch DDP + ZeroRedundancyOptimizer", 1, _ddp_and(_torch_zero)),
    BenchStrategy("torch FSDP2 fully_shard", 3, build_torch_fsdp2_runner),
    BenchStrategy("DeepSpeed ZeRO-1", 1, _deepspeed(1), requires="deepspeed"),
    BenchStrategy("DeepSpeed ZeRO-2", 2, _deepspeed(2), requires="deepspeed"),
    BenchStrategy("DeepSpeed ZeRO-3", 3, _deepspeed(3), requires="deepspeed"),
    BenchStrategy("FairScale OSS + DDP", 1, _ddp_and(_fairscale_oss), requires="fairscale"),
    BenchStrategy("FairScale ShardedDDP + OSS", 2, build_fairscale_sdp, requires="fairscale"),
    *_SHARDKIT,
    BenchStrategy("shardkit offload (disk)", 0, build_offload_disk, state_on_disk=True),
    *(
        BenchStrategy(f"{label} + compile", stage, build, compiled_from=eager)
        for label, eager, stage, build in (
            ("torch DDP", "torch DDP", 0, _from_registry("ddp", compiled=True)),
            ("torch FSDP2", "torch FSDP2 fully_shard", 3, build_torch_fsdp2_compiled),
            ("shardkit sdp", "shardkit sdp", 2, _from_registry("sdp", compiled=True)),
            ("shardkit fsdp", "shardkit fsdp", 3, _from_registry("fsdp", compiled=True)),
        )
    ),
]
"""Every strategy, in table order; the first is the baseline of the ratios."""

BY_NAME = {s.name: s for s in STRATEGIES}


def available(strategy: BenchStrategy) -> bool:
    """Whether the package the strategy needs imports here (always, for torch/shardkit)."""
    return strategy.requires is None or importlib.util.find_spec(strategy.requires) is not None
