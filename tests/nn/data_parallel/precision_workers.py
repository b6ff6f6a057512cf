"""Rank-side workers of the mixed-precision, loss-scaling, offload and checkpointing tests.

Every worker trains the tiny GPT of :mod:`fsdp_workers` on its rank's part of a global
batch and an fp32 unsharded reference on the whole batch, and returns plain data
(states, losses, dtypes seen, scales) for the test to check.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.nn.checkpoint import CheckpointWrapper, checkpoint_wrapper
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel.fully_sharded import reduction as fsdp_reduction
from shardkit.nn.data_parallel.fully_sharded import unit as fsdp_unit
from shardkit.nn.data_parallel.fully_sharded.unit import runtime_of
from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy
from shardkit.optim import OSS
from shardkit.optim.grad_scaler import ShardedGradScaler
from tests.nn.data_parallel.fsdp_workers import (
    global_batch,
    local_part,
    mean_over_ranks,
    tiny_gpt,
    wrap_model,
)

LR = 0.1
INIT_SCALE = 2.0**10


def sgd(params: Any) -> torch.optim.Optimizer:
    """SGD with momentum: updates proportional to the gradients (so parity tolerances
    measure gradient errors; Adam's normalised steps would hide them), fp32 state."""
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def checkpointed(model: nn.Module) -> nn.Module:
    """``model`` with every GPT block wrapped by :func:`checkpoint_wrapper` (in place)."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
    return model


def wrap_fsdp(model: nn.Module, cfg: dict[str, Any]) -> FSDP:
    """One unit per block (per checkpointed block with ``ckpt``) + the root."""
    kwargs = cfg.get("fsdp", {})
    if not cfg.get("ckpt"):
        return wrap_model(model, "block", **kwargs)
    checkpointed(model)
    with enable_wrap(wrapper_cls=FSDP, **kwargs):
        model = auto_wrap(model, transformer_auto_wrap_policy({CheckpointWrapper}))
    return FSDP(model, **kwargs)


@contextlib.contextmanager
def spy_collectives(seen: dict[str, set[str]]) -> Iterator[None]:
    """Record the dtypes FSDP all-gathers and reduce-scatters while inside."""
    gather, scatter = fsdp_unit.all_gather_flat, fsdp_reduction.reduce_scatter_flat

    def spy_gather(full: torch.Tensor, shard: torch.Tensor, *a: Any, **k: Any) -> Any:
        seen["all_gather"].add(str(full.dtype))
        return gather(full, shard, *a, **k)

    def spy_scatter(out: torch.Tensor, flat: torch.Tensor, *a: Any, **k: Any) -> Any:
        seen["reduce_scatter"].add(str(flat.dtype))
        return scatter(out, flat, *a, **k)

    fsdp_unit.all_gather_flat = spy_gather  # type: ignore[assignment]
    fsdp_reduction.reduce_scatter_flat = spy_scatter  # type: ignore[assignment]
    try:
        yield
    finally:
        fsdp_unit.all_gather_flat, fsdp_reduction.reduce_scatter_flat = gather, scatter


def watch_forward(module: nn.Module, seen: dict[str, set[str]]) -> None:
    """Record a Linear's weight and input dtypes (and devices) inside its forward."""

    def hook(mod: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        seen["forward_weight"].add(str(mod.weight.dtype))
        seen["forward_input"].add(str(args[0].dtype))
        seen["forward_output"].add(str(output.dtype))
        seen["forward_device"].add(str(mod.weight.device))

    module.register_forward_hook(hook)


def inject_inf(params: list[nn.Parameter]) -> None:
    """Put an inf into the first non-empty gradient of ``params`` (this rank only)."""
    for p in params:
        if p.grad is not None and p.grad.numel() > 0:
            p.grad.view(-1)[0] = float("inf")
            return
    raise AssertionError("no gradient to poison on this rank")


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    cfg: dict[str, Any],
    local: bool,
    after_backward: Callable[[int], None] = lambda step: None,
) -> dict[str, Any]:
    """``cfg["steps"]`` steps; returns per-step losses and scales, the final state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    autocast = cfg.get("autocast") if local else None
    out: dict[str, Any] = {"losses": [], "scales": []}
    for step in range(cfg.get("steps", 3)):
        x, y = global_batch(step, world)
        if local:
            x, y = local_part(x, rank), local_part(y, rank)
        ctx = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
        with ctx:
            _, loss = model(x, y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if step == cfg.get("inf_step") and (not local or rank == cfg.get("inf_rank", 1)):
            inject_inf(list(model.parameters()))
        after_backward(step)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
            out["scales"].append(scaler.get_scale())
        opt.zero_grad()
        value = float(loss.detach())
        out["losses"].append(mean_over_ranks(value) if local else value)
    return out


def reference(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fp32 unsharded model on the global batch (torch GradScaler when ``ref_scaler``)."""
    ref = tiny_gpt()
    opt = sgd(ref.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE) if cfg.get("ref_scaler") else None
    ref_cfg = {**cfg, "inf_step": cfg.get("inf_step") if cfg.get("ref_scaler") else None}
    result = train(ref, opt, scaler, ref_cfg, local=False)
    result["state"] = ref.state_dict()
    return result


def _dtypes(model: FSDP, opt: torch.optim.Optimizer) -> dict[str, Any]:
    units = model.units()
    return {
        "master": {str(runtime_of(u).handle.local_shard.dtype) for u in units},
        "shard_device": {str(runtime_of(u).handle.local_shard.device) for u in units},
        "param": {str(p.dtype) for p in model.parameters()},
        "param_device": {str(p.device) for p in model.parameters()},
        "pinned": any(runtime_of(u).handle.local_shard.is_pinned() for u in units),
        "optim_state": {
            str(v.dtype) for s in opt.state.values() for v in s.values() if v.dim() > 0
        },
        "sharded": {runtime_of(u).sharded_state.name for u in units},
    }


def fsdp_run(cfg: dict[str, Any]) -> dict[str, Any]:
    """FSDP (options ``cfg["fsdp"]``) vs the fp32 reference; dtypes and places seen."""
    model = wrap_fsdp(tiny_gpt(), cfg)
    opt = sgd(model.parameters())
    scaler = (
        ShardedGradScaler(init_scale=cfg.get("init_scale", INIT_SCALE))
        if cfg.get("scaler")
        else None
    )
    seen: dict[str, set[str]] = defaultdict(set)
    watch_forward(
        model.blocks[0].module.attn.qkv
        if not cfg.get("ckpt")
        else model.blocks[0].module.module.attn.qkv,
        seen,
    )
    between: list[dict[str, Any]] = []

    def after_backward(step: int) -> None:
        seen["grad"].update(str(p.grad.dtype) for p in model.parameters() if p.grad is not None)
        seen["grad_device"].update(
            str(p.grad.device) for p in model.parameters() if p.grad is not None
        )
        between.append(_dtypes(model, opt))

    with spy_collectives(seen):
        result = train(model, opt, scaler, cfg, local=True, after_backward=after_backward)
    result.update(state=model.state_dict(), seen=seen, between=between, after=_dtypes(model, opt))
    result["buffers"] = {n: str(b.dtype) for n, b in model.named_buffers()}
    return {"run": result, "ref": reference(cfg)}


def sdp_run(cfg: dict[str, Any]) -> dict[str, Any]:
    """OSS + ShardedDataParallel with torch.autocast (+ ShardedGradScaler) vs fp32."""
    model = tiny_gpt()
    if cfg.get("ckpt"):
        checkpointed(model)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=LR, momentum=0.9)
    module = ShardedDataParallel(model, opt)
    scaler = ShardedGradScaler(init_scale=INIT_SCALE) if cfg.get("scaler") else None
    seen: dict[str, set[str]] = defaultdict(set)
    watch_forward(
        model.blocks[0].attn.qkv if not cfg.get("ckpt") else model.blocks[0].module.attn.qkv, seen
    )
    result = train(module, opt, scaler, cfg, local=True)
    result["state"] = model.state_dict()
    result["seen"] = seen
    result["optim_state"] = {
        str(v.dtype) for s in opt.optim.state.values() for v in s.values() if v.dim() > 0
    }
    return {"run": result, "ref": reference(cfg)}


def grid(runs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Run ``(kind, cfg)`` pairs (``fsdp`` or ``sdp``) in one pool call."""
    return [{"fsdp": fsdp_run, "sdp": sdp_run}[kind](cfg) for kind, cfg in runs]


def activation_bytes(model: nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes of activations kept from forward for backward: the distinct storages autograd
    saves (parameters excluded) plus the inputs each checkpointed region keeps."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    kept = 0

    def count_inputs(mod: nn.Module, args: tuple[Any, ...]) -> None:
        nonlocal kept
        kept += sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))

    regions = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
    handles = [m.register_forward_pre_hook(count_inputs) for m in regions]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(*inputs)
    for handle in handles:
        handle.remove()
    loss.backward()
    return sum(storages.values()) + kept


def checkpoint_memory(kind: str) -> dict[str, int]:
    """Activation bytes of FSDP / ShardedDataParallel with and without checkpointed blocks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(0, world)
    x, y = local_part(x, rank), local_part(y, rank)
    out = {}
    for ckpt in (False, True):
        if kind == "fsdp":
            model: nn.Module = wrap_fsdp(tiny_gpt(), {"ckpt": ckpt})
        else:
            plain = checkpointed(tiny_gpt()) if ckpt else tiny_gpt()
            model = ShardedDataParallel(plain, OSS(plain.parameters(), lr=LR))
        out["checkpointed" if ckpt else "plain"] = activation_bytes(model, x, y)
    return out


def state_and_buffers() -> dict[str, Any]:
    """Under bf16: state dicts in fp32 (not rounded through bf16), a full fp32 state
    loads exactly, buffers in the buffer dtype while training and fp32 in state dicts."""
    model = wrap_fsdp(
        tiny_gpt(), {"fsdp": {"mixed_precision": True, "compute_dtype": torch.bfloat16}}
    )
    opt = sgd(model.parameters())
    train(model, opt, None, {"steps": 1}, local=True)
    state = model.state_dict()
    rounded = {k: bool((v.to(torch.bfloat16).float() != v).any()) for k, v in state.items()}
    target = tiny_gpt(seed=3).state_dict()
    model.load_state_dict(target)
    torch.manual_seed(0)
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    wrapped = FSDP(bn, mixed_precision=True, compute_dtype=torch.bfloat16)  # buffer dtype too
    wrapped(torch.randn(6, 4)).float().sum().backward()
    return {
        "dtypes": {k: str(v.dtype) for k, v in state.items()},
        "beyond_bf16": rounded,
        "loaded": model.state_dict(),
        "target": target,
        "local_master": {k: str(v.dtype) for k, v in model.local_state_dict().items()},
        "bn_live": {n: str(b.dtype) for n, b in wrapped.named_buffers()},
        "bn_state": {n: str(b.dtype) for n, b in wrapped.state_dict().items()},
        "bn_local": {n: str(b.dtype) for n, b in wrapped.local_state_dict().items()},
        "bn_weight_grad": str(next(wrapped.parameters()).grad.dtype),
    }
