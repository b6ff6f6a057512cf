"""The rows of the table: the strategies run on two nodes, and each one's link-byte
formula (a :func:`benchmarks.two_nodes.report.bytes_formula` kind)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

from benchmarks.two_nodes.netem import NNODES, NPROC_PER_NODE

if TYPE_CHECKING:
    from benchmarks.runners import BenchStrategy

__all__ = ["LINK_FORMULA", "STRATEGY_NAMES", "strategies", "unavailable_reason"]


# ------------------------------------------------------------------------- strategies
def _fsdp2_hsdp(config: Any, spec: Mapping[str, Any]) -> Any:
    """torch FSDP2 ``fully_shard`` on a 2-D DeviceMesh (replicate x shard = HSDP):
    every Block, then the root; AdamW."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from benchmarks.common import ADAMW
    from benchmarks.runners import Runner
    from shardkit.models import GPT

    mesh = init_device_mesh("cpu", (NNODES, NPROC_PER_NODE), mesh_dim_names=("replicate", "shard"))
    model = GPT(config)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    module = cast(nn.Module, fully_shard(model, mesh=mesh))
    opt = torch.optim.AdamW(module.parameters(), **ADAMW)

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Runner(module, step, lambda: opt.state)


def _hsdp_compressed(compression: str) -> Callable[[Any, Mapping[str, Any]], Any]:
    """shardkit FSDP hybrid (one unit per Block + the root, shard groups of one node)
    with ``grad_compression=compression`` on the cross-replica all-reduce; AdamW."""

    def build(config: Any, spec: Mapping[str, Any]) -> Any:
        import torch

        from benchmarks.common import ADAMW
        from benchmarks.runners import Runner
        from shardkit.distributed.hybrid import hybrid_groups
        from shardkit.models import GPT, Block
        from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
        from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy

        groups = hybrid_groups(NPROC_PER_NODE)
        kwargs: dict[str, Any] = {
            "sharding_strategy": "HYBRID_SHARD",
            "process_group": (groups.shard, groups.replicate),
            "grad_compression": compression,
        }
        with enable_wrap(wrapper_cls=FSDP, **kwargs):
            wrapped = auto_wrap(GPT(config), transformer_auto_wrap_policy({Block}))
        module = FSDP(wrapped, **kwargs)
        opt = torch.optim.AdamW(module.parameters(), **ADAMW)

        def step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        return Runner(module, step, lambda: opt.state)

    return build


def _deepspeed_hpz(config: Any, spec: Mapping[str, Any]) -> Any:
    """DeepSpeed ZeRO-3 with ZeRO++ hpZ (secondary partition of one node) and qgZ
    (quantized gradients), fp32, on CPU. Needs the ``bench`` extra; its quantization
    kernels may need CUDA (the row then says why)."""
    import torch

    from benchmarks.common import ADAMW
    from benchmarks.runners import Runner, deepspeed_on_cpu
    from shardkit.models import GPT

    deepspeed_on_cpu()
    import deepspeed  # type: ignore[import-not-found]

    ds_config = {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": 3,
            "zero_hpz_partition_size": NPROC_PER_NODE,
            "zero_quantized_gradients": True,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }
    model = GPT(config)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), **ADAMW), config=ds_config
    )
    return Runner(engine, engine.step, lambda: engine.optimizer.state, engine.backward)


def _fsdp_has_grad_compression() -> bool:
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP

    return "grad_compression" in inspect.signature(FSDP.__init__).parameters


STRATEGY_NAMES = (
    "torch DDP",
    "torch FSDP2 HSDP (2-D mesh)",
    "DeepSpeed ZeRO-3 hpZ + qgZ",
    "shardkit fsdp",
    "shardkit hsdp",
    "shardkit hsdp + bf16",
    "shardkit hsdp + PowerSGD",
)
"""Every row, in table order; torch DDP (the first) is the baseline of the ratios."""

LINK_FORMULA: dict[str, str | None] = {
    "torch DDP": "ddp",
    "torch FSDP2 HSDP (2-D mesh)": "hybrid",
    "DeepSpeed ZeRO-3 hpZ + qgZ": None,
    "shardkit fsdp": "full_shard",
    "shardkit hsdp": "hybrid",
    "shardkit hsdp + bf16": "hybrid_half",
    "shardkit hsdp + PowerSGD": None,
}
"""Each row's :func:`benchmarks.two_nodes.report.bytes_formula` kind (None: no formula;
PowerSGD's bytes depend on the shard shapes, DeepSpeed's qgZ on its quantization)."""


def strategies() -> dict[str, BenchStrategy]:
    """The rows of :data:`STRATEGY_NAMES`, in :mod:`benchmarks.runners`' one registry
    type: the entries of :data:`benchmarks.runners.BY_NAME` where the compare harness has
    the row too (torch DDP, shardkit fsdp, shardkit hsdp: the main job's strategies), and
    the two-node-only builders (a 2-D mesh or shard groups of one node, which the
    single-node harness has no use for) as :class:`~benchmarks.runners.BenchStrategy`
    entries of the same kind. Imports torch (lazily: ``--help`` and ``--dry-run`` do
    not)."""
    from benchmarks.runners import BY_NAME, BenchStrategy

    hsdp = BY_NAME["shardkit hsdp"]
    own = [
        BenchStrategy("torch FSDP2 HSDP (2-D mesh)", hsdp.stage, _fsdp2_hsdp),
        BenchStrategy("DeepSpeed ZeRO-3 hpZ + qgZ", 3, _deepspeed_hpz, requires="deepspeed"),
        BenchStrategy("shardkit hsdp + bf16", hsdp.stage, _hsdp_compressed("bf16")),
        BenchStrategy("shardkit hsdp + PowerSGD", hsdp.stage, _hsdp_compressed("powersgd")),
    ]
    rows = {**BY_NAME, **{row.name: row for row in own}}
    return {name: rows[name] for name in STRATEGY_NAMES}


def unavailable_reason(row: BenchStrategy) -> str | None:
    """Why ``row`` cannot run here (None: it can): a package not installed, or shardkit
    FSDP without ``grad_compression=`` for the compressed rows."""
    from benchmarks.runners import available

    if not available(row):
        return f"not installed ({row.requires})"
    if "+" in row.name and row.name.startswith("shardkit") and not _fsdp_has_grad_compression():
        return "not available: FullyShardedDataParallel has no grad_compression= here"
    return None
