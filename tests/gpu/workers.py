"""Rank-side workers of the CUDA tests (top level: pickled to spawned NCCL ranks).

Each worker builds the wrapped model and the plain reference on the rank's GPU from the
same seed, trains both on the same global batch (the wrapped one on this rank's part,
DDP semantics), and returns plain numbers on the CPU for the test to check.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.models import GPT, Block, GPTConfig
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.nn import ShardedDataParallel
from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy
from shardkit.optim import OSS, register_reduce_to_owner_hook
from shardkit.optim.grad_scaler import ShardedGradScaler

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
LOCAL_BATCH = 2
SEQ = 8
STEPS = 3
SGD = {"lr": 0.05, "momentum": 0.9}


def _device() -> torch.device:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity, not TF32's 10-bit mantissa
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", torch.cuda.current_device())


def _rank_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _tokens(step: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same on every rank, drawn on the CPU."""
    g = torch.Generator().manual_seed(1000 + step)
    shape = (LOCAL_BATCH * world, SEQ)
    x = torch.randint(0, TINY.vocab_size, shape, generator=g)
    y = torch.randint(0, TINY.vocab_size, shape, generator=g)
    return x.to(device), y.to(device)


def _features(step: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(LOCAL_BATCH * world, 8, generator=g)
    y = torch.randn(LOCAL_BATCH * world, 4, generator=g)
    return x.to(device), y.to(device)


def _local(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Linear(32, 4))


def _max_diff(state: dict[str, torch.Tensor], reference: nn.Module) -> tuple[float, list[str]]:
    """Largest difference over the reference's parameters, and the names ``state`` lacks."""
    missing, worst = [], 0.0
    for name, ref in reference.named_parameters():
        if name not in state:
            missing.append(name)
            continue
        diff = (state[name].detach().float().cpu() - ref.detach().float().cpu()).abs().max()
        worst = max(worst, float(diff))
    return worst, missing


def _sgd_step(model: nn.Module, opt: Any, loss: torch.Tensor) -> float:
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


# NCCL itself -------------------------------------------------------------------------
def nccl_collectives() -> dict[str, Any]:
    """The collectives the wrappers use, on CUDA tensors, in fp32, fp16 and bf16,
    synchronous and asynchronous; returns what each produced against the expected."""
    dev = _device()
    rank, world = _rank_world()
    failures = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for async_op in (False, True):
            label = f"{dtype} async={async_op}"
            shard = torch.full((4,), float(rank + 1), dtype=dtype, device=dev)
            full = torch.empty(4 * world, dtype=dtype, device=dev)
            work = dist.all_gather_into_tensor(full, shard, async_op=async_op)
            if async_op:
                work.wait()
            expected = torch.arange(1, world + 1, dtype=dtype, device=dev).repeat_interleave(4)
            if not torch.equal(full, expected):
                failures.append(f"all-gather {label}")
            out = torch.empty(4, dtype=dtype, device=dev)
            work = dist.reduce_scatter_tensor(out, full, async_op=async_op)
            if async_op:
                work.wait()
            if not torch.equal(out, torch.full_like(out, float(world * (rank + 1)))):
                failures.append(f"reduce-scatter {label}")
            total = torch.full((3,), float(rank + 1), dtype=dtype, device=dev)
            dist.all_reduce(total)
            if not torch.equal(total, torch.full_like(total, world * (world + 1) / 2)):
                failures.append(f"all-reduce {label}")
            value = torch.full((3,), float(rank), dtype=dtype, device=dev)
            dist.broadcast(value, src=0)
            if not torch.equal(value, torch.zeros_like(value)):
                failures.append(f"broadcast {label}")
    torch.cuda.synchronize()
    return {
        "backend": dist.get_backend(),
        "device": str(dev),
        "device_index": dev.index,
        "failures": failures,
    }


# ZeRO-1 and ZeRO-2 ---------------------------------------------------------------------
def oss_parity(mode: str) -> dict[str, Any]:
    """``mode``: ``"ddp"`` (torch DDP + OSS), ``"hook"`` (DDP with OSS's reduce-to-owner
    hook) or ``"sdp"`` (ShardedDataParallel + OSS). SGD with momentum, 3 steps."""
    dev = _device()
    rank, world = _rank_world()
    model, reference = _mlp().to(dev), _mlp().to(dev)
    if mode == "sdp":
        opt = OSS(model.parameters(), optim=torch.optim.SGD, **SGD)
        wrapped: nn.Module = ShardedDataParallel(model, opt)
    else:
        wrapped = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
        opt = OSS(wrapped.parameters(), optim=torch.optim.SGD, **SGD)
        if mode == "hook":
            register_reduce_to_owner_hook(wrapped, opt)
    ref_opt = torch.optim.SGD(reference.parameters(), **SGD)
    losses, ref_losses = [], []
    for step in range(STEPS):
        x, y = _features(step, world, dev)
        loss = nn.functional.mse_loss(wrapped(_local(x, rank)), _local(y, rank))
        losses.append(_sgd_step(wrapped, opt, loss))
        ref_losses.append(_sgd_step(reference, ref_opt, nn.functional.mse_loss(reference(x), y)))
    worst, missing = _max_diff(dict(model.named_parameters()), reference)
    on_cuda = all(p.device.type == "cuda" for p in model.parameters())
    return {"max_diff": worst, "missing": missing, "on_cuda": on_cuda, "losses": losses}


# ZeRO-3 --------------------------------------------------------------------------------
def _wrap_fsdp(model: nn.Module, nesting: str, **kwargs: Any) -> FSDP:
    if nesting == "flat":
        return FSDP(model, **kwargs)
    with enable_wrap(wrapper_cls=FSDP, **kwargs):
        model = auto_wrap(model, transformer_auto_wrap_policy({Block}))
    return model if isinstance(model, FSDP) else FSDP(model, **kwargs)


def _fsdp_step(model: FSDP, opt: Any, x: torch.Tensor, y: torch.Tensor, micro: int) -> float:
    """One step over ``micro`` micro-batches, communication only on the last (no_sync)."""
    opt.zero_grad()
    total = 0.0
    for m, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
        last = m == micro - 1
        with contextlib.nullcontext() if last else model.no_sync():
            _, loss = model(xm, targets=ym)
            (loss / micro).backward()
        total += float(loss.detach()) / micro
    opt.step()
    return total


def fsdp_parity(cfg: dict[str, Any]) -> dict[str, Any]:
    """FSDP on CUDA against the plain GPT: ``cfg`` holds ``nesting`` (``flat`` or
    ``block``), FSDP keyword arguments under ``fsdp``, and ``micro`` (gradient
    accumulation under ``no_sync``). With ``move_params_to_cpu`` the model is built on
    the CPU and FSDP computes on this rank's GPU."""
    dev = _device()
    rank, world = _rank_world()
    options = dict(cfg.get("fsdp", {}))
    offload = options.get("move_params_to_cpu", False)
    torch.manual_seed(0)
    model = GPT(TINY)
    reference = copy.deepcopy(model).to(dev)
    fsdp = _wrap_fsdp(model if offload else model.to(dev), cfg["nesting"], **options)
    params = list(fsdp.parameters())
    opt = torch.optim.SGD(params, **SGD)
    ref_opt = torch.optim.SGD(reference.parameters(), **SGD)
    losses, ref_losses = [], []
    for step in range(STEPS):
        x, y = _tokens(step, world, dev)
        losses.append(_fsdp_step(fsdp, opt, _local(x, rank), _local(y, rank), cfg.get("micro", 1)))
        _, ref_loss = reference(x, targets=y)
        ref_losses.append(_sgd_step(reference, ref_opt, ref_loss))
    torch.cuda.synchronize()
    state = fsdp.state_dict()  # a collective: every rank
    worst, missing = _max_diff(state, reference)
    held = [p for p in params if p.numel()]
    return {
        "max_diff": worst,
        "missing": missing,
        "losses": losses,
        "ref_losses": ref_losses,
        "param_devices": sorted({p.device.type for p in held}),
        "all_pinned": all(p.is_pinned() for p in held),
        "output_device": _output_device(fsdp, dev),
    }


def _output_device(model: FSDP, dev: torch.device) -> str:
    with torch.no_grad():
        logits, _ = model(_tokens(0, 1, dev)[0][:1])
    return str(logits.device)


# loss scaling --------------------------------------------------------------------------
def scaler_parity(inject_inf_at: int | None) -> dict[str, Any]:
    """fp16 autocast on CUDA: ShardedGradScaler against torch's GradScaler on the same
    model and data (no data parallelism), optionally with an inf in rank 0's gradient."""
    dev = _device()
    rank, _ = _rank_world()
    runs: dict[str, Any] = {}
    for kind in ("sharded", "torch"):
        torch.manual_seed(0)
        model = nn.Linear(4, 3).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if kind == "sharded":
            scaler: torch.amp.GradScaler = ShardedGradScaler(init_scale=1024.0)
        else:
            scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
        scale_device = str(scaler.scale(torch.ones((), device=dev)).device)
        weights, scales = [], []
        for step in range(4):
            opt.zero_grad()
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step)).to(dev)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            if step == inject_inf_at and rank == 0 and kind == "sharded":
                assert model.weight.grad is not None
                model.weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            weights.append(model.weight.detach().cpu().clone())
            scales.append(scaler.get_scale())
        runs[kind] = {"weights": weights, "scales": scales, "scale_device": scale_device}
    return runs


def fsdp_fp16_with_scaler() -> dict[str, Any]:
    """FSDP in fp16 with ShardedGradScaler on CUDA: 3 clean steps, then an inf in rank
    0's gradient that every rank must skip; the fp32 reference's losses for comparison."""
    dev = _device()
    rank, world = _rank_world()
    torch.manual_seed(0)
    model = GPT(TINY).to(dev)
    reference = copy.deepcopy(model)
    fsdp = _wrap_fsdp(model, "block", mixed_precision=True, compute_dtype=torch.float16)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    scaler = ShardedGradScaler(init_scale=1024.0)
    losses, ref_losses, scales, changed = [], [], [], []
    for step in range(STEPS + 1):
        x, y = _tokens(step, world, dev)
        opt.zero_grad()
        _, loss = fsdp(_local(x, rank), targets=_local(y, rank))
        scaler.scale(loss).backward()
        if step == STEPS and rank == 0:  # poison one gradient element on rank 0 only
            grads = [p.grad for p in fsdp.parameters() if p.grad is not None and p.numel()]
            grads[0].view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in fsdp.parameters()]
        scaler.step(opt)
        scaler.update()
        after = list(fsdp.parameters())
        changed.append(any(not torch.equal(a, b) for a, b in zip(after, before, strict=True)))
        losses.append(float(loss.detach()))
        scales.append(scaler.get_scale())
        if step < STEPS:
            _, ref_loss = reference(x, targets=y)
            ref_losses.append(_sgd_step(reference, ref_opt, ref_loss))
    return {"losses": losses, "ref_losses": ref_losses, "scales": scales, "changed": changed}
