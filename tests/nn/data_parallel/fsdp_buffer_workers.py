"""Rank-side workers of test_fsdp_buffers (issue 20): the units' reused full buffers."""

from __future__ import annotations

import copy
import gc
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.memory import buffer_pools, heap_trims, reset_buffer_peaks, set_heap_trim
from shardkit.models import GPT, GPTConfig
from shardkit.nn.data_parallel.fully_sharded.unit import runtime_of
from shardkit.nn.data_parallel.fully_sharded.unit_buffers import GRADIENTS, PARAMETERS
from tests.nn.data_parallel.fsdp_workers import wrap_model

SIX = GPTConfig(vocab_size=32, block_size=8, n_layer=6, n_head=2, n_embd=16)


def pool_bound() -> dict[str, Any]:
    """A 6-block GPT, one unit per block + the root, default options (prefetch on):
    the pools' peaks over 3 AdamW steps, and the sizes of the units' buffers."""
    gc.collect()  # units of earlier tests in this (shared) rank process go away
    before = buffer_pools()
    torch.manual_seed(0)
    model = wrap_model(GPT(SIX), "block", bucket_cap_mb=1e-6)  # one reduction in flight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, SIX.vocab_size, (2, SIX.block_size), generator=g)
    reset_buffer_peaks()
    for _ in range(3):
        model(x, targets=x)[1].backward()
        opt.step()
        opt.zero_grad()
    pools = buffer_pools()
    units = [runtime_of(u) for u in model.units()]
    return {
        "params": pools[PARAMETERS],
        "grads": pools[GRADIENTS],
        "before": {k: before[k] for k in (PARAMETERS, GRADIENTS) if k in before},
        "unit_bytes": [4 * u.handle.layout.padded for u in units if u is not None],
    }


class _SavesTranspose(nn.Module):
    """``x @ w.t() + b``: autograd saves the view ``w.t()`` of the full parameter."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.bias = nn.Parameter(torch.randn(width) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.addmm(self.bias, x, self.weight.t()))


def _resident() -> int:
    """Resident FSDP unit buffers on this rank (parameters and gradients)."""
    pools = buffer_pools()
    return sum(pools[k].resident for k in (PARAMETERS, GRADIENTS) if k in pools)


def _chain(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(_SavesTranspose(width) for _ in range(depth)))


def saved_views_parity(cfg: dict[str, Any]) -> dict[str, Any]:
    """Each layer its own unit (+ an empty root): per step, an eval forward with grad
    enabled and no backward, then two training forwards whose graphs are both alive
    while every unit reshards between them, one backward of their sum, an SGD step.
    The same on the plain model with the global batch; the largest parameter
    difference after every step."""
    from shardkit.nn import FullyShardedDataParallel as FSDP

    width, depth, world, rank = 24, 4, dist.get_world_size(), dist.get_rank()
    gc.collect()
    # earlier tests' models may live on in this (shared) rank process, a few resident
    resident_before = _resident()
    plain = _chain(width, depth)
    layers = [FSDP(copy.deepcopy(m), **cfg) for m in plain[:-1]]
    model = FSDP(nn.Sequential(*layers, copy.deepcopy(plain[-1])), **cfg)  # root: the last
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.2)
    diffs = []
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        xs = [torch.randn(2 * world, width, generator=g) for _ in range(3)]
        model(xs[2][rank::world]).sum()  # a forward whose backward never runs
        loss = model(xs[0][rank::world]).square().mean() + model(xs[1][rank::world]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref = sum(
            plain(xs[0][r::world]).square().mean() + plain(xs[1][r::world]).mean()
            for r in range(world)
        )
        (ref / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        full = model.state_dict()
        diffs.append(
            max(
                (full[name] - value).abs().max().item()
                for name, value in plain.state_dict().items()
            )
        )
    resident = _resident() - resident_before  # one rank: the shards are full, no buffers
    return {"diffs": diffs, "resident": resident}


def saved_views_grid(cfgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [saved_views_parity(cfg) for cfg in cfgs]


def trim_points() -> dict[str, Any]:
    """The 6-block GPT: one forward + backward per heap-trim mode (same weights and
    batch): trim points reached and ``malloc_trim`` calls per step, and
    whether the gradients are the same."""
    torch.manual_seed(0)
    model = wrap_model(GPT(SIX), "block")
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, SIX.vocab_size, (2, SIX.block_size), generator=g)
    model(x, targets=x)[1].backward()  # lazy init reshards once more
    model.zero_grad()
    counts, grads = [], []
    for mode in ("off", "unit", "step"):
        every = None if mode == "off" else 1  # "step": a trim every step, not 1 in 8
        previous = set_heap_trim(mode, every=every)
        before = heap_trims()
        try:
            model(x, targets=x)[1].backward()
        finally:
            set_heap_trim(previous)
        after = heap_trims()
        counts.append((after.points - before.points, after.trimmed - before.trimmed))
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    previous = set_heap_trim("step", every=1)
    before = heap_trims()
    try:
        with torch.no_grad():
            for _ in range(3):
                model(x, targets=x)  # evaluation: not a training step
    finally:
        set_heap_trim(previous)
    return {
        "counts": counts,
        "eval_trims": heap_trims().trimmed - before.trimmed,
        "available": heap_trims().available,
        "same_grads": all(
            torch.equal(first, other) for g in grads[1:] for first, other in zip(grads[0], g)
        ),
    }
