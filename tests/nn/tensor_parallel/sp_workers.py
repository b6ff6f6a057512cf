"""Rank-side workers of the sequence-parallelism tests (Megatron-LM's sequence
parallelism inside tensor parallel).

Each worker builds the plain model, the tensor-parallel one without and with
sequence parallelism from the same seed, and returns plain numbers (maximum
differences) and short strings, so the test file asserts on values. The helpers of
the tensor-parallel workers (meshes, full gradients) are reused.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardkit.models.gpt import GPT, Block, GPTConfig
from shardkit.nn import tensor_parallel as tp
from shardkit.nn.checkpoint import checkpoint_wrapper
from shardkit.nn.tensor_parallel.partition import full_tensor, shard
from tests.nn.tensor_parallel.tp_workers import (
    TINY,
    _full_grads,
    _full_params,
    _gather_tp,
    diff,
    mesh_of,
    run_named,
)

BATCH, SEQ, STEPS, MICRO, LR = 2, 12, 2, 2, 0.3
#: the replicated parameters that run on sequence chunks (their gradients are summed)
CHUNK_PARAMS = ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "proj.bias", "mlp.2.bias")


def run_jobs(jobs: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """:func:`~tests.nn.tensor_parallel.tp_workers.run_named` over this module's workers."""
    return run_named(globals(), jobs)


def _data(seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    shape = (STEPS, MICRO, BATCH, seq)
    return torch.randint(0, TINY["vocab_size"], shape, generator=g), torch.randint(
        0, TINY["vocab_size"], shape, generator=g
    )


def _loss(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor, lp: bool, group: Any) -> Any:
    if not lp:
        logits, loss = model(idx, tgt)
        return logits, loss
    logits, _ = model(idx)
    loss = tp.vocab_parallel_cross_entropy(logits, tgt, group).mean()
    return full_tensor(logits, -1, group), loss


def _replicas_agree(model: nn.Module, group: dist.ProcessGroup) -> float:
    """1.0 when every replicated (not split) gradient is bitwise the same on every
    tensor-parallel rank."""
    for p in model.parameters():
        if not tp.is_tensor_parallel(p):
            assert p.grad is not None
            parts = _gather_tp(p.grad, group)
            if not all(torch.equal(parts[0], q) for q in parts[1:]):
                return 0.0
    return 1.0


def sp_gpt_parity(cfg: dict[str, Any]) -> dict[str, Any]:
    """Plain GPT, TP GPT and TP + SP GPT from the same weights: first micro-batch's loss,
    logits and every gradient (SP against TP and against plain); then STEPS SGD steps of
    MICRO accumulated micro-batches each, the parameters compared after them."""
    group = mesh_of(tp=cfg["tp"]).group("tp")
    lp = cfg["loss_parallel"]
    ref = GPT(GPTConfig(**TINY))
    split = tp.parallelize(copy.deepcopy(ref), tp.gpt_plan(lp), group)
    seq = tp.parallelize(copy.deepcopy(ref), tp.gpt_plan(lp, sequence_parallel=True), group)
    idx, tgt = _data()
    out: dict[str, Any] = {}
    models = {"ref": ref, "tp": split, "sp": seq}
    opts = {k: torch.optim.SGD(m.parameters(), lr=LR) for k, m in models.items()}
    for step in range(STEPS):
        for micro in range(MICRO):
            first = step == 0 and micro == 0
            logits = {}
            for key, model in models.items():
                lg, loss = _loss(
                    model, idx[step, micro], tgt[step, micro], lp and key != "ref", group
                )
                (loss / MICRO).backward()
                logits[key] = (lg, loss.detach())
            if first:
                out["loss_sp_tp"] = abs(float(logits["sp"][1]) - float(logits["tp"][1]))
                out["loss_sp_ref"] = abs(float(logits["sp"][1]) - float(logits["ref"][1]))
                out["logits_sp_tp"] = diff(logits["sp"][0], logits["tp"][0])
                out["logits_sp_ref"] = diff(logits["sp"][0], logits["ref"][0])
        if step == 0:  # the gradients of MICRO accumulated micro-batches
            g_sp, g_tp = _full_grads(seq, group), _full_grads(split, group)
            g_ref = {n: p.grad for n, p in ref.named_parameters()}
            out["grads_sp_tp"] = {n: diff(g, g_tp[n]) for n, g in g_sp.items()}
            out["grads_sp_ref"] = {n: diff(g, g_ref[n]) for n, g in g_sp.items()}
            out["replicas_agree"] = _replicas_agree(seq, group)
        for opt in opts.values():
            opt.step()
            opt.zero_grad()
    p_sp, p_tp = _full_params(seq, group), _full_params(split, group)
    out["params_sp_tp"] = max(diff(p, p_tp[n]) for n, p in p_sp.items())
    out["params_sp_ref"] = max(diff(p, dict(ref.named_parameters())[n]) for n, p in p_sp.items())
    out["ln_class"] = type(seq.blocks[0].ln_1).__name__
    out["tied"] = float(seq.lm_head.weight is seq.wte.weight)
    return out


def _block_plan(sp: bool) -> dict[str, tp.plan.ParallelStyle]:
    """The GPT plan's entries for one Block, relative to the block."""
    gpt = tp.gpt_plan(sequence_parallel=sp)
    return {k.removeprefix("blocks.*."): v for k, v in gpt.items() if k.startswith("blocks.*.")}


def sp_block_parity(cfg: dict[str, Any]) -> dict[str, Any]:
    """One GPT block on a sequence chunk (the plan's block entries) against the plain
    block on the whole sequence: output chunk, input-chunk gradient, every parameter's
    gradient; the LayerNorm gradients also against the plain block's exactly summed."""
    group = mesh_of(tp=cfg["tp"]).group("tp")
    rank, world = dist.get_rank(group), cfg["tp"]
    config = GPTConfig(**TINY)
    ref = Block(config)
    block = tp.parallelize(copy.deepcopy(ref), _block_plan(True), group)
    x = torch.randn(BATCH, SEQ, TINY["n_embd"], requires_grad=True)
    g = torch.randn(BATCH, SEQ, TINY["n_embd"])
    y_ref = ref(x)
    (y_ref * g).sum().backward()
    chunk = x.detach().chunk(world, dim=1)[rank].clone().requires_grad_()
    y = block(chunk)
    (y * g.chunk(world, dim=1)[rank]).sum().backward()
    assert chunk.grad is not None and x.grad is not None
    grads = _full_grads(block, group)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    return {
        "out": diff(y, y_ref.chunk(world, dim=1)[rank]),
        "input_grad": diff(chunk.grad, x.grad.chunk(world, dim=1)[rank]),
        "grads": {n: diff(gr, ref_grads[n]) for n, gr in grads.items()},
        "out_rows": float(y.shape[1]),
        "replicas_agree": _replicas_agree(block, group),
    }


def sp_layers(cfg: dict[str, Any]) -> dict[str, float]:
    """ColumnParallelLinear -> GELU -> RowParallelLinear with sequence_parallel against
    two nn.Linear: this rank's output chunk, its input-chunk gradient and every weight
    and bias gradient; the mappings' round trip."""
    group = mesh_of(tp=cfg["tp"]).group("tp")
    rank, world = dist.get_rank(group), cfg["tp"]
    fc, proj = nn.Linear(8, 16), nn.Linear(16, 8)
    x = torch.randn(3, 4 * world, 8, requires_grad=True)
    y_ref = proj(F.gelu(fc(x)))
    g = torch.randn_like(y_ref)
    (y_ref * g).sum().backward()
    col = tp.ColumnParallelLinear.from_linear(
        fc, gather_output=False, sequence_parallel=True, process_group=group
    )
    row = tp.RowParallelLinear.from_linear(
        proj, input_is_parallel=True, sequence_parallel=True, process_group=group
    )
    xs = x.detach().chunk(world, dim=1)[rank].clone().requires_grad_()
    y = row(F.gelu(col(xs)))
    (y * g.chunk(world, dim=1)[rank]).sum().backward()
    assert xs.grad is not None and x.grad is not None and col.bias is not None
    assert col.weight.grad is not None and row.weight.grad is not None
    assert row.bias is not None and row.bias.grad is not None and col.bias.grad is not None
    assert fc.bias is not None and proj.bias is not None
    # mappings: scatter then gather is the identity, gradients round-trip
    z = torch.arange(2 * 4 * world * 3, dtype=torch.float32).view(2, 4 * world, 3)
    z.requires_grad_()
    back = tp.gather_from_sequence_parallel_region(
        tp.scatter_to_sequence_parallel_region(z, group), group
    )
    back.sum().backward()
    assert z.grad is not None
    rs = tp.reduce_scatter_to_sequence_parallel_region(torch.ones(2, 2 * world, 3), group)
    return {
        "out": diff(y, y_ref.chunk(world, dim=1)[rank]),
        "input_grad": diff(xs.grad, x.grad.chunk(world, dim=1)[rank]),
        "col_weight": diff(col.weight.grad, shard(fc.weight.grad, 0, rank, world)),
        "col_bias": diff(col.bias.grad, shard(fc.bias.grad, 0, rank, world)),
        "row_weight": diff(row.weight.grad, shard(proj.weight.grad, 1, rank, world)),
        "row_bias": diff(row.bias.grad, proj.bias.grad),
        "roundtrip": diff(back, z),
        # scatter's backward all-gathers, gather's reduce-scatters (a sum over T ranks)
        "roundtrip_grad": diff(z.grad, torch.full_like(z, float(world))),
        "reduce_scatter": diff(rs, torch.full((2, 2, 3), float(world))),
    }


def sp_errors(cfg: dict[str, Any]) -> dict[str, str]:
    """A sequence length not divisible by tp (at the first call), a row-parallel layer
    with sequence_parallel but not input_is_parallel, a SequenceParallel entry on a
    module with parameters: the messages."""
    group = mesh_of(tp=cfg["tp"]).group("tp")
    world = cfg["tp"]
    model = tp.parallelize(GPT(GPTConfig(**TINY)), tp.gpt_plan(sequence_parallel=True), group)
    idx = torch.randint(0, TINY["vocab_size"], (2, 2 * world + 1))
    cases: dict[str, Callable[[], object]] = {
        "seq": lambda: model(idx, idx),
        "row": lambda: tp.RowParallelLinear(8, 8, sequence_parallel=True, process_group=group),
        "type": lambda: tp.parallelize(
            GPT(GPTConfig(**TINY)), {"blocks.*.mlp.0": tp.SequenceParallel()}, group
        ),
    }
    out = {}
    for key, fn in cases.items():
        try:
            fn()
            out[key] = "no error"
        except (ValueError, TypeError) as err:
            out[key] = f"{type(err).__name__}: {err}"
    # the model still works after the refused call (no collective was left half-done)
    ok = torch.randint(0, TINY["vocab_size"], (2, 2 * world))
    out["after"] = "ok" if model(ok, ok)[1] is not None else "no loss"
    return out


def sp_communication_count(cfg: dict[str, Any]) -> dict[str, Any]:
    """Elements moved by each collective in one forward and one backward of the TP GPT
    with and without sequence parallelism (``torch.distributed`` wrapped meanwhile): an
    all-reduce counts its tensor, an all-gather its output, a reduce-scatter its input."""
    group = mesh_of(tp=cfg["tp"]).group("tp")
    idx, tgt = _data()
    result: dict[str, Any] = {}
    for sp in (False, True):
        torch.manual_seed(0)
        plan = tp.gpt_plan(sequence_parallel=sp)
        model = tp.parallelize(GPT(GPTConfig(**TINY)), plan, group)
        result[f"sp={sp}"] = _count(model, idx[0, 0], tgt[0, 0])
    return result


def _count(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> dict[str, list[int]]:
    counts: dict[str, list[int]] = {}
    phase = ["forward"]
    names = ("all_reduce", "all_gather", "all_gather_single", "reduce_scatter_single")
    originals = {name: getattr(dist, name) for name in names}
    position = {"all_reduce": 0, "all_gather": 1, "all_gather_single": 0}

    def counting(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = args[position.get(name, 1)]
            counts.setdefault(f"{phase[0]} {name}", []).append(tensor.numel())
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        loss = model(idx, tgt)[1]
        phase[0] = "backward"
        loss.backward()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return counts


def sp_dropout(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT with dropout under TP + SP: the MLP dropout of each rank's sequence chunk
    draws from the tracker's tensor-parallel stream (masks differ across ranks, the
    tracker advances, the default stream stays the same on every rank); without
    model_parallel_manual_seed the first forward raises the tracker's KeyError."""
    group = mesh_of(tp=cfg["tp"]).group("tp")
    plan = tp.gpt_plan(sequence_parallel=True)
    torch.manual_seed(0)
    model = tp.parallelize(GPT(GPTConfig(**{**TINY, "dropout": 0.5})), plan, group).train()
    idx, tgt = _data()
    tp.get_rng_tracker().reset()
    try:
        model(idx[0, 0], tgt[0, 0])
        missing = "no error"
    except KeyError as err:
        missing = str(err)
    tp.model_parallel_manual_seed(5, group)
    before = tp.get_rng_tracker().get_states()["model-parallel-rng"]["cpu"].clone()
    seen: dict[str, torch.Tensor] = {}
    model.blocks[0].mlp[3].register_forward_hook(
        lambda m, a, o: seen.__setitem__("mask", (o == 0) & (a[0] != 0))
    )
    model(idx[0, 0], tgt[0, 0])[1].backward()
    masks = _gather_tp(seen["mask"].float(), group)
    default = _gather_tp(torch.get_rng_state().float(), group)
    after = tp.get_rng_tracker().get_states()["model-parallel-rng"]["cpu"]
    return {
        "missing": missing,
        "masks_differ": float(not torch.equal(masks[0], masks[1])),
        "drop_rate": float(seen["mask"].float().mean()),
        "tracker_advanced": float(not torch.equal(before, after)),
        "default_same": float(all(torch.equal(default[0], d) for d in default[1:])),
    }


def _saved_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for backward during ``fn()``."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def sp_activation_bytes(cfg: dict[str, Any]) -> dict[str, int]:
    """Activation bytes one GPT block saves for backward, TP without and with SP."""
    group = mesh_of(tp=cfg["tp"]).group("tp")
    rank, world = dist.get_rank(group), cfg["tp"]
    ref = Block(GPTConfig(**TINY))
    blocks = {}
    for sp in (False, True):
        blocks[sp] = tp.parallelize(copy.deepcopy(ref), _block_plan(sp), group)
    x = torch.randn(BATCH, SEQ, TINY["n_embd"], requires_grad=True)
    chunk = x.detach().chunk(world, dim=1)[rank].clone().requires_grad_()
    return {
        "plain": _saved_bytes(lambda: ref(x)),
        "tp": _saved_bytes(lambda: blocks[False](x)),
        "sp": _saved_bytes(lambda: blocks[True](chunk)),
    }


def sp_checkpointed_dropout(cfg: dict[str, Any]) -> dict[str, float]:
    """GPT with dropout under TP + SP (and attention dropout forked too), every block
    checkpoint_wrapper'd against the same model without checkpointing, from the same
    seeds: 2 steps' losses, every gradient and the tracker's state afterwards equal (the
    recompute draws the forward's masks from the tracker's replayed state)."""
    group = mesh_of(tp=cfg["tp"]).group("tp")
    idx, tgt = _data()
    runs = []
    for ac in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{**TINY, "dropout": 0.3}))
        plan = tp.gpt_plan(fork_rng=True, sequence_parallel=True)
        model = tp.parallelize(model, plan, group).train()
        if ac:
            for i, block in enumerate(model.blocks):
                model.blocks[i] = checkpoint_wrapper(block)
        tp.model_parallel_manual_seed(9, group)
        losses = []
        for step in range(2):
            loss = model(idx[step, 0], tgt[step, 0])[1]
            loss.backward()
            losses.append(float(loss.detach()))
        grads = {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }
        tracker = tp.get_rng_tracker().get_states()["model-parallel-rng"]["cpu"].clone()
        runs.append((losses, grads, tracker))
    (l0, g0, t0), (l1, g1, t1) = runs
    return {
        "loss": max(abs(a - b) for a, b in zip(l0, l1, strict=True)),
        "grads": max(diff(g0[n.replace("module.", "")], g) for n, g in g1.items()),
        "n_grads": float(len(g1) == len(g0) == 28),
        "tracker": float(torch.equal(t0, t1)),
    }
