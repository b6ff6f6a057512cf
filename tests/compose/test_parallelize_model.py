"""parallelize_model on 4 ranks: every mesh of the small GPT follows the plain model.

Each config trains the tiny GPT (2 layers) for 2 SGD steps on the same global batch of
8 rows as the plain GPT trained in the same process: the first-step loss and every
parameter after 2 steps (gathered back to full tensors) agree within 1e-5 in fp32.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardkit.compose import ParallelModel, PipelineSplit, parallelize_model
from shardkit.distributed.mesh import ParallelDims, ProcessMesh
from shardkit.models import GPT, Block, GPTConfig, gpt_stages
from shardkit.nn import tensor_parallel as tp
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel, MixedPrecision

ROWS, SEQ, STEPS, LR = 8, 16, 2, 0.5
CONFIG = GPTConfig(vocab_size=64, block_size=SEQ, n_layer=2, n_head=4, n_embd=32)

# (pp, dp_replicate, dp_shard, tp, activation checkpointing, data_parallel)
Mesh = tuple[int, int, int, int, bool, str]
MESHES_4: list[Mesh] = [
    (1, 1, 4, 1, False, "fsdp"),  # FSDP
    (1, 2, 2, 1, True, "fsdp"),  # hybrid sharding, checkpointed units
    (1, 4, 1, 1, False, "fsdp"),  # hybrid with shard groups of 1: replication
    (1, 2, 2, 1, False, "ddp"),  # torch DDP over dp
    (1, 1, 2, 2, True, "fsdp"),  # tp x FSDP
    (1, 2, 1, 2, False, "ddp"),  # tp x DDP
    (1, 1, 1, 4, False, "fsdp"),  # tp alone, FSDP over one rank
    (2, 1, 2, 1, False, "ddp"),  # pipeline x dp (stages replicated)
    (2, 1, 1, 2, True, "ddp"),  # pipeline x tp
    (4, 1, 1, 1, False, "ddp"),  # pipeline alone
]


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        xy = torch.randint(0, CONFIG.vocab_size, (ROWS, SEQ + 1), generator=g)
        out.append((xy[:, :-1], xy[:, 1:]))
    return out


def _plain() -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    first = 0.0
    for i, (x, y) in enumerate(_batches()):
        opt.zero_grad()
        _, loss = model(x, targets=y)
        loss.backward()
        opt.step()
        first = loss.item() if i == 0 else first
    return first, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _full_state(pm: ParallelModel, model: GPT) -> dict[str, torch.Tensor]:
    """This rank's parameters as full tensors under the plain GPT's keys."""
    module = pm.module
    if isinstance(module, FullyShardedDataParallel):
        state = module.state_dict()  # a collective; tensor-parallel parts under plain keys
    else:
        inner = getattr(module, "module", module)  # DDP's
        if pm.stage is None:
            state = inner.state_dict()
        else:  # the stage's keys (of gpt_stages) to the GPT's, by tensor identity
            key = {id(t): k for k, t in reversed(model.state_dict(keep_vars=True).items())}
            state = {key[id(t)]: t for t in inner.state_dict(keep_vars=True).values()}
    full = {}
    for k in sorted(state):  # the same order on every rank of a tensor-parallel group
        value = state[k].detach()
        if k in pm.split_tensors:
            dim, stride = pm.split_tensors[k]
            value = tp.full_tensor(value, dim, pm.mesh.group("tp"), stride)
        full[k] = value
    return full


def _train(pm: ParallelModel, mesh: ProcessMesh) -> float:
    """2 SGD steps on this rank's share of the global batch; the first step's global
    mean loss (the same on every rank)."""
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    dp, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
    rows = ROWS // dp
    first = torch.zeros(())
    for i, (x, y) in enumerate(_batches()):
        x, y = x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]
        opt.zero_grad()
        if pm.stage is None:
            _, loss = pm.module(x, targets=y)
            loss.backward()
            mine = loss.detach()
        else:
            out = pm.pipeline_step(x, y)
            mine = out if out is not None else torch.zeros(())
            pp = mesh.group("pp")  # the last stage's loss to every stage
            dist.broadcast(mine, mesh.ranks("pp")[-1], group=pp)
        opt.step()
        if i == 0:
            first = mine.clone()
    dist.all_reduce(first)  # each loss is its replica's mean over equal row counts
    return first.item() / dist.get_world_size()


def run_meshes(meshes: list[Mesh]) -> list[tuple[float, float]]:
    """On each rank, per mesh: ``(first-step loss - plain's, max |param - plain's|)``."""
    plain_loss, plain_state = _plain()
    out = []
    for pp, dpr, dps, tpd, ckpt, data_parallel in meshes:
        dims = ParallelDims(dist.get_world_size(), pp=pp, dp_replicate=dpr, dp_shard=dps, tp=tpd)
        mesh = ProcessMesh(dims)
        torch.manual_seed(0)
        model = GPT(CONFIG)
        split = PipelineSplit(gpt_stages, _lm_loss, chunks=2) if pp > 1 else None
        pm = parallelize_model(
            model,
            mesh,
            tp_plan=tp.gpt_plan(),
            activation_checkpointing={Block} if ckpt else (),
            fsdp_units={Block},
            pipeline=split,
            data_parallel=data_parallel,  # type: ignore[arg-type]
        )
        first = _train(pm, mesh)
        state = _full_state(pm, model)
        diff = max((state[k] - plain_state[k]).abs().max().item() for k in state)
        out.append((first - plain_loss, diff))
        dist.barrier()
        mesh.destroy()
    return out


def test_every_mesh_of_four_ranks_follows_the_plain_gpt(rank_pool: Any) -> None:
    results = rank_pool(4).run(run_meshes, MESHES_4, timeout_s=300)
    for r, per_rank in enumerate(results):
        for mesh, (loss_diff, param_diff) in zip(MESHES_4, per_rank, strict=True):
            assert abs(loss_diff) < 1e-5, (r, mesh, loss_diff)
            assert param_diff < 1e-5, (r, mesh, param_diff)


def run_refusals() -> list[str]:
    mesh = ProcessMesh(ParallelDims(dist.get_world_size(), pp=2, tp=2))
    messages = []
    calls: list[dict[str, Any]] = [
        {},  # tp 2 without a plan
        {"tp_plan": tp.gpt_plan()},  # pp 2 without a pipeline
        {
            "tp_plan": tp.gpt_plan(),
            "pipeline": PipelineSplit(gpt_stages, _lm_loss),
            "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16),
        },
    ]
    for kwargs in calls:
        with pytest.raises(ValueError) as err:
            parallelize_model(GPT(CONFIG), mesh, **kwargs)
        messages.append(str(err.value))
    mesh.destroy()
    dp_mesh = ProcessMesh(ParallelDims(dist.get_world_size(), pp=2))  # dp_shard 2
    split = PipelineSplit(gpt_stages, _lm_loss)
    for data_parallel in ("fsdp", "none"):
        with pytest.raises(ValueError) as err:
            parallelize_model(GPT(CONFIG), dp_mesh, pipeline=split, data_parallel=data_parallel)
        messages.append(str(err.value))
    dp_mesh.destroy()
    return messages


def test_refusals_name_the_degrees(rank_pool: Any) -> None:
    (no_plan, no_pipeline, precision, sharded_stage, bare_stage), *_ = rank_pool(4).run(
        run_refusals, timeout_s=60
    )
    assert "has tp 2 but no tp_plan" in no_plan, no_plan
    assert "pp 2 x dp_replicate 1 x dp_shard 1 x tp 2" in no_plan, no_plan
    assert "has pp 2 but no pipeline was given" in no_pipeline, no_pipeline
    assert "mixed_precision is FSDP's policy but data_parallel='fsdp'" in precision, precision
    assert "data_parallel='fsdp' with a pipeline (pp 2 x dp_replicate 1 x dp_shard 2" in (
        sharded_stage
    ), sharded_stage
    assert "a stage is replicated over its 2 data-parallel ranks" in sharded_stage
    assert "data_parallel='none' with a pipeline" in bare_stage, bare_stage
