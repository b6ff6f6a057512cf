"""Rank functions for expert parallelism with a different number of tokens on each rank
of the ep group: each returns errors against the same layer run in one process on
every rank's tokens (FairScale's ``MOELayer`` and the general ``MoE``)."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.mesh import ParallelDims, ProcessMesh
from shardkit.nn.moe import MoE, MOELayer, Top2Gate

M, F_HIDDEN = 6, 10
GROUP_TIMEOUT = timedelta(seconds=30)  # a hang (mismatched buffers) fails, not waits


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _grads(module: nn.Module) -> list[torch.Tensor]:
    """Every parameter's gradient, zeros for one that got none."""
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in module.parameters()]


def _inputs(rank: int, count: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``count`` tokens shaped ``shape + (M,)``, and loss weights."""
    g = torch.Generator().manual_seed(300 + rank)
    x = torch.randn(count, M, generator=g).reshape(*shape, M)
    return x, torch.randn(x.shape, generator=g)


def _moelayer_step(layer: MOELayer, rank: int, count: int) -> dict[str, Any]:
    """``sum(out * w) + l_aux`` backward on rank ``rank``'s tokens (``(count, 1, M)``)."""
    layer.zero_grad()
    x, target = _inputs(rank, count, (count, 1))
    torch.manual_seed(1000 + rank)  # the gate's Gumbel noise, alike in both layers
    out = layer(x)
    assert layer.l_aux is not None
    ((out * target).sum() + layer.l_aux).backward()
    return {"out": out.detach(), "l_aux": layer.l_aux.item(), "grads": _grads(layer)}


def _moelayer_case(
    num_experts: int, counts: list[int], mesh: ProcessMesh, alone: ProcessMesh
) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    gate = Top2Gate(M, num_experts)
    experts = nn.ModuleList([nn.Linear(M, M) for _ in range(num_experts)])
    ref = MOELayer(gate, experts, group=alone.group("ep"))
    want = [_moelayer_step(ref, r, c) for r, c in enumerate(counts)]
    n = num_experts // mesh.size("ep")
    q = mesh.local_rank("ep")
    local = copy.deepcopy(nn.ModuleList(experts[q * n : (q + 1) * n]))
    layer = MOELayer(copy.deepcopy(gate), local, group=mesh.group("ep"))
    got = _moelayer_step(layer, rank, counts[rank])
    # parameters: the gate's weight, then each expert's weight and bias (2 per expert);
    # the experts' gradients are sums over the ep group (FairScale's semantics)
    per_expert = [sum(w["grads"][1 + 2 * (q * n) + i] for w in want) for i in range(2 * n)]
    res = {
        "out": _err(got["out"], want[rank]["out"]),
        "l_aux": abs(got["l_aux"] - want[rank]["l_aux"]),
        "gate": _err(got["grads"][0], want[rank]["grads"][0]),
        "experts": max(_err(g, w) for g, w in zip(got["grads"][1:], per_expert, strict=True)),
        "l_aux_value": got["l_aux"],
        "moved": float(sum(g.abs().sum() for g in got["grads"])),  # gradients are not all 0
    }
    if len(set(counts)) == 1:  # equal counts: the agreement must change nothing at all
        layer._agreed_capacity = lambda capacity, device: capacity  # type: ignore[method-assign]
        unagreed = _moelayer_step(layer, rank, counts[rank])
        res["bitwise"] = torch.equal(unagreed["out"], got["out"]) and all(
            torch.equal(a, b) for a, b in zip(unagreed["grads"], got["grads"], strict=True)
        )
    return res


def _moe_step(moe: MoE, rank: int, count: int) -> dict[str, Any]:
    moe.zero_grad()
    x, target = _inputs(rank, count, (1, count))
    out, l_aux, _ = moe(x)
    ((out * target).sum() + l_aux).backward()
    return {"out": out.detach(), "l_aux": l_aux.item(), "grads": _grads(moe)}


def _moe_case(counts: list[int], mesh: ProcessMesh) -> dict[str, Any]:
    """The general layer (top-2, binding capacity) at ep = 2 against ep = 1."""
    rank = dist.get_rank()

    def build(group: dist.ProcessGroup | None) -> MoE:
        torch.manual_seed(0)
        return MoE(M, F_HIDDEN, 4, k=2, capacity_factor=0.75, min_capacity=0, ep_group=group)

    ref, moe = build(None), build(mesh.group("ep"))
    want = [_moe_step(ref, r, c) for r, c in enumerate(counts)]
    got = _moe_step(moe, rank, counts[rank])
    lo, hi = moe.experts.first_expert, moe.experts.first_expert + moe.experts.num_local_experts
    # parameters: gate, w1, w2; the experts' gradients are means over the ep group
    mean = [sum(w["grads"][i] for w in want) / len(counts) for i in (1, 2)]
    return {
        "out": _err(got["out"], want[rank]["out"]),
        "l_aux": abs(got["l_aux"] - want[rank]["l_aux"]),
        "gate": _err(got["grads"][0], want[rank]["grads"][0]),
        "experts": max(_err(got["grads"][i], mean[i - 1][lo:hi]) for i in (1, 2)),
        "l_aux_value": got["l_aux"],
        "moved": float(sum(g.abs().sum() for g in got["grads"])),
    }


def run_unequal_tokens(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case: ``{"layer": "MOELayer" | "MoE", "experts": E, "counts": [T0, T1]}``
    (``T_r`` the tokens of rank ``r``), on 2 ranks, ep = 2."""
    world = dist.get_world_size()
    mesh = ProcessMesh(ParallelDims(world_size=world, ep=world), timeout=GROUP_TIMEOUT)
    alone = ProcessMesh(ParallelDims(world_size=world), timeout=GROUP_TIMEOUT)  # ep groups of 1
    results = []
    for case in cases:
        if case["layer"] == "MOELayer":
            results.append(_moelayer_case(case["experts"], case["counts"], mesh, alone))
        else:
            results.append(_moe_case(case["counts"], mesh))
    mesh.destroy()
    alone.destroy()
    return results
