"""Rank-side workers of the tensor-parallel tests (issue 18).

Each worker builds a :class:`ProcessMesh` on the pool's ranks, runs the unsplit
reference and the tensor-parallel version from the same seed on every rank, and returns
plain numbers (maximum differences) and short strings, so the test file asserts on
values. One ``pool.run(run_jobs, jobs)`` per world size runs every configuration.
"""

from __future__ import annotations

import copy
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardkit.distributed.mesh import ParallelDims, ProcessMesh
from shardkit.models.gpt import GPT, GPTConfig
from shardkit.nn import tensor_parallel as tp
from shardkit.nn.tensor_parallel.partition import full_tensor, shard

_MESHES: dict[tuple[tuple[str, int], ...], ProcessMesh] = {}


def mesh_of(**degrees: int) -> ProcessMesh:
    """One mesh per layout for the pool's lifetime (groups are created once)."""
    key = tuple(sorted(degrees.items()))
    if key not in _MESHES:
        _MESHES[key] = ProcessMesh(ParallelDims(world_size=dist.get_world_size(), **degrees))
    return _MESHES[key]


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def run_named(workers: dict[str, Any], jobs: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """Run ``(worker name, config)`` pairs, the names looked up in ``workers`` (a worker
    module's ``globals()``); an exception becomes ``{"error": traceback}``."""
    out = []
    for name, cfg in jobs:
        torch.manual_seed(0)
        start = time.perf_counter()
        try:
            out.append(workers[name](cfg))
        except Exception:
            out.append({"error": traceback.format_exc()})
        if os.environ.get("SHARDKIT_TP_TIMING") and dist.get_rank() == 0:
            print(f"{name} {cfg}: {time.perf_counter() - start:.2f} s", flush=True)
    return out


def run_jobs(jobs: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """:func:`run_named` over this module's workers."""
    return run_named(globals(), jobs)


# layers --------------------------------------------------------------------------------------
def linear_parity(cfg: dict[str, Any]) -> dict[str, float]:
    """Column / row parallel linear against nn.Linear: outputs and every gradient."""
    mesh = mesh_of(tp=cfg["tp"])
    group, rank, world = mesh.group("tp"), mesh.coordinates["tp"], cfg["tp"]
    kind, stride = cfg["kind"], cfg.get("stride", 1)
    ref = nn.Linear(12, 24)
    x = torch.randn(3, 5, 12, requires_grad=True)
    ref_out = ref(x)
    g = torch.randn_like(ref_out)
    (ref_out * g).sum().backward()
    x_ref_grad, x.grad = x.grad, None
    res: dict[str, float] = {}
    if kind == "column":
        gather = cfg["gather_output"]
        layer = tp.ColumnParallelLinear.from_linear(
            ref, gather_output=gather, stride=stride, process_group=group
        )
        out = layer(x)
        want = ref_out if gather else shard(ref_out, -1, rank, world, stride)
        g_local = g if gather else shard(g, -1, rank, world, stride)
        (out * g_local).sum().backward()
        res["out"] = diff(out, want)
        res["x_grad"] = diff(x.grad, x_ref_grad)
        res["w_grad"] = diff(layer.weight.grad, shard(ref.weight.grad, 0, rank, world, stride))
        res["b_grad"] = diff(layer.bias.grad, shard(ref.bias.grad, 0, rank, world, stride))
        res["w"] = diff(full_tensor(layer.weight, 0, group, stride), ref.weight)
    else:
        parallel = cfg["input_is_parallel"]
        layer2 = tp.RowParallelLinear.from_linear(
            ref, input_is_parallel=parallel, process_group=group
        )
        x_in = shard(x.detach(), -1, rank, world).requires_grad_() if parallel else x
        out = layer2(x_in)
        (out * g).sum().backward()
        want_x = shard(x_ref_grad, -1, rank, world) if parallel else x_ref_grad
        res["out"] = diff(out, ref_out)
        res["x_grad"] = diff(x_in.grad, want_x)
        res["w_grad"] = diff(layer2.weight.grad, shard(ref.weight.grad, 1, rank, world))
        res["b_grad"] = diff(layer2.bias.grad, ref.bias.grad)
        res["w"] = diff(full_tensor(layer2.weight, 1, group), ref.weight)
    return res


def init_method_semantics(cfg: dict[str, Any]) -> dict[str, float]:
    """FairScale's init_method: the shard of a master weight initialised from the seed."""
    mesh = mesh_of(tp=cfg["tp"])
    group, rank, world = mesh.group("tp"), mesh.coordinates["tp"], cfg["tp"]
    res = {}
    for name, build, dim in (
        ("column", lambda: tp.ColumnParallelLinear(8, 16, process_group=group), 0),
        ("row", lambda: tp.RowParallelLinear(16, 8, process_group=group), 1),
        ("vocab", lambda: tp.VocabParallelEmbedding(16, 8, process_group=group), 0),
        ("embedding", lambda: tp.ParallelEmbedding(16, 8, process_group=group), 1),
    ):
        torch.manual_seed(7)
        layer = build()
        torch.manual_seed(7)
        shape = (16, 8) if name in ("column", "vocab", "embedding") else (8, 16)
        master = nn.init.xavier_normal_(torch.empty(shape))
        res[name] = diff(layer.weight, shard(master, dim, rank, world))
        res[name + "_marked"] = float(
            tp.is_tensor_parallel(layer.weight) and layer.weight.partition_dim == dim
        )
    return res


def embedding_parity(cfg: dict[str, Any]) -> dict[str, float]:
    mesh = mesh_of(tp=cfg["tp"])
    group, rank, world = mesh.group("tp"), mesh.coordinates["tp"], cfg["tp"]
    ref = nn.Embedding(16, 8, padding_idx=cfg.get("padding_idx"))
    ids = torch.randint(0, 16, (4, 6))
    ids[0, :3] = torch.tensor([0, 15, 7])
    ref_out = ref(ids)
    g = torch.randn_like(ref_out)
    (ref_out * g).sum().backward()
    res = {}
    if cfg["kind"] == "vocab":
        layer = tp.VocabParallelEmbedding.from_embedding(ref, process_group=group)
        dim = 0
    else:
        layer = tp.ParallelEmbedding(16, 8, padding_idx=cfg.get("padding_idx"), process_group=group)
        with torch.no_grad():
            layer.weight.copy_(shard(ref.weight.detach(), 1, rank, world))
        dim = 1
    out = layer(ids)
    (out * g).sum().backward()
    res["out"] = diff(out, ref_out)
    res["w_grad"] = diff(layer.weight.grad, shard(ref.weight.grad, dim, rank, world))
    return res


def cross_entropy_parity(cfg: dict[str, Any]) -> dict[str, float]:
    mesh = mesh_of(tp=cfg["tp"])
    group, rank, world = mesh.group("tp"), mesh.coordinates["tp"], cfg["tp"]
    logits = (4 * torch.randn(3, 5, 32)).requires_grad_()
    target = torch.randint(0, 32, (3, 5))
    target[0, 0] = -100
    ref = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(3, 5)
    w = torch.rand(3, 5)
    (ref * w).sum().backward()
    local = shard(logits.detach(), -1, rank, world).requires_grad_()
    loss = tp.vocab_parallel_cross_entropy(local, target, process_group=group)
    (loss * w).sum().backward()
    return {
        "loss": diff(loss, ref),
        "grad": diff(local.grad, shard(logits.grad, -1, rank, world)),
        "local_width": float(local.shape[-1]),
    }


def mappings_roundtrip(cfg: dict[str, Any]) -> dict[str, float]:
    """scatter then gather is the identity; gradients of the four operators."""
    mesh = mesh_of(tp=cfg["tp"])
    group, world = mesh.group("tp"), cfg["tp"]
    x = torch.randn(2, 3, 4 * world, requires_grad=True)
    y = tp.gather_from_tensor_parallel_region(tp.scatter_to_tensor_parallel_region(x, group), group)
    y.sum().backward()
    res = {"roundtrip": diff(y, x), "roundtrip_grad": diff(x.grad, torch.ones_like(x))}
    z = torch.ones(3, requires_grad=True)
    tp.copy_to_tensor_parallel_region(z, group).sum().backward()
    res["copy_grad"] = diff(z.grad, torch.full((3,), float(world)))
    r = torch.ones(3, requires_grad=True)
    out = tp.reduce_from_tensor_parallel_region(r, group)
    out.sum().backward()
    res["reduce_out"] = diff(out, torch.full((3,), float(world)))
    res["reduce_grad"] = diff(r.grad, torch.ones(3))
    return res


def rng_tracker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Dropout masks outside / inside the tracker's fork, gathered over the world."""
    mesh = mesh_of(tp=cfg["tp"])
    group = mesh.group("tp")
    tp.model_parallel_manual_seed(1234, process_group=group)
    ones = torch.ones(256)
    outside = F.dropout(ones, 0.5)
    with tp.get_rng_tracker().fork():
        inside = F.dropout(ones, 0.5)
    after = F.dropout(ones, 0.5)
    # the default stream is untouched by the fork
    torch.manual_seed(1234)
    plain = [F.dropout(ones, 0.5), F.dropout(ones, 0.5)]
    world = dist.get_world_size()
    masks = {}
    for key, m in (("outside", outside), ("inside", inside)):
        parts = [torch.empty_like(m) for _ in range(world)]
        dist.all_gather(parts, m)
        masks[key] = torch.stack(parts)
    missing = ""
    tp.get_rng_tracker().reset()
    try:
        with tp.get_rng_tracker().fork():
            pass
    except KeyError as err:
        missing = str(err)
    return {
        "masks": masks,
        "coords": mesh.coordinates,
        "stream_kept": float(torch.equal(outside, plain[0]) and torch.equal(after, plain[1])),
        "missing": missing,
    }


# GPT -----------------------------------------------------------------------------------------
TINY = {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32}


def _full_grads(model: nn.Module, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        if tp.is_tensor_parallel(p):
            out[name] = full_tensor(p.grad, p.partition_dim, group, p.partition_stride)
        else:
            out[name] = p.grad.detach().clone()
    return out


def _full_params(model: nn.Module, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if tp.is_tensor_parallel(p):
            out[name] = full_tensor(p, p.partition_dim, group, p.partition_stride)
        else:
            out[name] = p.detach().clone()
    return out


def gpt_parity(cfg: dict[str, Any]) -> dict[str, Any]:
    """The GPT with gpt_plan against the plain GPT: loss, logits and every gradient."""
    mesh = mesh_of(tp=cfg["tp"])
    group = mesh.group("tp")
    ref = GPT(GPTConfig(**TINY))
    model = tp.parallelize(copy.deepcopy(ref), tp.gpt_plan(cfg["loss_parallel"]), group)
    idx = torch.randint(0, TINY["vocab_size"], (2, 12))
    targets = torch.randint(0, TINY["vocab_size"], (2, 12))
    ref_logits, ref_loss = ref(idx, targets)
    assert ref_loss is not None
    ref_loss.backward()
    if cfg["loss_parallel"]:
        logits, _ = model(idx)
        loss = tp.vocab_parallel_cross_entropy(logits, targets, group).mean()
        logits = full_tensor(logits, -1, group)
    else:
        logits, loss_opt = model(idx, targets)
        assert loss_opt is not None
        loss = loss_opt
    loss.backward()
    grads, ref_grads = _full_grads(model, group), dict(ref.named_parameters())
    assert sorted(grads) == sorted(ref_grads), (sorted(grads), sorted(ref_grads))
    return {
        "loss": abs(float(loss) - float(ref_loss)),
        "logits": diff(logits, ref_logits),
        "grads": {n: diff(g, ref_grads[n].grad) for n, g in grads.items()},
        "tied": float(model.lm_head.weight is model.wte.weight),
        "local_qkv_rows": float(model.blocks[0].attn.qkv.weight.shape[0]),
        "n_head": float(model.blocks[0].attn.n_head),
    }


def plan_errors(cfg: dict[str, Any]) -> dict[str, str]:
    """Uneven splits and plan mistakes: the error messages."""
    mesh = mesh_of(tp=cfg["tp"])
    group = mesh.group("tp")
    out = {}
    cases: dict[str, Callable[[], object]] = {
        "heads": lambda: tp.parallelize(
            GPT(GPTConfig(**{**TINY, "n_head": 2, "n_embd": 32})), tp.gpt_plan(), group
        ),
        "vocab": lambda: tp.parallelize(
            GPT(GPTConfig(**{**TINY, "vocab_size": 66})), tp.gpt_plan(), group
        ),
        "typo": lambda: tp.parallelize(
            GPT(GPTConfig(**TINY)), {"blocks.*.mlp.9": tp.ColumnParallel()}, group
        ),
        "type": lambda: tp.parallelize(GPT(GPTConfig(**TINY)), {"wte": tp.ColumnParallel()}, group),
    }
    for key, fn in cases.items():
        try:
            fn()
            out[key] = "no error"
        except (ValueError, TypeError) as err:
            out[key] = f"{type(err).__name__}: {err}"
    return out


# composition -----------------------------------------------------------------------------------
STEPS, BATCH, SEQ, LR = 3, 4, 12, 0.2


def _batches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, TINY["vocab_size"], (STEPS, BATCH, SEQ), generator=g)
    tgt = torch.randint(0, TINY["vocab_size"], (STEPS, BATCH, SEQ), generator=g)
    return idx, tgt


def _train_reference(
    ref: nn.Module, clip: float | None = None, norms: list[float] | None = None
) -> list[float]:
    """The plain model's losses over STEPS SGD steps; with ``clip``, the gradient norm
    of each step before clipping is appended to ``norms``."""
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    idx, tgt = _batches()
    losses = []
    for s in range(STEPS):
        _, loss = ref(idx[s], tgt[s])
        loss.backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            if norms is not None:
                norms.append(float(norm))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _dp_mean(value: float, group: dist.ProcessGroup) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return float(t) / dist.get_world_size(group)


def tp_with_data_parallel(cfg: dict[str, Any]) -> dict[str, Any]:
    """TP x FSDP or TP x ShardedDDP/OSS: 2-D parity with the plain GPT over STEPS steps.

    The data-parallel wrapper takes the mesh's data-parallel group; each data-parallel
    rank trains on its rows of the global batch (DDP semantics: gradients averaged).
    """
    from shardkit.nn import FullyShardedDataParallel, ShardedDataParallel
    from shardkit.optim import OSS

    mesh = mesh_of(tp=cfg["tp"], dp_replicate=cfg.get("dp_replicate", 1))
    tpg, dpg = mesh.group("tp"), mesh.group("dp")
    dp_rank, dp = mesh.local_rank("dp"), mesh.size("dp")
    ref = GPT(GPTConfig(**TINY))
    model = tp.parallelize(copy.deepcopy(ref), tp.gpt_plan(), tpg)
    split = {
        n: (p.partition_dim, p.partition_stride)
        for n, p in model.named_parameters(remove_duplicate=False)
        if tp.is_tensor_parallel(p)
    }
    ref_norms: list[float] = []
    ref_losses = _train_reference(ref, cfg.get("clip"), ref_norms)
    wrapped: nn.Module
    if cfg["wrapper"] in ("fsdp", "hsdp"):
        from shardkit.models.gpt import Block
        from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy

        kwargs: dict[str, Any] = {"process_group": dpg}
        if cfg["wrapper"] == "hsdp":  # shard inside dp_shard, replicate across dp_replicate
            kwargs = {
                "process_group": (mesh.group("dp_shard"), mesh.group("dp_replicate")),
                "sharding_strategy": "HYBRID_SHARD",
            }
        if cfg.get("nested"):  # one unit per block, as the main job wraps
            with enable_wrap(wrapper_cls=FullyShardedDataParallel, **kwargs):
                model = auto_wrap(model, transformer_auto_wrap_policy({Block}))
        wrapped = FullyShardedDataParallel(model, **kwargs)
        opt: torch.optim.Optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    else:
        opt = OSS(model.parameters(), torch.optim.SGD, process_group=dpg, lr=LR)
        wrapped = ShardedDataParallel(model, opt, process_group=dpg)
    idx, tgt = _batches()
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    losses, norms = [], []
    for s in range(STEPS):
        _, loss = wrapped(idx[s, rows], tgt[s, rows])
        loss.backward()
        if cfg.get("clip") is not None and isinstance(wrapped, FullyShardedDataParallel):
            norms.append(float(wrapped.clip_grad_norm_(cfg["clip"])))  # the root's
        elif cfg.get("clip") is not None:  # each dp rank clips the gradients it owns
            assert isinstance(opt, OSS)
            norm = tp.clip_grad_norm_(opt.local_params(), cfg["clip"], 2.0, tpg, shard_group=dpg)
            norms.append(float(norm))
        opt.step()
        opt.zero_grad()
        losses.append(_dp_mean(float(loss), dpg))
    state = wrapped.state_dict() if cfg["wrapper"] != "sdp" else model.state_dict()
    full = {}
    for name, value in state.items():
        if name in split:
            dim, stride = split[name]
            value = full_tensor(value, dim, tpg, stride)
        full[name] = value
    ref_state = ref.state_dict()
    assert sorted(full) == sorted(ref_state), (sorted(full), sorted(ref_state))
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "params": {n: diff(full[n], ref_state[n]) for n in ref_state},
        "norms": norms,
        "ref_norms": ref_norms,
    }


def oss_clip_refused(cfg: dict[str, Any]) -> dict[str, str]:
    """OSS over the data-parallel group of a tensor-parallel GPT: ``clip_grad_norm``
    would sum its group's part only; the error message (or the norm it returned)."""
    from shardkit.optim import OSS

    mesh = mesh_of(tp=cfg["tp"])
    model = tp.parallelize(GPT(GPTConfig(**TINY)), tp.gpt_plan(), mesh.group("tp"))
    opt = OSS(model.parameters(), torch.optim.SGD, process_group=mesh.group("dp"), lr=LR)
    idx, tgt = _batches()
    model(idx[0], tgt[0])[1].backward()
    try:
        return {"result": f"norm {float(opt.clip_grad_norm(0.5))}"}
    except ValueError as err:
        return {"result": str(err)}


def clip_parity(cfg: dict[str, Any]) -> dict[str, Any]:
    """tp.clip_grad_norm_ against torch's on the plain GPT: total norm, clipped grads."""
    mesh = mesh_of(tp=cfg["tp"])
    group = mesh.group("tp")
    ref = GPT(GPTConfig(**TINY))
    model = tp.parallelize(copy.deepcopy(ref), tp.gpt_plan(), group)
    idx, tgt = _batches()
    out = {}
    for norm_type in (1.0, 2.0, float("inf")):
        for m in (ref, model):
            m.zero_grad()
            m(idx[0], tgt[0])[1].backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
        got = tp.clip_grad_norm_(model.parameters(), 0.05, norm_type, group)
        grads, ref_params = _full_grads(model, group), dict(ref.named_parameters())
        out[norm_type] = {
            "total": abs(float(got) - float(want)) / float(want),
            "clipped": float(want) > 0.05,
            "grads": max(diff(g, ref_params[n].grad) for n, g in grads.items()),
        }
    return out


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def three_d(cfg: dict[str, Any]) -> dict[str, Any]:
    """pp 2 x dp 2 x tp 2 on 8 ranks: the tensor-parallel GPT cut into two pipeline
    stages (ScheduleGPipe, 2 micro-batches), gradients averaged over the data-parallel
    group by hand (DDP semantics), against the plain GPT on the global batch.

    The LM head is untied first (a weight used by the first and the last stage would
    need Megatron-LM's embedding group, which the pipeline does not have)."""
    from shardkit.models.gpt import gpt_stages
    from shardkit.nn import PipelineStage, ScheduleGPipe

    mesh = mesh_of(pp=2, tp=2)
    tpg, ppg, dpg = mesh.group("tp"), mesh.group("pp"), mesh.group("dp")
    dp_rank, dp, stage_idx = mesh.local_rank("dp"), mesh.size("dp"), mesh.coordinates["pp"]
    ref = GPT(GPTConfig(**TINY))
    ref.lm_head.weight = nn.Parameter(ref.wte.weight.detach().clone())
    model = tp.parallelize(copy.deepcopy(ref), tp.gpt_plan(), tpg)
    stages = gpt_stages(model)
    half = len(stages) // 2
    part = nn.Sequential(*(stages[:half] if stage_idx == 0 else stages[half:]))
    schedule = ScheduleGPipe(PipelineStage(part, process_group=ppg), chunks=2, loss_fn=_lm_loss)
    opt = torch.optim.SGD(part.parameters(), lr=LR)
    ref_losses = _train_reference(ref)
    idx, tgt = _batches()
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    losses = []
    for s in range(STEPS):
        loss = schedule.step(
            idx[s, rows] if stage_idx == 0 else None,
            target=tgt[s, rows] if stage_idx == 1 else None,
        )
        for p in part.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad, group=dpg)
            p.grad /= dp
        opt.step()
        opt.zero_grad()
        if loss is not None:
            losses.append(_dp_mean(float(loss.detach()), dpg))
    mine = {id(p) for p in part.parameters()}
    ref_state = dict(ref.named_parameters())
    params = {}
    for name, p in model.named_parameters():
        if id(p) in mine:
            full = (
                full_tensor(p, p.partition_dim, tpg, p.partition_stride)
                if tp.is_tensor_parallel(p)
                else p
            )
            params[name] = diff(full, ref_state[name])
    return {"losses": losses, "ref_losses": ref_losses, "params": params, "stage": stage_idx}


# checkpoints and memory ----------------------------------------------------------------------
def _trained_tp_gpt(group: dist.ProcessGroup) -> tuple[nn.Module, torch.Tensor]:
    """A TP GPT after one SGD step (weights away from their init), and a batch."""
    model = tp.parallelize(GPT(GPTConfig(**TINY)), tp.gpt_plan(), group)
    idx, tgt = _batches()
    model(idx[0], tgt[0])[1].backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return model, idx[1]


def checkpoints(cfg: dict[str, Any]) -> dict[str, Any]:
    """Consolidated and sharded state dicts across degrees: TP 2 -> plain, -> TP 4,
    -> TP 2; TP 2 x DP 2 -> FSDP over 4 data-parallel ranks."""
    from shardkit.nn import FullyShardedDataParallel
    from shardkit.nn.tensor_parallel import state_dict as tsd

    mesh2, mesh4 = mesh_of(tp=2), mesh_of(tp=4)
    g2, g4 = mesh2.group("tp"), mesh4.group("tp")
    model, idx = _trained_tp_gpt(g2)
    want_logits = model(idx)[0]
    full = tsd.consolidated_state_dict(model, g2)
    out: dict[str, Any] = {}
    plain = GPT(GPTConfig(**TINY))
    plain.load_state_dict(full)  # strict: the plain model's keys and shapes
    out["consolidated->plain"] = diff(plain(idx)[0], want_logits)

    if mesh2.coordinates["dp_shard"] == 0:
        tsd.save_sharded(model, cfg["dir"], g2)
    dist.barrier()
    out["files"] = sorted(p.name for p in Path(cfg["dir"]).iterdir())

    plain1 = GPT(GPTConfig(**TINY))
    tsd.load_sharded(plain1, cfg["dir"])
    out["sharded tp2->plain"] = max(diff(plain1.state_dict()[k], v) for k, v in full.items())

    tp4 = tp.parallelize(GPT(GPTConfig(**TINY)), tp.gpt_plan(), g4)
    tsd.load_sharded(tp4, cfg["dir"], g4)
    back = tsd.consolidated_state_dict(tp4, g4)
    out["sharded tp2->tp4"] = max(diff(back[k], v) for k, v in full.items())
    out["tp4 logits"] = diff(tp4(idx)[0], want_logits)

    tp2 = tp.parallelize(GPT(GPTConfig(**TINY)), tp.gpt_plan(), g2)
    tsd.load_consolidated_state_dict(tp2, full, g2)
    out["consolidated->tp2"] = max(
        diff(a, b)
        for a, b in zip(tp2.state_dict().values(), model.state_dict().values(), strict=True)
    )

    plain_dp = GPT(GPTConfig(**TINY))
    tsd.load_sharded(plain_dp, cfg["dir"])
    fsdp = FullyShardedDataParallel(plain_dp, process_group=mesh_of(tp=1).group("dp"))
    out["tp2xdp2->fsdp dp4 logits"] = diff(fsdp(idx)[0], want_logits)
    return out


def memory_per_rank(cfg: dict[str, Any]) -> dict[str, float]:
    """shardkit.memory on a TP GPT: 1/T of the split weights, all of the replicas."""
    from shardkit.memory import model_state_bytes

    t = cfg["tp"]
    group = mesh_of(tp=t).group("tp")
    plain = GPT(GPTConfig(**TINY))
    split = ("wte.weight", "attn.qkv.", "attn.proj.weight", "mlp.0.", "mlp.2.weight")
    expected = sum(
        p.numel() * 4 / (t if any(s in n for s in split) else 1)
        for n, p in plain.named_parameters()
    )
    model = tp.parallelize(copy.deepcopy(plain), tp.gpt_plan(), group)
    return {
        "got": float(model_state_bytes(model).parameters),
        "expected": expected,
        "plain": float(model_state_bytes(plain).parameters),
    }


def hf_gpt2_parity(cfg: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face GPT2LMHeadModel with hf_gpt2_plan against the plain one: loss,
    logits and every gradient (Conv1D weights compared transposed)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    group = mesh_of(tp=cfg["tp"]).group("tp")
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    ref = GPT2LMHeadModel(config)
    model = tp.parallelize(copy.deepcopy(ref), tp.hf_gpt2_plan(cfg["loss_parallel"]), group)
    idx = torch.randint(0, 64, (2, 12))
    ref_out = ref(input_ids=idx, labels=idx)
    ref_out.loss.backward()
    if cfg["loss_parallel"]:
        logits = model(input_ids=idx).logits
        loss = tp.vocab_parallel_cross_entropy(logits[:, :-1], idx[:, 1:], group).mean()
        logits = full_tensor(logits, -1, group)
    else:
        out = model(input_ids=idx, labels=idx)
        logits, loss = out.logits, out.loss
    loss.backward()
    ref_params = dict(ref.named_parameters())
    grads = {}
    for name, g in _full_grads(model, group).items():
        want = ref_params[name].grad
        conv1d = name.endswith(".weight") and any(k in name for k in ("c_attn", "c_proj", "c_fc"))
        grads[name] = diff(g.t() if conv1d else g, want)
    assert sorted(grads) == sorted(ref_params)
    return {
        "loss": abs(float(loss) - float(ref_out.loss)),
        "logits": diff(logits, ref_out.logits),
        "grads": grads,
        "tied": float(model.lm_head.weight is model.transformer.wte.weight),
    }


def communication_count(cfg: dict[str, Any]) -> dict[str, Any]:
    """Elements moved by each collective in one forward and one backward of the TP GPT
    (``torch.distributed`` wrapped for the duration): Megatron-LM's count is 2
    all-reduces of ``b x s x h`` per layer in forward and 2 in backward."""
    group = mesh_of(tp=cfg["tp"]).group("tp")
    model = tp.parallelize(GPT(GPTConfig(**TINY)), tp.gpt_plan(cfg["loss_parallel"]), group)
    idx, tgt = _batches()
    counts: dict[str, list[int]] = {}
    phase = ["forward"]
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def counting(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = args[1] if name == "all_gather" else args[0]
            counts.setdefault(f"{phase[0]} {name}", []).append(tensor.numel())
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        if cfg["loss_parallel"]:
            logits, _ = model(idx[0])
            loss = tp.vocab_parallel_cross_entropy(logits, tgt[0], group).mean()
        else:
            loss = model(idx[0], tgt[0])[1]
        phase[0] = "backward"
        loss.backward()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return counts


def _gather_tp(t: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def dropout_streams(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT with dropout at tp 2, all heads made identical: without fork_rng the ranks'
    (identical) heads get the same attention-dropout masks; with it, different ones,
    while the MLP's dropout (replicated region) stays the same on both ranks."""
    group = mesh_of(tp=2).group("tp")
    idx, tgt = _batches()
    out: dict[str, Any] = {}
    for fork in (False, True):
        torch.manual_seed(0)
        plain = GPT(GPTConfig(**{**TINY, "dropout": 0.3}))
        h, c = TINY["n_head"], TINY["n_embd"]
        with torch.no_grad():
            for block in plain.blocks:
                w = block.attn.qkv.weight.view(3, h, c // h, c)
                w.copy_(w[:, :1].expand_as(w).clone())
        model = tp.parallelize(plain, tp.gpt_plan(fork_rng=fork), group).train()
        tp.model_parallel_manual_seed(11, group)
        before = tp.get_rng_tracker().get_states()["model-parallel-rng"]["cpu"].clone()
        seen: dict[str, torch.Tensor] = {}
        model.blocks[0].attn.proj.register_forward_hook(
            lambda m, a, o, seen=seen: seen.__setitem__("attn", a[0].detach())
        )
        model.blocks[0].mlp[3].register_forward_hook(
            lambda m, a, o, seen=seen: seen.__setitem__("mlp", o.detach())
        )
        loss = model(idx[0], tgt[0])[1]
        loss.backward()
        after = tp.get_rng_tracker().get_states()["model-parallel-rng"]["cpu"]
        attn, mlp = _gather_tp(seen["attn"], group), _gather_tp(seen["mlp"], group)
        out[f"fork={fork}"] = {
            "attn_equal_across_tp": float(torch.equal(attn[0], attn[1])),
            "mlp_equal_across_tp": float(torch.equal(mlp[0], mlp[1])),
            "mlp_has_drops": float((seen["mlp"] == 0).float().mean()),
            "tracker_advanced": float(not torch.equal(before, after)),
        }
    return out
