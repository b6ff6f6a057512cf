"""Rank-side workers of the FSDP deferred-initialisation tests (meta device)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.models import GPT, gpt_unit_init_fn
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from tests.nn.data_parallel.fsdp_workers import (
    TINY,
    _raises,
    global_batch,
    local_part,
    mean_over_ranks,
    wrap_model,
)


def _train(model: nn.Module, steps: int, rank: int, world: int, split: bool) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, world)
        if split:
            x, y = local_part(x, rank), local_part(y, rank)
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        # split: the global batch's loss is the mean of the ranks' (equal-size) losses
        losses.append(mean_over_ranks(loss.item()) if split else loss.item())
    return losses


def meta_gpt_trains_like_plain(nesting: str) -> dict[str, Any]:
    """A GPT built on meta, wrapped with param_init_fn: sharded on every rank while
    wrapping (blocks are shards before the root's modules are initialised), then equal
    to a plain GPT loaded with its full state dict, step for step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # ranks disagree: rank 0's initialisation must win
    with torch.device("meta"):
        meta = GPT(TINY)
    seen_at_root: list[int] = []

    def init(module: nn.Module) -> None:
        if module is meta.wte:  # the root unit comes last: blocks are shards by then
            seen_at_root.extend(p.numel() for p in meta.blocks.parameters())
        gpt_unit_init_fn(module)

    model = wrap_model(meta, nesting, param_init_fn=init)
    full = model.state_dict()
    plain = GPT(TINY)
    plain.load_state_dict(full)
    local_elems = sum(p.numel() for p in model.parameters())
    ref = _train(plain, 3, rank, world, split=False)
    got = _train(model, 3, rank, world, split=True)
    return {
        "got": got,
        "ref": ref,
        "finite": all(torch.isfinite(t).all().item() for t in full.values()),
        "full_norm": sum(t.double().norm().item() for t in full.values()),
        "local_elems": local_elems,
        "total_elems": plain.num_parameters(),
        "block_elems_at_root_init": sum(seen_at_root),
        "block_full_elems": sum(p.numel() for p in plain.blocks.parameters()),
    }


class _Bare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def meta_defaults_and_errors() -> dict[str, Any]:
    """No param_init_fn: reset_parameters() of torch modules; errors otherwise."""
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    with torch.device("meta"):
        seq = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 2))
    model = FSDP(seq)
    full = model.state_dict()
    out["default_keys"] = sorted(full)
    out["default_ln_weight"] = full["1.weight"].tolist()  # reset_parameters: ones
    out["default_finite"] = all(torch.isfinite(t).all().item() for t in full.values())
    with torch.device("meta"):
        bare = _Bare()
    out["bare"] = _raises(lambda: FSDP(bare))
    with torch.device("meta"):
        lazy = nn.Sequential(nn.Linear(4, 4))
    out["lazy"] = _raises(lambda: FSDP(lazy, param_init_fn=lambda m: None))  # no materialising
    unit = FSDP(nn.Linear(2, 2))

    def nested() -> None:  # state_dict() summons: inside summon_full_params it must say so
        with unit.summon_full_params():
            unit.state_dict()

    out["nested"] = _raises(nested)
    return out
