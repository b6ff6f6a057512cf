"""Rank-side workers of the FSDP tests (top level: pickled to spawned ranks)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.nn.wrap import (
    auto_wrap,
    enable_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from shardkit.testing.models import GPT, Block, GPTConfig

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
LOCAL_BATCH = 2
SEQ = 8


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


def wrap_model(model: nn.Module, nesting: str, **kwargs: Any) -> FSDP:
    """``flat`` (one unit), ``size`` (auto_wrap by size) or ``block`` (by Block class)."""
    if nesting == "size":
        policy = size_based_auto_wrap_policy(1000)
    elif nesting == "block":
        policy = transformer_auto_wrap_policy({Block})
    else:
        return FSDP(model, **kwargs)
    with enable_wrap(wrapper_cls=FSDP, **kwargs):
        model = auto_wrap(model, policy)
    return model if isinstance(model, FSDP) else FSDP(model, **kwargs)


def global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, TINY.vocab_size, (LOCAL_BATCH * world, SEQ), generator=g)
    y = torch.randint(0, TINY.vocab_size, (LOCAL_BATCH * world, SEQ), generator=g)
    return x, y


def local_part(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]


def no_decay(name: str) -> bool:
    return name.endswith("bias") or ".ln_" in name or name.startswith("ln_")


def make_optim(named: list[tuple[str, nn.Parameter]], groups: bool) -> torch.optim.Optimizer:
    if not groups:
        return torch.optim.AdamW([p for _, p in named], lr=1e-3, weight_decay=0.1)
    decay = [p for n, p in named if not no_decay(n)]
    plain = [p for n, p in named if no_decay(n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}], lr=1e-3
    )


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _step_fsdp(model: FSDP, x: torch.Tensor, y: torch.Tensor, cfg: dict[str, Any]) -> float:
    micro = cfg.get("micro", 1)
    total = 0.0
    for m in range(micro):
        xs, ys = x.chunk(micro)[m], y.chunk(micro)[m]
        last = m == micro - 1
        ctx = model.no_sync() if cfg.get("no_sync") and not last else _null()
        with ctx:
            if cfg.get("two_forwards"):
                _, l1 = model(xs[:1], ys[:1])
                _, l2 = model(xs[1:], ys[1:])
                loss = (l1 + l2) / 2
            else:
                _, loss = model(xs, ys)
            (loss / micro).backward()
        total += loss.item() / micro
    return total


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def train_parity(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train the tiny GPT with FSDP (local batch) and unwrapped (global batch).

    Returns the per-step losses of both, the full state dicts, clip norms and names.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = tiny_gpt()
    model = copy.deepcopy(ref)
    if cfg.get("frozen"):
        for m in (ref, model):
            m.blocks[0].ln_1.weight.requires_grad_(False)
            m.wpe.weight.requires_grad_(False)
    model = wrap_model(model, cfg["nesting"], reshard_after_forward=cfg.get("raf", True))
    names = [n for n, _ in model.named_parameters()]
    opt = make_optim(list(model.named_parameters()), cfg.get("groups", False))
    ref_opt = make_optim(list(ref.named_parameters()), cfg.get("groups", False))
    out: dict[str, Any] = {"losses": [], "ref_losses": [], "norms": [], "ref_norms": []}
    for step in range(cfg.get("steps", 2)):
        x, y = global_batch(step, world)
        loss = _step_fsdp(model, local_part(x, rank), local_part(y, rank), cfg)
        _, ref_loss = ref(x, y)
        ref_loss.backward()
        if cfg.get("clip"):
            out["norms"].append(float(model.clip_grad_norm_(0.05)))
            out["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        out["losses"].append(mean_over_ranks(loss))
        out["ref_losses"].append(ref_loss.item())
    out["state"] = model.state_dict()
    out["ref_state"] = ref.state_dict()
    out["names"] = names
    out["ref_names"] = [n for n, _ in ref.named_parameters()]
    return out


def parity_grid(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [train_parity(cfg) for cfg in configs]


def run_all(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run several zero-argument workers in one pool call (saves a round trip each)."""
    return [fn() for fn in fns]


partial = functools.partial


def frozen_state_check() -> dict[str, Any]:
    """A frozen parameter inside a unit gets no gradient and no optimizer state."""
    model = tiny_gpt()
    model.blocks[0].ln_1.weight.requires_grad_(False)
    model = wrap_model(model, "block")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = global_batch(0, 1)
    model(x, y)[1].backward()
    opt.step()
    frozen = dict(model.named_parameters())["blocks.0.ln_1.weight"]
    return {"grad": frozen.grad is None, "state": frozen not in opt.state}
