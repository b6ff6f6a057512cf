"""Rank functions for the expert-parallel tests: each runs on every rank of a spawned
group (``shardkit.testing.RankPool``) and returns errors against a single-process
reference computed on the same rank, for every rank's tokens."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.checkpoint.universal import load_universal, save_universal
from shardkit.compose import parallelize_model
from shardkit.distributed.mesh import ParallelDims, ProcessMesh
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.nn.checkpoint import checkpoint_wrapper
from shardkit.nn.data_parallel.fully_sharded import MixedPrecision
from shardkit.nn.moe import (
    MoE,
    MOELayer,
    Top2Gate,
    all_reduce_expert_gradients,
    clip_grad_norm_,
    ignore_experts_in_ddp,
)
from shardkit.optim import OSS

M, F_HIDDEN, E = 6, 10, 8


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens (a different count on each rank) and loss weights."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 5 + 3 * rank, M, generator=g)
    return x, torch.randn(x.shape, generator=g)


def _moe(
    cfg: dict[str, Any],
    group: dist.ProcessGroup | None,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
) -> MoE:
    """The layer of seed 0, its experts split over ``group`` (ep) and ``tp_group``."""
    torch.manual_seed(0)
    return MoE(
        M,
        F_HIDDEN,
        E,
        k=cfg["k"],
        capacity_factor=cfg["factor"],
        min_capacity=0,
        drop_tokens=cfg["drop"],
        ep_group=group,
        tp_group=tp_group,
        sequence_parallel=sequence_parallel,
    )


def _reference_grads(ref: MoE, world: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Outputs and ``[gate, w1, w2]`` gradients of the single-process layer, per rank."""
    outs, grads = [], []
    for r in range(world):
        ref.zero_grad()
        x, target = _tokens(r)
        out, _, _ = ref(x)
        (out * target).sum().backward()
        outs.append(out.detach())
        grads.append([p.grad.clone() for p in (ref.gate.wg.weight, ref.experts.w1, ref.experts.w2)])  # type: ignore[union-attr]
    return outs, grads


MAX_NORM = 0.5  # below every test's gradient norm: clipping binds


def _clipped(mean: list[torch.Tensor]) -> tuple[float, float]:
    """The single-process model's gradient norm (``torch.nn.utils.clip_grad_norm_`` on
    the global mean gradients) and the coefficient clipping to ``MAX_NORM`` gives."""
    norm = float(torch.linalg.vector_norm(torch.stack([m.norm() for m in mean])))
    return norm, min(1.0, MAX_NORM / (norm + 1e-6))


def run_parity(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for cfg in configs:
        mesh = ProcessMesh(ParallelDims(world_size=world, ep=cfg["ep"]))
        group = mesh.group("ep") if cfg["ep"] > 1 else None
        moe, ref = _moe(cfg, group), _moe(cfg, None)
        lo = moe.experts.first_expert
        hi = lo + moe.experts.num_local_experts
        ep_ranks = mesh.ranks("ep")
        ref_outs, ref_grads = _reference_grads(ref, world)
        x, target = _tokens(rank)
        out, _, _ = moe(x)
        (out * target).sum().backward()
        routing = moe.last_routing
        assert routing is not None
        res: dict[str, Any] = {
            "init": _err(moe.experts.w1.detach(), ref.experts.w1.detach()[lo:hi]),
            "out": _err(out.detach(), ref_outs[rank]),
            "gate": _err(moe.gate.wg.weight.grad, ref_grads[rank][0]),  # type: ignore[arg-type]
            "dropped": int((~routing.kept).sum()),
            "tokens": x.shape[0] * x.shape[1],
            "bytes": dict(moe.last_all_to_all_bytes),
            "kept": int(routing.kept.sum()),
        }
        for i, p in ((1, moe.experts.w1), (2, moe.experts.w2)):
            want = (sum(ref_grads[r][i] for r in ep_ranks) / len(ep_ranks))[lo:hi]
            res[f"expert{i}"] = _err(p.grad, want)  # type: ignore[arg-type]
        all_reduce_expert_gradients(moe, mesh.group("edp"))
        for i, p in ((1, moe.experts.w1), (2, moe.experts.w2)):
            want = (sum(g[i] for g in ref_grads) / world)[lo:hi]
            res[f"edp{i}"] = _err(p.grad, want)  # type: ignore[arg-type]
        mesh.destroy()
        results.append(res)
    return results


class _Block(nn.Module):
    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _, _ = self.moe(x)
        return x + out


def run_ddp(cfg: dict[str, Any]) -> dict[str, Any]:
    """DDP over dp for the dense part (the gate), experts over edp, the gradients
    clipped by ``shardkit.nn.moe.clip_grad_norm_`` to ``MAX_NORM``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = ProcessMesh(ParallelDims(world_size=world, ep=cfg["ep"]))
    block = _Block(_moe(cfg, mesh.group("ep")))
    ignored = ignore_experts_in_ddp(block)
    ddp = DistributedDataParallel(block, process_group=mesh.group("dp"))
    ref = _moe(cfg, None)
    _, ref_grads = _reference_grads(ref, world)
    x, target = _tokens(rank)
    (ddp(x) * target).sum().backward()
    reduced = all_reduce_expert_gradients(block, mesh.group("edp"))
    refused = []  # a wrong ep_group counted experts several times in the norm
    for wrong in (None, mesh.group("edp")):
        try:
            clip_grad_norm_(block, MAX_NORM, ep_group=wrong)
        except ValueError as e:
            refused.append(str(e))
    norm = clip_grad_norm_(block, MAX_NORM, ep_group=mesh.group("ep"))
    lo = block.moe.experts.first_expert
    hi = lo + block.moe.experts.num_local_experts
    mean = [sum(g[i] for g in ref_grads) / world for i in range(3)]
    want_norm, coef = _clipped(mean)
    mean = [m * coef for m in mean]
    grads = [block.moe.gate.wg.weight.grad, block.moe.experts.w1.grad, block.moe.experts.w2.grad]
    errors = [
        _err(grads[0], mean[0]),
        _err(grads[1], mean[1][lo:hi]),
        _err(grads[2], mean[2][lo:hi]),
    ]  # type: ignore[arg-type]
    del ddp  # the reducer goes while its group lives (see run_data_parallel_guards)
    gc.collect()
    mesh.destroy()
    res = {"ignored": ignored, "reduced": reduced, "errors": errors, "refused": refused}
    return res | {"norm": float(norm), "want_norm": want_norm}


def run_oss(cfg: dict[str, Any]) -> dict[str, Any]:
    """OSS over edp (every parameter; ranks holding the same experts), the gate's
    gradient averaged over dp by hand, the experts' over edp, the gradients clipped by
    ``shardkit.nn.moe.clip_grad_norm_`` to ``MAX_NORM``, one SGD step (lr 1): the norm
    and the stepped parameters against the single-process layer's clipped step; and
    ``OSS.clip_grad_norm``, which sums over edp only, refused."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = ProcessMesh(ParallelDims(world_size=world, ep=cfg["ep"]))
    block = _Block(_moe(cfg, mesh.group("ep")))
    opt = OSS(block.parameters(), torch.optim.SGD, process_group=mesh.group("edp"), lr=1.0)
    ref = _moe(cfg, None)
    _, ref_grads = _reference_grads(ref, world)
    x, target = _tokens(rank)
    (block(x) * target).sum().backward()
    gate = block.moe.gate.wg.weight.grad
    assert gate is not None
    dist.all_reduce(gate, group=mesh.group("dp"))
    gate /= mesh.size("dp")
    all_reduce_expert_gradients(block, mesh.group("edp"))
    try:
        opt.clip_grad_norm(MAX_NORM)
        refused = "no error"
    except ValueError as err:
        refused = str(err)
    norm = clip_grad_norm_(block, MAX_NORM, ep_group=mesh.group("ep"))
    opt.step()
    mean = [sum(g[i] for g in ref_grads) / world for i in range(3)]
    want_norm, coef = _clipped(mean)
    lo = block.moe.experts.first_expert
    hi = lo + block.moe.experts.num_local_experts
    ref_params = [p.detach() for p in (ref.gate.wg.weight, ref.experts.w1, ref.experts.w2)]
    want = [p - coef * m for p, m in zip(ref_params, mean, strict=True)]
    errors = [
        _err(block.moe.gate.wg.weight.detach(), want[0]),
        _err(block.moe.experts.w1.detach(), want[1][lo:hi]),
        _err(block.moe.experts.w2.detach(), want[2][lo:hi]),
    ]
    moved = float((want[1] - ref_params[1]).abs().max())
    mesh.destroy()
    return {"norm": float(norm), "want_norm": want_norm, "errors": errors, "moved": moved} | {
        "refused": refused
    }


def run_moelayer(ep: int) -> dict[str, Any]:
    """FairScale's MOELayer over an ep group against the same layer in one process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = ProcessMesh(ParallelDims(world_size=world, ep=ep))
    alone = ProcessMesh(ParallelDims(world_size=world))  # ep=1: groups of one rank
    torch.manual_seed(0)
    gate = Top2Gate(M, E)
    experts = [nn.Linear(M, M) for _ in range(E)]
    ref = MOELayer(gate, nn.ModuleList(experts), group=alone.group("ep"))
    n = E // ep
    q = mesh.local_rank("ep")
    local_gate = Top2Gate(M, E)
    local_gate.load_state_dict(gate.state_dict())
    local = nn.ModuleList([nn.Linear(M, M) for _ in range(n)])
    local.load_state_dict(nn.ModuleList(experts[q * n : (q + 1) * n]).state_dict())
    layer = MOELayer(local_gate, local, group=mesh.group("ep"))
    outs, grads = [], []
    for r in range(world):
        ref.zero_grad()
        g = torch.Generator().manual_seed(200 + r)
        xr = torch.randn(8, 2, M, generator=g)
        torch.manual_seed(1000 + r)
        out = ref(xr)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append(
            [gate.wg.weight.grad.clone()]
            + [
                e.weight.grad.clone() if e.weight.grad is not None else torch.zeros(M, M)
                for e in experts
            ]
        )  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(8, 2, M, generator=g)
    torch.manual_seed(1000 + rank)
    out = layer(x)
    out.square().sum().backward()
    ep_ranks = mesh.ranks("ep")
    expert_err = max(
        _err(
            local[j].weight.grad if local[j].weight.grad is not None else torch.zeros(M, M),
            sum(grads[r][1 + q * n + j] for r in ep_ranks),  # type: ignore[arg-type]
        )
        for j in range(n)
    )
    res = {
        "out": _err(out.detach(), outs[rank]),
        "gate": _err(local_gate.wg.weight.grad, grads[rank][0]),  # type: ignore[arg-type]
        "experts": expert_err,
        "world": (ref.world_size, layer.world_size),
    }
    mesh.destroy()
    alone.destroy()
    return res


def run_checkpoint(root: str, ep: int, save: bool) -> dict[str, Any]:
    """Save a model holding 8 experts at ``ep`` (seed 0), or load one into a model at
    ``ep`` built from seed 1; returns the output on fixed tokens."""
    world = dist.get_world_size()
    mesh = ProcessMesh(ParallelDims(world_size=world, ep=ep))
    torch.manual_seed(0 if save else 1)
    block = _Block(MoE(M, F_HIDDEN, E, k=2, drop_tokens=False, ep_group=mesh.group("ep")))
    if save:
        save_universal(Path(root), 1, block)
    else:
        load_universal(Path(root), block)
    x, _ = _tokens(0)
    with torch.no_grad():
        out = block(x)
    mesh.destroy()
    return {"out": out, "w1": block.moe.experts.w1.detach().clone()}


def run_activation_checkpointing(eps: list[int]) -> list[dict[str, Any]]:
    """``checkpoint_wrapper`` around a block holding an expert-parallel MoE: the
    recompute runs the dispatch and combine again in backward; outputs and gradients
    still equal the single-process layer's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for ep in eps:
        cfg = {"ep": ep, "k": 2, "drop": True, "factor": 0.75}
        mesh = ProcessMesh(ParallelDims(world_size=world, ep=ep))
        block = checkpoint_wrapper(_Block(_moe(cfg, mesh.group("ep"))))
        moe = block.module.moe  # type: ignore[union-attr]
        _, ref_grads = _reference_grads(_moe(cfg, None), world)
        x, target = _tokens(rank)
        x = x.requires_grad_()
        out = block(x)
        forward_bytes = dict(moe.last_all_to_all_bytes)
        (out * target).sum().backward()
        lo, n = moe.experts.first_expert, moe.experts.num_local_experts
        want1 = (sum(ref_grads[r][1] for r in mesh.ranks("ep")) / ep)[lo : lo + n]
        results.append(
            {
                "gate": _err(moe.gate.wg.weight.grad, ref_grads[rank][0]),
                "w1": _err(moe.experts.w1.grad, want1),  # type: ignore[arg-type]
                "dispatch": forward_bytes["dispatch"],
            }
        )
        mesh.destroy()
    return results


def run_bf16(ep: int) -> dict[str, Any]:
    """The layer in bf16 (parameters and tokens) at ``ep``: the all-to-all carries bf16
    (2 bytes an element) and the output stays within bf16 rounding of the fp32 layer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {"ep": ep, "k": 2, "drop": False, "factor": 1.0}
    mesh = ProcessMesh(ParallelDims(world_size=world, ep=ep))
    moe = _moe(cfg, mesh.group("ep")).to(torch.bfloat16)
    ref = _moe(cfg, None)
    x, _ = _tokens(rank)
    out, _, _ = moe(x.to(torch.bfloat16))
    want, _, _ = ref(x.to(torch.bfloat16).float())
    res = {
        "dtype": str(out.dtype),
        "rel": float((out.float() - want).norm() / want.norm()),
        "dispatch": moe.last_all_to_all_bytes["dispatch"],
        "tokens": x.shape[0] * x.shape[1],
    }
    mesh.destroy()
    return res


def run_bad_expert_count(ep: int, num_experts: int) -> str:
    """The error of an MoE whose experts do not split evenly over the ep group."""
    mesh = ProcessMesh(ParallelDims(world_size=dist.get_world_size(), ep=ep))
    try:
        MoE(M, F_HIDDEN, num_experts, ep_group=mesh.group("ep"))
    except ValueError as err:
        return str(err)
    finally:
        mesh.destroy()
    return "no error"


def run_fsdp(cfg: dict[str, Any]) -> dict[str, Any]:
    """FSDP over dp for the dense part (or hybrid sharding: shard over dp_shard,
    replicas over dp_replicate), a nested FSDP unit over edp for the experts, optionally
    both in bf16 mixed precision (fp32 reduce), the root's ``clip_grad_norm_`` to
    ``MAX_NORM``, one SGD step (lr 1): the norm and the parameters equal the
    single-process fp32 clipped step on the global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dpr = cfg.get("dp_replicate", 1)
    mesh = ProcessMesh(ParallelDims(world_size=world, dp_replicate=dpr, ep=cfg["ep"]))
    block = _Block(_moe(cfg, mesh.group("ep")))
    lo = block.moe.experts.first_expert
    hi = lo + block.moe.experts.num_local_experts
    mp = MixedPrecision(torch.bfloat16, torch.float32) if cfg.get("bf16") else None
    block.moe.experts = FSDP(  # type: ignore[assignment]
        block.moe.experts, process_group=mesh.group("edp"), mixed_precision=mp
    )
    if dpr > 1:
        groups = (mesh.group("dp_shard"), mesh.group("dp_replicate"))
        model = FSDP(
            block, process_group=groups, sharding_strategy="HYBRID_SHARD", mixed_precision=mp
        )
    else:
        model = FSDP(block, process_group=mesh.group("dp"), mixed_precision=mp)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ref = _moe(cfg, None)
    _, ref_grads = _reference_grads(ref, world)
    x, target = _tokens(rank)
    (model(x).float() * target).sum().backward()
    norm = model.clip_grad_norm_(MAX_NORM)
    opt.step()
    mean = [sum(g[i] for g in ref_grads) / world for i in range(3)]
    want_norm, coef = _clipped(mean)
    mean = [m * coef for m in mean]
    want = [
        ref.gate.wg.weight.detach() - mean[0],
        (ref.experts.w1.detach() - mean[1])[lo:hi],
        (ref.experts.w2.detach() - mean[2])[lo:hi],
    ]
    with model.summon_full_params():
        got = [block.moe.gate.wg.weight, block.moe.experts.w1, block.moe.experts.w2]
        errors = [_err(g.detach(), w) for g, w in zip(got, want, strict=True)]
        moved = [float(m.abs().max()) for m in mean]
    mesh.destroy()
    return {"errors": errors, "moved": moved, "norm": float(norm), "want_norm": want_norm}


def run_fsdp_checkpoint(root: str, ep: int, dp_replicate: int = 1) -> dict[str, Any]:
    """Save the FSDP-wrapped expert-parallel model (experts in a unit over edp; the
    dense part FSDP over dp, or hybrid sharding over dp_shard x dp_replicate) with
    save_universal; return the output on fixed tokens for the caller to compare."""
    world = dist.get_world_size()
    mesh = ProcessMesh(ParallelDims(world_size=world, dp_replicate=dp_replicate, ep=ep))
    torch.manual_seed(0)
    block = _Block(MoE(M, F_HIDDEN, E, k=2, drop_tokens=False, ep_group=mesh.group("ep")))
    block.moe.experts = FSDP(block.moe.experts, process_group=mesh.group("edp"))  # type: ignore[assignment]
    if dp_replicate > 1:
        groups = (mesh.group("dp_shard"), mesh.group("dp_replicate"))
        model = FSDP(block, process_group=groups, sharding_strategy="HYBRID_SHARD")
    else:
        model = FSDP(block, process_group=mesh.group("dp"))
    save_universal(Path(root), 1, model)
    x, _ = _tokens(0)
    with torch.no_grad():
        out = model(x)
    mesh.destroy()
    return {"out": out}


def _error_of(fn: Any) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def run_data_parallel_guards() -> dict[str, Any]:
    """An expert-parallel MoE (ep 2 of 4 ranks) under torch DDP over dp without
    ``ignore_experts_in_ddp``, and OSS over dp: both refused; DDP and OSS over edp
    (ranks holding the same experts) accepted, DDP's gradients the global mean."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {"ep": 2, "k": 2, "drop": True, "factor": 1.0}
    mesh = ProcessMesh(ParallelDims(world_size=world, ep=2))
    x, target = _tokens(rank)
    res: dict[str, Any] = {}
    block = _Block(_moe(cfg, mesh.group("ep")))
    ddp = DistributedDataParallel(block, process_group=mesh.group("dp"))
    res["ddp_dp"] = _error_of(lambda: ddp(x))
    res["ddp_dp_again"] = _error_of(lambda: ddp(x))  # not only the first forward
    res["oss_dp"] = _error_of(lambda: OSS(block.parameters(), lr=1.0))
    # over edp the ranks hold the same experts: accepted, and the mean is DDP's
    block = _Block(_moe(cfg, mesh.group("ep")))
    edp = DistributedDataParallel(block, process_group=mesh.group("edp"))
    (edp(x) * target).sum().backward()
    _, ref_grads = _reference_grads(_moe(cfg, None), world)
    lo = block.moe.experts.first_expert
    hi = lo + block.moe.experts.num_local_experts
    mean = [(sum(g[i] for g in ref_grads) / world)[lo:hi] for i in (1, 2)]
    res["edp_errors"] = [
        _err(p.grad, m)  # type: ignore[arg-type]
        for p, m in zip((block.moe.experts.w1, block.moe.experts.w2), mean, strict=True)
    ]
    res["oss_edp"] = _error_of(
        lambda: OSS(block.moe.experts.parameters(), lr=1.0, process_group=mesh.group("edp"))
    )
    # Free the DDP reducers while their groups live: destroyed after mesh.destroy(), the
    # reducer of a DDP whose forward raised hung in its destructor on one rank now and then.
    ddp = edp = None  # type: ignore[assignment]
    gc.collect()
    mesh.destroy()
    return res


def run_parallelize_model() -> dict[str, Any]:
    """``parallelize_model`` with an MoE: accepted with tp 2 (the experts split over tp
    inside the layer; its parity is ``tests/nn/moe/test_tensor_parallel_experts.py``'s);
    refused with ep 2 when the experts would go into the dense FSDP over dp; accepted
    with the experts in a unit over edp first, and then one SGD step equals the
    single-process step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {"ep": 2, "k": 2, "drop": True, "factor": 1.0}
    res: dict[str, Any] = {}
    tp_mesh = ProcessMesh(ParallelDims(world_size=world, tp=2))
    moe = MoE(M, F_HIDDEN, E, k=2, tp_group=tp_mesh.group("tp"))
    res["tp"] = _error_of(lambda: parallelize_model(_Block(moe), tp_mesh, tp_plan={}))
    tp_mesh.destroy()
    mesh = ProcessMesh(ParallelDims(world_size=world, ep=2))
    block = _Block(_moe(cfg, mesh.group("ep")))
    res["fsdp_dp"] = _error_of(lambda: parallelize_model(block, mesh))
    block.moe.experts = FSDP(block.moe.experts, process_group=mesh.group("edp"))  # type: ignore[assignment]
    model = parallelize_model(block, mesh).module
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ref = _moe(cfg, None)
    _, ref_grads = _reference_grads(ref, world)
    x, target = _tokens(rank)
    (model(x) * target).sum().backward()
    opt.step()
    lo = mesh.local_rank("ep") * (E // 2)
    mean = [sum(g[i] for g in ref_grads) / world for i in range(3)]
    with model.summon_full_params():  # type: ignore[operator]
        got = [block.moe.gate.wg.weight, block.moe.experts.w1, block.moe.experts.w2]
        want = [
            ref.gate.wg.weight.detach() - mean[0],
            (ref.experts.w1.detach() - mean[1])[lo : lo + E // 2],
            (ref.experts.w2.detach() - mean[2])[lo : lo + E // 2],
        ]
        res["errors"] = [_err(g.detach(), w) for g, w in zip(got, want, strict=True)]
    mesh.destroy()
    return res


def run_expert_bias_update() -> dict[str, Any]:
    """Each rank routes its own tokens through the same gate; ``update_expert_bias``
    over the world sums the loads: every rank takes the same step, the one the summed
    loads of all ranks' tokens (computed here in one process) give."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    gate = MoE(M, F_HIDDEN, E, k=2, bias_update_speed=0.5).gate
    want = torch.zeros(E, dtype=torch.float64)
    for r in range(world):
        x, _ = _tokens(r)
        choices = gate.route(gate.wg(x.reshape(-1, M))).experts
        want += torch.bincount(choices.reshape(-1), minlength=E).double()
    gate.expert_load.zero_()  # type: ignore[union-attr]
    x, _ = _tokens(rank)
    gate(x.reshape(-1, M))
    load = gate.update_expert_bias(dist.group.WORLD)
    bias = gate.expert_bias.clone()  # type: ignore[union-attr]
    every = [torch.empty_like(bias) for _ in range(world)]
    dist.all_gather(every, bias)
    return {
        "load": _err(load, want),
        "bias": _err(bias, 0.5 * torch.sign(want.mean() - want).float()),
        "same": max(_err(b, bias) for b in every),
        "moved": float(bias.abs().sum()),
    }
