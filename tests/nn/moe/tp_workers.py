"""Rank functions for tensor parallel inside each expert (``MoE(..., tp_group=...)``):
each runs on every rank of a spawned group and compares with the single-process layer
of the same seed, evaluated here on every data-parallel rank's tokens."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardkit.checkpoint.universal import load_universal, save_universal
from shardkit.compose import parallelize_model
from shardkit.distributed.mesh import ParallelDims, ProcessMesh
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.nn.moe import MoE, all_reduce_expert_gradients, clip_grad_norm_
from tests.nn.moe import moe_workers
from tests.nn.moe.moe_workers import F_HIDDEN, M, _Block, _err, _tokens


def _moe(cfg: dict[str, Any], mesh: ProcessMesh | None) -> MoE:
    """The layer of seed 0; split over ``mesh``'s ep and tp groups when given."""
    if mesh is None:
        return moe_workers._moe(cfg, None)
    ep = mesh.group("ep") if mesh.size("ep") > 1 else None
    tp = mesh.group("tp") if mesh.size("tp") > 1 else None
    return moe_workers._moe(cfg, ep, tp_group=tp)


def _reference(ref: MoE, tokens: list[int]) -> list[dict[str, torch.Tensor]]:
    """Output, input gradient and ``[gate, w1, w2]`` gradients of the single-process
    layer on each of ``tokens``' token sets (loss: ``sum(out * target)``)."""
    results = []
    for i in tokens:
        ref.zero_grad()
        x, target = _tokens(i)
        x.requires_grad_()
        out, _, _ = ref(x)
        (out * target).sum().backward()
        grads = [p.grad.clone() for p in (ref.gate.wg.weight, ref.experts.w1, ref.experts.w2)]  # type: ignore[union-attr]
        results.append({"out": out.detach(), "x": x.grad.clone(), "grads": grads})  # type: ignore[union-attr]
    return results


class _Slices:
    """This rank's slice of the global ``w1`` / ``w2`` (experts over ep, hidden over tp)."""

    def __init__(self, moe: MoE, mesh: ProcessMesh) -> None:
        lo, n = moe.experts.first_expert, moe.experts.num_local_experts
        f = F_HIDDEN // mesh.size("tp")
        t = mesh.local_rank("tp")
        self.experts, self.hidden = slice(lo, lo + n), slice(t * f, (t + 1) * f)

    def w1(self, full: torch.Tensor) -> torch.Tensor:
        return full[self.experts, :, self.hidden]

    def w2(self, full: torch.Tensor) -> torch.Tensor:
        return full[self.experts, self.hidden, :]


def _mean_grads(per_rank: list[dict[str, Any]]) -> list[torch.Tensor]:
    """The reference's ``[gate, w1, w2]`` gradients averaged over the dp ranks."""
    return [sum(r["grads"][i] for r in per_rank) / len(per_rank) for i in range(3)]


def _sgd_with_mean(ref: MoE, per_rank: list[dict[str, Any]], coef: float = 1.0) -> None:
    """One SGD step (lr 1) of the reference on the mean gradient over the dp ranks,
    clipped by ``coef``."""
    with torch.no_grad():
        params = (ref.gate.wg.weight, ref.experts.w1, ref.experts.w2)
        for p, g in zip(params, _mean_grads(per_rank), strict=True):
            p -= coef * g


def _clip(moe: MoE, mesh: ProcessMesh, want: list[dict[str, Any]]) -> tuple[dict[str, Any], float]:
    """``clip_grad_norm_`` of the split layer (to half the reference's norm) against
    the single-process norm of the mean gradients, and without ``tp_group`` (refused);
    returns the results and the reference's clipping coefficient."""
    ref_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in _mean_grads(want)])))
    ep, tp = mesh.group("ep"), mesh.group("tp")
    try:
        clip_grad_norm_(moe, 0.5 * ref_norm, ep_group=ep)
        refused = "no error"
    except ValueError as err:
        refused = str(err)
    norm = float(clip_grad_norm_(moe, 0.5 * ref_norm, ep_group=ep, tp_group=tp))
    coef = 0.5 * ref_norm / (ref_norm + 1e-6)
    return {"norm": abs(norm - ref_norm) / ref_norm, "refused": refused}, coef


def run_tp_parity(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per config (``ep``, ``tp``, ``k``, ``drop``, ``factor``): the split layer's
    weights, output, input and parameter gradients against the single-process layer;
    then the gradients averaged (experts over edp, the gate over dp), one SGD step, and
    the output of a second batch against the reference after the same step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for cfg in configs:
        mesh = ProcessMesh(ParallelDims(world_size=world, ep=cfg["ep"], tp=cfg["tp"]))
        dp_ranks = mesh.ranks("dp")
        me = dp_ranks.index(rank)  # the tp ranks of a dp index share its tokens
        moe, ref = _moe(cfg, mesh), _moe(cfg, None)
        cut = _Slices(moe, mesh)
        want = _reference(ref, list(range(len(dp_ranks))))
        x, target = _tokens(me)
        x.requires_grad_()
        out, _, _ = moe(x)
        (out * target).sum().backward()
        ep_index = [dp_ranks.index(g) for g in mesh.ranks("ep")]
        mean_ep = [sum(want[i]["grads"][j] for i in ep_index) / len(ep_index) for j in (1, 2)]
        res: dict[str, Any] = {
            "shapes": [tuple(moe.experts.w1.shape), tuple(moe.experts.w2.shape)],
            "init": max(
                _err(moe.experts.w1.detach(), cut.w1(ref.experts.w1.detach())),
                _err(moe.experts.w2.detach(), cut.w2(ref.experts.w2.detach())),
            ),
            "out": _err(out.detach(), want[me]["out"]),
            "x": _err(x.grad, want[me]["x"]),  # type: ignore[arg-type]
            "gate": _err(moe.gate.wg.weight.grad, want[me]["grads"][0]),  # type: ignore[arg-type]
            "w1": _err(moe.experts.w1.grad, cut.w1(mean_ep[0])),  # type: ignore[arg-type]
            "w2": _err(moe.experts.w2.grad, cut.w2(mean_ep[1])),  # type: ignore[arg-type]
            "dropped": int((~moe.last_routing.kept).sum()),  # type: ignore[union-attr]
        }
        # the tp all-reduce carries the tokens this rank received: over the ep group,
        # as many as its ranks kept (kept choices x M x 4 bytes)
        kept = int(moe.last_routing.kept.sum())  # type: ignore[union-attr]
        counted = torch.tensor([moe.experts.last_all_reduce_bytes, kept * M * 4])
        if cfg["ep"] > 1:
            dist.all_reduce(counted, group=mesh.group("ep"))
        res["all_reduce_bytes"] = counted.tolist()
        all_reduce_expert_gradients(moe, mesh.group("edp"))
        gate_grad = moe.gate.wg.weight.grad
        dist.all_reduce(gate_grad, group=mesh.group("dp"))  # type: ignore[arg-type]
        gate_grad /= len(dp_ranks)  # type: ignore[operator]
        coef = 1.0
        if cfg.get("clip"):
            res["clip"], coef = _clip(moe, mesh, want)
        with torch.no_grad():
            for p in (moe.gate.wg.weight, moe.experts.w1, moe.experts.w2):
                p -= p.grad  # type: ignore[operator]
        _sgd_with_mean(ref, want, coef)
        x2, _ = _tokens(10 + me)
        with torch.no_grad():
            out2, want2 = moe(x2)[0], ref(x2)[0]
        res["step_w1"] = _err(moe.experts.w1.detach(), cut.w1(ref.experts.w1.detach()))
        res["step_out"] = _err(out2, want2)
        res["moved"] = float(want[me]["grads"][1].abs().max())
        mesh.destroy()
        results.append(res)
    return results


def run_tp_checkpoint(root: str, ep: int, tp: int, save: bool) -> dict[str, Any]:
    """Save the block (seed 0) with its experts over ``ep`` x ``tp``, or load into one
    built from seed 1; return the local expert weights and the output on fixed tokens."""
    world = dist.get_world_size()
    mesh = ProcessMesh(ParallelDims(world_size=world, ep=ep, tp=tp))
    cfg = {"k": 2, "factor": 1.0, "drop": False}
    block = _Block(_moe(cfg, mesh))
    if not save:  # other weights than the saved ones, so that the load must fill them
        torch.manual_seed(1)
        with torch.no_grad():
            for p in block.parameters():
                p.uniform_(-1.0, 1.0)
    lo, n = block.moe.experts.first_expert, block.moe.experts.num_local_experts
    if save:
        save_universal(Path(root), 1, block)
    else:
        load_universal(Path(root), block)
    x, _ = _tokens(0)
    with torch.no_grad():
        out = block(x)
    res = {
        "out": out,
        "w1": block.moe.experts.w1.detach().clone(),
        "w2": block.moe.experts.w2.detach().clone(),
        "gate": block.moe.gate.wg.weight.detach().clone(),
        "experts": (lo, lo + n),
        "tp_rank": mesh.local_rank("tp"),
    }
    mesh.destroy()
    return res


def run_parallelize_moe_tp() -> dict[str, Any]:
    """``parallelize_model`` over ep 2 x tp 2 (4 ranks): the experts split over both in
    an FSDP unit over edp, the gate FSDP over dp_shard; one SGD step equals the
    single-process step on the mean gradient. Before that, FSDP units whose gradient
    reduction would mix expert parts: over dp (ep peers) and over the world (tp peers
    too) refused at construction."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {"k": 2, "drop": True, "factor": 1.0}
    mesh = ProcessMesh(ParallelDims(world_size=world, ep=2, tp=2))
    refused = {}
    for name, group in (("dp", mesh.group("dp")), ("world", None)):
        try:
            FSDP(_moe(cfg, mesh).experts, process_group=group)
            refused[name] = "no error"
        except ValueError as err:
            refused[name] = str(err)
    block = _Block(_moe(cfg, mesh))
    cut = _Slices(block.moe, mesh)
    block.moe.experts = FSDP(block.moe.experts, process_group=mesh.group("edp"))  # type: ignore[assignment]
    model = parallelize_model(block, mesh, tp_plan={}).module
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ref = _moe(cfg, None)
    dp_ranks = mesh.ranks("dp")
    want = _reference(ref, list(range(len(dp_ranks))))
    x, target = _tokens(dp_ranks.index(rank))
    (model(x) * target).sum().backward()
    opt.step()
    _sgd_with_mean(ref, want)
    with model.summon_full_params():  # type: ignore[operator]
        got = [block.moe.gate.wg.weight, block.moe.experts.w1, block.moe.experts.w2]
        expect = [
            ref.gate.wg.weight.detach(),
            cut.w1(ref.experts.w1.detach()),
            cut.w2(ref.experts.w2.detach()),
        ]
        errors = [_err(g.detach(), w) for g, w in zip(got, expect, strict=True)]
    mesh.destroy()
    return {"errors": errors, "moved": float(want[0]["grads"][1].abs().max()), **refused}


def run_sequence_parallel(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``MoE(sequence_parallel=True)`` over ep x tp: each tensor-parallel rank passes its
    chunk of the sequence (dim 1) of its dp index's tokens; its output and input
    gradient equal the same chunks of the single-process layer's on the whole sequence,
    the gate's gradient the whole sequence's, the experts' the ep mean."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for cfg in configs:
        mesh = ProcessMesh(ParallelDims(world_size=world, ep=cfg["ep"], tp=cfg["tp"]))
        dp_ranks = mesh.ranks("dp")
        me, t, tp = dp_ranks.index(rank), mesh.local_rank("tp"), cfg["tp"]
        ep = mesh.group("ep") if cfg["ep"] > 1 else None
        moe = moe_workers._moe(cfg, ep, tp_group=mesh.group("tp"), sequence_parallel=True)
        ref = moe_workers._moe(cfg, None)
        cut = _Slices(moe, mesh)
        want = []
        for i in range(len(dp_ranks)):  # 8 positions: divisible by tp
            ref.zero_grad()
            g = torch.Generator().manual_seed(300 + i)
            x, target = torch.randn(2, 8, M, generator=g), torch.randn(2, 8, M, generator=g)
            x.requires_grad_()
            out, _, _ = ref(x)
            (out * target).sum().backward()
            grads = [p.grad.clone() for p in (ref.gate.wg.weight, ref.experts.w1, ref.experts.w2)]  # type: ignore[union-attr]
            want.append({"x": x, "t": target, "out": out.detach(), "dx": x.grad, "grads": grads})
        mine = want[me]
        x = mine["x"].detach().chunk(tp, dim=1)[t].clone().requires_grad_()
        out, _, _ = moe(x)
        (out * mine["t"].chunk(tp, dim=1)[t]).sum().backward()
        ep_index = [dp_ranks.index(r) for r in mesh.ranks("ep")]
        mean = [sum(want[i]["grads"][j] for i in ep_index) / len(ep_index) for j in (1, 2)]
        results.append(
            {
                "shape": tuple(out.shape),
                "out": _err(out.detach(), mine["out"].chunk(tp, dim=1)[t]),
                "x": _err(x.grad, mine["dx"].chunk(tp, dim=1)[t]),  # type: ignore[arg-type]
                "gate": _err(moe.gate.wg.weight.grad, mine["grads"][0]),  # type: ignore[arg-type]
                "w1": _err(moe.experts.w1.grad, cut.w1(mean[0])),  # type: ignore[arg-type]
                "w2": _err(moe.experts.w2.grad, cut.w2(mean[1])),  # type: ignore[arg-type]
                "dropped": int((~moe.last_routing.kept).sum()),  # type: ignore[union-attr]
            }
        )
        mesh.destroy()
    return results


def run_unequal_sequence_chunks() -> dict[str, Any]:
    """``MoE(sequence_parallel=True)`` over tp 2 where rank 0 passes 3 positions and
    rank 1 passes 5 (and, second, equal positions but batch 2 against 3): the layer
    must raise the same ValueError on both ranks before the gather (regression: the
    mismatched ``all_gather_single`` hung or died in gloo). A group timeout of 20 s
    turns a hang into a failure; the layer still works on equal chunks afterwards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = ProcessMesh(ParallelDims(world_size=world, tp=world), timeout=timedelta(seconds=20))
    cfg = {"k": 2, "drop": False, "factor": 1.0}
    moe = moe_workers._moe(cfg, None, tp_group=mesh.group("tp"), sequence_parallel=True)
    errors = []
    for shape in [(2, 3 + 2 * rank, M), (2 + rank, 4, M)]:
        try:
            moe(torch.randn(*shape))
            errors.append("")
        except ValueError as e:
            errors.append(str(e))
    out, _, _ = moe(torch.randn(2, 4, M))
    mesh.destroy()
    return {"errors": errors, "shape": tuple(out.shape)}
