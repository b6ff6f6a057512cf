"""Rank functions of the context-parallel tests (top level: pickled to each rank)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardkit.compose import PipelineSplit, parallelize_model
from shardkit.distributed.mesh import ParallelDims, ProcessMesh
from shardkit.models import GPT, GPTConfig, gpt_stages
from shardkit.nn.context_parallel import (
    DistributedAttention,
    combine_sequence,
    ring_attention,
    split_sequence,
    token_mean_loss,
)

B, H, D = 2, 4, 8


def _sdpa_shbd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """SDPA on DeepSpeed's ``(s, b, h, d)`` layout."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).permute(2, 0, 1, 3)


def _masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> Any:
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).permute(2, 0, 1, 3)


def _gather(t: torch.Tensor, group: dist.ProcessGroup, zigzag: bool, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return combine_sequence(parts, zigzag=zigzag, dim=dim)


def _full(seq: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seq)
    return [torch.randn(B, H, seq, D, generator=g).to(dtype) for _ in range(4)]  # q k v dout


def _one(cfg: dict[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    """Output and q/k/v gradients gathered over the group, their max abs difference from
    full-sequence SDPA in fp64 (same inputs), and single-process SDPA's own difference
    in ``cfg["dtype"]`` (the rounding the cp result is held to)."""
    method, causal, seq, dtype = cfg["method"], cfg["causal"], cfg["seq"], cfg["dtype"]
    q, k, v, dout = _full(seq, dtype)
    mask = None
    if cfg.get("mask"):  # a band mask over the whole sequence (Ulysses: any local attention)
        i = torch.arange(seq)
        mask = (i[:, None] - i[None, :]).abs() <= seq // 4
    want = _sdpa_grads([t.double() for t in (q, k, v)], dout.double(), causal, mask)
    plain = _sdpa_grads([q, k, v], dout, causal, mask)
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    zigzag = method == "ring" and causal
    local = [
        split_sequence(t, rank, cp, zigzag=zigzag, dim=2).detach().requires_grad_()
        for t in (q, k, v)
    ]
    if method == "ring":
        out = ring_attention(*local, group, causal=causal, query_tile=cfg.get("tile", 64))
        out.backward(split_sequence(dout, rank, cp, zigzag=zigzag, dim=2))
        got = [out, *(t.grad for t in local)]
    else:  # Ulysses on DeepSpeed's (s, b, h, d)
        if mask is None:
            attn = DistributedAttention(lambda a, b, c: _sdpa_shbd(a, b, c, causal), group)
            extra: tuple[Any, ...] = ()
        else:
            attn, extra = DistributedAttention(_masked_sdpa, group), (mask,)
        shbd = [t.permute(2, 0, 1, 3).detach().requires_grad_() for t in local]
        out = attn(*shbd, *extra)
        out.backward(split_sequence(dout, rank, cp, zigzag=False, dim=2).permute(2, 0, 1, 3))
        got = [t.permute(1, 2, 0, 3) for t in (out, *(t.grad for t in shbd))]  # type: ignore[union-attr]
    assert all(t is not None and t.dtype == dtype for t in got)
    full = [_gather(t, group, zigzag, 2).double() for t in got]  # type: ignore[arg-type]
    names = ("out", "dq", "dk", "dv")
    return {
        "err": {n: (a - b).abs().max().item() for n, a, b in zip(names, full, want, strict=True)},
        "plain_err": {
            n: (a.double() - b).abs().max().item()
            for n, a, b in zip(names, plain, want, strict=True)
        },
        "out": full[0],
    }


def _sdpa_grads(
    qkv: list[torch.Tensor], dout: torch.Tensor, causal: bool, mask: torch.Tensor | None
) -> list[torch.Tensor]:
    """Full-sequence single-process SDPA: output and q/k/v gradients."""
    leaves = [t.detach().requires_grad_() for t in qkv]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=causal)
    out.backward(dout)
    return [out.detach(), *(t.grad for t in leaves)]  # type: ignore[misc]


def run_attention_parity(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every config on every rank; each: ``{"cp", "method", "causal", "seq", "dtype"}``."""
    world = dist.get_world_size()
    meshes: dict[int, ProcessMesh] = {}
    results = []
    for cfg in configs:
        cp = cfg["cp"]
        if cp not in meshes:
            meshes[cp] = ProcessMesh(ParallelDims(world_size=world, cp=cp))
        group = meshes[cp].group("cp")
        results.append({**cfg, **_one(cfg, group), "ranks": meshes[cp].ranks("cp")})
    for mesh in meshes.values():
        mesh.destroy()
    return results


def _raises(fn: Any, match: str) -> str:
    with pytest.raises(ValueError, match=match) as err:
        fn()
    return str(err.value)


def run_bad_inputs() -> list[str]:
    """Each bad input raises on every rank before (or symmetrically after) any exchange,
    so no rank is left waiting in a collective; returns the messages."""
    world = dist.get_world_size()
    mesh = ProcessMesh(ParallelDims(world_size=world, cp=2))
    group = mesh.group("cp")
    x = torch.randn(4, B, 3, D)  # (s/P, b, h=3, d): 3 heads over 2 ranks
    messages = [
        _raises(
            lambda: DistributedAttention(_masked_sdpa, group)(x, x, x),
            r"query has 3 heads \(dimension 2\), not divisible by the 2 ranks",
        )
    ]
    y = torch.randn(4, B, 4, D)

    def shrinking(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _sdpa_shbd(q, k, v, False)[:-1]

    messages.append(
        _raises(
            lambda: DistributedAttention(shrinking, group)(y, y, y),
            "local_attention returned sequence length 7 .* for an input of 8",
        )
    )
    odd = torch.randn(B, H, 3, D)
    messages.append(_raises(lambda: ring_attention(odd, odd, odd, group, causal=True), "got 3"))
    # the same tensors work once the problem is fixed (nothing left half-exchanged)
    ok = ring_attention(odd, odd, odd, group, causal=False)
    assert ok.shape == odd.shape
    mesh.destroy()
    # compose: context parallelism does not compose with a pipeline (refused, no group made)
    piped = ProcessMesh(ParallelDims(world_size=world, pp=2, cp=2))
    split = PipelineSplit(gpt_stages, lambda out, y: out.sum())
    model = GPT(GPTConfig(n_layer=2))
    messages.append(
        _raises(
            lambda: parallelize_model(model, piped, pipeline=split, data_parallel="ddp"),
            r"a pipeline with cp 2 \(pp 2 x dp_replicate 1 x dp_shard 1 x cp 2 x tp 1\)",
        )
    )
    return messages


def run_token_mean_loss() -> dict[str, float]:
    """``token_mean_loss`` over 4 ranks holding different numbers of counted tokens
    (ignored labels) against single-process cross entropy over the whole batch: the
    global loss, and each rank's logits gradient averaged over the ranks (as DDP does)
    against its slice of the reference gradient."""
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 8 * world, 11, generator=g)
    targets = torch.randint(0, 11, (2, 8 * world), generator=g)
    targets[:, : 8 * world // 2 + 3] = -100  # the first ranks count fewer tokens
    ref = logits.clone().requires_grad_()
    want = F.cross_entropy(ref.reshape(-1, 11), targets.reshape(-1), ignore_index=-100)
    want.backward()
    local = split_sequence(logits, rank, world, zigzag=False).requires_grad_()
    loss, global_loss = token_mean_loss(
        local, split_sequence(targets, rank, world, zigzag=False), None
    )
    loss.backward()
    assert local.grad is not None and ref.grad is not None
    grad = local.grad / world  # the data-parallel average
    want_grad = split_sequence(ref.grad, rank, world, zigzag=False)
    return {
        "loss": abs(global_loss.item() - want.item()),
        "grad": (grad - want_grad).abs().max().item(),
    }
