"""Workers of ``test_universal_strategies.py``: save in one layout, load in another.

A *layout* is ``(kind, world)``: a wrapper over the first ``world`` ranks of the pool.
:func:`run_pair` trains a model two steps in layout A next to a plain twin (the
global batch, every rank), saves a universal checkpoint, loads it into layout B built
from another initialisation, and returns on rank 0 what the test checks:

- the consolidated parameters and optimizer state of A and B (assembled from the
  pieces the adapters mark ``write``, each element written exactly once), which must
  be equal exactly;
- A's against the twin's, and B's after one more step against the twin's after one
  more step (to fp32 rounding: the sharded runs sum in another order), which catches
  a key or a range an adapter maps wrongly on both sides alike.

Model families: ``seq`` (an ``nn.Sequential`` MLP with a persistent buffer: every
kind, Pipe and OffloadModel included) and ``gpt`` (the tiny GPT, tied embedding; not
for pipe and offload).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.checkpoint.universal import load_universal, save_universal
from shardkit.checkpoint.universal.adapters import layout_of, model_tensors
from shardkit.checkpoint.universal.optim_state import entry_offset
from shardkit.distributed import mpu
from shardkit.distributed.shard_elements import local_rows, write_range
from shardkit.models import GPT, GPTConfig
from shardkit.nn import (
    FSDP,
    OffloadModel,
    Pipe,
    PipelineStage,
    ScheduleGPipe,
    ShardedDataParallel,
)
from shardkit.nn.pipe import stage_module
from shardkit.nn.tensor_parallel import gpt_plan, parallelize
from shardkit.nn.wrap import auto_wrap, enable_wrap, size_based_auto_wrap_policy
from shardkit.optim import OSS
from tests.nn.data_parallel.fsdp_workers import wrap_model

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
BATCH = 12  # divisible by every data-parallel size 1..4
KINDS_SEQ = ("plain", "ddp", "oss", "sdp", "fsdp", "hsdp", "pipe", "pipe_local", "offload")
TRAIN_STEPS = 2

Consolidated = dict[str, Any]  # {"params": {key: tensor}, "state": {key: {name: tensor}}, ...}


class Scale(nn.Module):
    """``x * scale`` with a persistent buffer (a buffer must travel too)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.rand(n) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def make_model(family: str) -> nn.Module:
    if family == "gpt":
        return GPT(TINY)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Tanh(),
        Scale(16),
        nn.Linear(16, 16),
        nn.LayerNorm(16),
        nn.Linear(16, 4),
    )


def batch(family: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    if family == "gpt":
        idx = torch.randint(0, TINY.vocab_size, (BATCH, TINY.block_size), generator=g)
        return idx, torch.roll(idx, 1, dims=1)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4, weight_decay=0.01)


def loss_of(family: str, model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if family == "gpt":
        return model(x, y)[1]
    return F.mse_loss(model(x), y)


# process groups ------------------------------------------------------------------------
_GROUPS: dict[tuple[int, ...], Any] = {}


def group(ranks: list[int]) -> Any:
    """The group of ``ranks`` (created once; every rank of the pool must call this)."""
    key = tuple(ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks))
    return _GROUPS[key]


def hybrid_pair(world: int, shard: int) -> tuple[Any, Any]:
    """(shard group, replica group) of this rank for shard groups of ``shard``
    consecutive ranks among the first ``world`` (every rank calls it)."""
    rank = dist.get_rank()
    mine: tuple[Any, Any] = (None, None)
    for start in range(0, world, shard):
        g = group(list(range(start, start + shard)))
        if start <= rank < start + shard:
            mine = (g, mine[1])
    for offset in range(shard):
        g = group(list(range(offset, world, shard)))
        if rank < world and rank % shard == offset:
            mine = (mine[0], g)
    return mine


def wrap_twice(base: nn.Module, kind: str, g: Any) -> FSDP:
    """FSDP around a root FSDP unit: ``FSDP(FSDP(base))`` (``fsdp_twice``) or
    FairScale's ``FSDP(auto_wrap(base))`` where the policy wrapped the root and some of
    its children too (``fsdp_auto_twice``)."""
    if kind == "fsdp_twice":
        return FSDP(FSDP(base, process_group=g), process_group=g)
    with enable_wrap(wrapper_cls=FSDP, process_group=g):
        inner = auto_wrap(base, size_based_auto_wrap_policy(100))
    assert isinstance(inner, FSDP), "the policy must wrap the root for this layout"
    assert len(inner.units()) > 1, "the policy must wrap children too"
    return FSDP(inner, process_group=g)


_SOLO: dict[int, list[Any]] = {}  # world -> one group per rank, made by every rank


def tp_dp_groups(world: int) -> tuple[Any, Any, Any]:
    """(tensor-parallel group, data-parallel group, a group of this rank alone) for
    tensor parallel 2 over consecutive ranks of ``world`` (every rank creates every
    group)."""
    rank = dist.get_rank()
    mine: list[Any] = [None, None, None]
    for start in range(0, world, 2):
        g = group([start, start + 1])
        if rank in (start, start + 1):
            mine[0] = g
    for offset in range(2):
        g = group(list(range(offset, world, 2)))
        if rank % 2 == offset:
            mine[1] = g
    if world not in _SOLO:  # not group([r]): others create those on one rank only
        _SOLO[world] = [dist.new_group([r]) for r in range(world)]
    mine[2] = _SOLO[world][rank]
    return mine[0], mine[1], mine[2]


# layouts -------------------------------------------------------------------------------
class Run:
    """A model in one layout on this rank, and how it trains one step."""

    def __init__(self, family: str, kind: str, world: int, base: nn.Module) -> None:
        self.family, self.kind, self.world = family, kind, world
        rank = dist.get_rank()
        self.hybrid = hybrid_pair(world, 2) if kind == "hsdp" and world % 2 == 0 else None
        if kind in ("tp", "tp_fsdp"):
            mpu.initialize_model_parallel(2)
        if kind.startswith("tpg"):
            self.tp_dp = tp_dp_groups(world)
        self.group = group(list(range(world)))
        self.member = rank < world
        self.dp_rank, self.dp_size = (rank, world) if self.member else (0, 1)
        self.stage: PipelineStage | None = None
        if self.member:
            self.model, self.optimizer = self._build(base)

    def _build(self, base: nn.Module) -> tuple[Any, Any]:
        kind, g = self.kind, self.group
        if kind in ("plain", "offload", "pipe_local"):
            self.dp_rank, self.dp_size = 0, 1  # every rank steps the global batch
            model: Any = base
            if kind == "offload":
                model = OffloadModel(base, "cpu", "cpu", num_slices=2)
            if kind == "pipe_local":
                model = Pipe(base, balance=[2, 4], devices=["cpu", "cpu"], chunks=2)
            return model, adamw(model.parameters())
        if kind == "ddp":
            return DistributedDataParallel(base, process_group=g), adamw(base.parameters())
        if kind in ("oss", "sdp"):
            oss = OSS(
                base.parameters(),
                torch.optim.AdamW,
                lr=1e-2,
                eps=1e-4,
                weight_decay=0.01,
                process_group=g,
            )
            if kind == "oss":
                return DistributedDataParallel(base, process_group=g), oss
            return ShardedDataParallel(base, oss, process_group=g), oss
        if kind == "fsdp_nested":  # one unit per GPT block inside the root unit
            model = wrap_model(base, "block", process_group=g)
            return model, adamw(model.parameters())
        if kind == "fsdp":
            model = FSDP(base, process_group=g)
            return model, adamw(model.parameters())
        if kind in ("fsdp_twice", "fsdp_auto_twice"):
            model = wrap_twice(base, kind, g)
            return model, adamw(model.parameters())
        if kind == "hsdp":
            pair = self.hybrid if self.hybrid is not None else (g, group([dist.get_rank()]))
            model = FSDP(base, process_group=pair, sharding_strategy="HYBRID_SHARD")
            return model, adamw(model.parameters())
        if kind == "tp_fsdp":
            parallelize(base, gpt_plan())
            dp = mpu.get_data_parallel_group()
            self.dp_rank, self.dp_size = dist.get_rank(dp), dist.get_world_size(dp)
            model = FSDP(base, process_group=dp)
            return model, adamw(model.parameters())
        if kind == "tp":  # tensor parallel alone (world 2: no data parallelism)
            parallelize(base, gpt_plan())
            dp = mpu.get_data_parallel_group()
            self.dp_rank, self.dp_size = dist.get_rank(dp), dist.get_world_size(dp)
            return base, adamw(base.parameters())
        if kind.startswith("tpg"):
            return self._build_tp_groups(base)
        if kind == "pipe":
            self.dp_rank, self.dp_size = 0, 1
            n = len(base)  # type: ignore[arg-type]
            balance = [n // self.world + (i < n % self.world) for i in range(self.world)]
            part = stage_module(base, balance, dist.get_rank(g))  # type: ignore[arg-type]
            self.stage = PipelineStage(part, process_group=g)
            return self.stage, adamw(part.parameters())
        raise ValueError(f"unknown layout kind {kind!r}")

    def _build_tp_groups(self, base: nn.Module) -> tuple[Any, Any]:
        """Tensor parallel 2 over explicit groups, no mesh registered: ``tpg`` alone (a
        plain module, every tensor-parallel group a whole copy of the model), or under
        DDP, OSS, ShardedDDP, FSDP over the data-parallel group, or hybrid FSDP (shard
        groups of one rank, replicated over the data-parallel group)."""
        assert not mpu.model_parallel_is_initialized(), "these layouts register no mesh"
        tp, dp = self.tp_dp[:2]
        parallelize(base, gpt_plan(), process_group=tp)
        if self.kind == "tpg":
            self.dp_rank, self.dp_size = 0, 1  # every rank steps the global batch
            return base, adamw(base.parameters())
        self.dp_rank, self.dp_size = dist.get_rank(dp), dist.get_world_size(dp)
        if self.kind == "tpg_ddp":
            return DistributedDataParallel(base, process_group=dp), adamw(base.parameters())
        if self.kind in ("tpg_oss", "tpg_sdp"):
            oss = OSS(
                base.parameters(),
                torch.optim.AdamW,
                lr=1e-2,
                eps=1e-4,
                weight_decay=0.01,
                process_group=dp,
            )
            if self.kind == "tpg_sdp":
                return ShardedDataParallel(base, oss, process_group=dp), oss
            return DistributedDataParallel(base, process_group=dp), oss
        if self.kind == "tpg_hsdp":  # shard groups of one rank, replicated over dp
            pair = (self.tp_dp[2], dp)
            model = FSDP(base, process_group=pair, sharding_strategy="HYBRID_SHARD")
            return model, adamw(model.parameters())
        if self.kind == "tpg_fsdp":
            model = FSDP(base, process_group=dp)
            return model, adamw(model.parameters())
        raise ValueError(f"unknown layout kind {self.kind!r}")

    def step(self, step: int) -> None:
        if not self.member:
            return
        x, y = batch(self.family, step)
        rows = BATCH // self.dp_size
        x, y = (
            x[self.dp_rank * rows : (self.dp_rank + 1) * rows],
            y[self.dp_rank * rows : (self.dp_rank + 1) * rows],
        )
        self.optimizer.zero_grad()
        if self.stage is not None:
            stage = self.stage
            schedule = ScheduleGPipe(stage, chunks=2, loss_fn=F.mse_loss)
            schedule.step(x if stage.is_first else None, target=y if stage.is_last else None)
        else:
            loss_of(self.family, self.model, x, y).backward()
        self.optimizer.step()

    def close(self) -> None:
        if self.kind in ("tp", "tp_fsdp"):
            mpu.destroy_model_parallel()


# consolidation from the adapters -------------------------------------------------------
def consolidate(run: Run) -> Consolidated | None:
    """Every written piece of ``run`` gathered and assembled (a collective over its
    group); on rank 0: params, element-wise state, scalar state, writes per element."""
    pieces = []
    if run.member:
        adapter = layout_of(run.model, run.optimizer, group=run.group)
        for e in adapter.entries():
            if not e.write:
                continue
            state: dict[str, torch.Tensor] = {}
            scalars: dict[str, Any] = {}
            if e.param is not None:
                offset, n = entry_offset(e), e.stop - e.start
                for name, value in run.optimizer.state.get(e.param, {}).items():
                    if isinstance(value, torch.Tensor) and value.shape == e.param.shape:
                        state[name] = value.detach().reshape(-1)[offset : offset + n].clone()
                    else:
                        scalars[name] = float(value)
            pieces.append(
                (e.key, e.view, e.start, e.tensor.detach().reshape(-1).clone(), state, scalars)
            )
    if not run.member:
        return None
    every: list[Any] = [None] * run.world
    dist.all_gather_object(every, pieces, group=run.group)
    out: Consolidated = {"params": {}, "count": {}, "state": {}, "scalars": {}}
    for key, view, start, flat, state, scalars in (p for rank_pieces in every for p in rank_pieces):
        for where, name, value in [("params", None, flat)] + [
            ("state", k, v) for k, v in state.items()
        ]:
            table = out[where] if name is None else out[where].setdefault(key, {})
            slot = key if name is None else name
            if slot not in table:
                table[slot] = torch.zeros(view.global_shape, dtype=value.dtype).reshape(-1)
            write_range(local_rows(table[slot], view), start, value)
        if key not in out["count"]:
            out["count"][key] = torch.zeros(view.global_shape, dtype=torch.int64).reshape(-1)
        write_range(
            local_rows(out["count"][key], view), start, torch.ones(flat.numel(), dtype=torch.int64)
        )
        for name, value in scalars.items():
            out["scalars"].setdefault(key, {})[name] = value
    return out if dist.get_rank() == 0 else None


def reference(model: nn.Module, optimizer: torch.optim.Optimizer) -> Consolidated:
    """The plain twin's parameters and optimizer state under its first keys."""
    out: Consolidated = {"params": {}, "state": {}, "scalars": {}}
    for key, tensor, is_param in model_tensors(model):
        out["params"][key] = tensor.detach().reshape(-1).clone()
        for name, value in optimizer.state.get(tensor, {}).items() if is_param else ():
            if isinstance(value, torch.Tensor) and value.shape == tensor.shape:
                out["state"].setdefault(key, {})[name] = value.detach().reshape(-1).clone()
            else:
                out["scalars"].setdefault(key, {})[name] = float(value)
    return out


def train_and_save(
    spec_a: tuple[str, str, int], root: str, seed: int
) -> tuple[Consolidated | None, nn.Module, torch.optim.Optimizer]:
    """Train layout ``spec_a`` = (family, kind, world) and its plain twin for
    :data:`TRAIN_STEPS` steps from the same seeded model, save layout A to ``root``.
    Returns A's consolidated state (rank 0; as :func:`consolidate`), the twin and its
    optimizer."""
    family, kind_a, world_a = spec_a
    torch.manual_seed(seed)
    base = make_model(family)
    twin = copy.deepcopy(base)
    twin_opt = adamw(twin.parameters())
    run_a = Run(family, kind_a, world_a, copy.deepcopy(base))
    for step in range(TRAIN_STEPS):
        run_a.step(step)
        x, y = batch(family, step)
        twin_opt.zero_grad()
        loss_of(family, twin, x, y).backward()
        twin_opt.step()
    if run_a.member:
        save_universal(root, TRAIN_STEPS, run_a.model, run_a.optimizer, group=run_a.group)
    saved = consolidate(run_a)
    run_a.close()
    return saved, twin, twin_opt


def run_pair(
    spec_a: tuple[str, str, int], spec_b: tuple[str, int], root: str, seed: int = 0
) -> dict[str, Any] | None:
    """Train in layout A, save to ``root``, load into layout B, step once more (see the
    module docstring). ``spec_a``: (family, kind, world); ``spec_b``: (kind, world)."""
    family = spec_a[0]
    kind_b, world_b = spec_b
    saved, twin, twin_opt = train_and_save(spec_a, root, seed)
    want_saved = reference(twin, twin_opt)
    dist.barrier()
    torch.manual_seed(seed + 1)  # another initialisation: loading must replace all of it
    run_b = Run(family, kind_b, world_b, make_model(family))
    if run_b.member:
        load_universal(root, run_b.model, run_b.optimizer, group=run_b.group)
    loaded = consolidate(run_b)
    run_b.step(TRAIN_STEPS)
    x, y = batch(family, TRAIN_STEPS)
    twin_opt.zero_grad()
    loss_of(family, twin, x, y).backward()
    twin_opt.step()
    stepped = consolidate(run_b)
    run_b.close()
    dist.barrier()
    if dist.get_rank() != 0:
        return None
    return {
        "saved": saved,
        "loaded": loaded,
        "stepped": stepped,
        "want_saved": want_saved,
        "want_stepped": reference(twin, twin_opt),
    }


def run_pairs(
    pairs: list[tuple[tuple[str, str, int], tuple[str, int]]], root: str
) -> list[dict[str, Any] | None]:
    """:func:`run_pair` for each pair, in one call (checkpoints under ``root/<i>``)."""
    return [run_pair(a, b, f"{root}/{i}") for i, (a, b) in enumerate(pairs)]


OTHER_HYPER = {"lr": 0.5, "betas": (0.5, 0.6), "eps": 1e-3, "weight_decay": 0.3}


def optimizer_by_name(run: Run) -> dict[str, Any]:
    """This rank's optimizer state by parameter name (``named_parameters``: FSDP's
    sharded parameters, empty pieces included): ``{name: {state: value}}``, tensors
    copied, a missing state as None; and the param groups' hyperparameters."""
    state: dict[str, Any] = {}
    for name, param in run.model.named_parameters():
        held = run.optimizer.state.get(param)
        state[name] = (
            None
            if held is None
            else {
                k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in held.items()
            }
        )
    groups = [{k: v for k, v in g.items() if k in OTHER_HYPER} for g in run.optimizer.param_groups]
    return {"state": state, "groups": groups}


def run_empty_pieces(
    spec_a: tuple[str, str, int], spec_b: tuple[str, int], root: str, warm: bool
) -> dict[str, Any] | None:
    """Train in layout A (and the plain twin), save; build FSDP layout B (trained one
    step first when ``warm``: stale state to overwrite; then its hyperparameters set to
    :data:`OTHER_HYPER`), load. Returns on every member of B: its optimizer state by
    name, its empty pieces, and on rank 0 also ``gather_full_optim_state_dict`` with
    B's full parameters, the consolidated saved state of A, the plain twin (and its
    optimizer) after the save, and B's parameters after one more step."""
    family = spec_a[0]
    kind_b, world_b = spec_b
    saved, twin, twin_opt = train_and_save(spec_a, root, 0)
    dist.barrier()
    torch.manual_seed(1)
    run_b = Run(family, kind_b, world_b, make_model(family))
    out: dict[str, Any] = {}
    if run_b.member:
        if warm:
            run_b.step(100)
        for g in run_b.optimizer.param_groups:
            g.update(OTHER_HYPER)
        load_universal(root, run_b.model, run_b.optimizer, group=run_b.group)
        out["loaded"] = optimizer_by_name(run_b)
        out["empty"] = [n for n, p in run_b.model.named_parameters() if p.numel() == 0]
        out["full"] = run_b.model.gather_full_optim_state_dict(run_b.optimizer)
        params = run_b.model.state_dict()
        out["names"] = [n for n, _ in run_b.model.named_parameters()]
    if dist.get_rank() == 0:
        out["params"] = params
        out["saved"] = saved
        out["twin"] = copy.deepcopy(twin).state_dict()
        out["twin_opt"] = copy.deepcopy(twin_opt.state_dict())
    run_b.step(TRAIN_STEPS)
    stepped = consolidate(run_b)
    run_b.close()
    dist.barrier()
    if dist.get_rank() == 0:
        out["stepped"] = stepped
    return out if run_b.member else None


def run_state_owners(root: str) -> dict[str, Any]:
    """The siblings of :func:`run_empty_pieces`, where a parameter's optimizer state
    lives on one rank (OSS, ShardedDataParallel) or in one process (OffloadModel):
    save ShardedDataParallel at 3 ranks, load into sdp@2, oss@2 (each stepped once
    first, hyperparameters changed) and offload@1. Per target and rank: the state this
    rank holds by name (its names and ``step``), the hyperparameters, and on rank 0
    the consolidated OSS state dict and the saved state."""
    family = "seq"
    torch.manual_seed(0)
    run_a = Run(family, "sdp", 3, make_model(family))
    for step in range(TRAIN_STEPS):
        run_a.step(step)
    if run_a.member:
        save_universal(root, TRAIN_STEPS, run_a.model, run_a.optimizer, group=run_a.group)
    saved = consolidate(run_a)
    run_a.close()
    dist.barrier()
    out: dict[str, Any] = {"saved": saved}
    for kind, world in (("sdp", 2), ("oss", 2), ("offload", 1)):
        torch.manual_seed(1)
        target = make_model(family)
        names = {id(p): n for n, p in target.named_parameters()}
        run = Run(family, kind, world, target)
        got: dict[str, Any] | None = None
        if run.member:
            run.step(100)
            for g in run.optimizer.param_groups:
                g.update(OTHER_HYPER)
            load_universal(root, run.model, run.optimizer, group=run.group)
            local = getattr(run.optimizer, "optim", run.optimizer).state
            got = {
                "state": {
                    names.get(id(p), f"offloaded {i}"): (sorted(s), float(s["step"]))
                    for i, (p, s) in enumerate(local.items())
                },
                "groups": [
                    {k: v for k, v in g.items() if k in OTHER_HYPER}
                    for g in run.optimizer.param_groups
                ],
                "order": [n for n, _ in target.named_parameters()],
            }
            if kind != "offload":
                run.optimizer.consolidate_state_dict(recipient_rank=0)
                got["full"] = run.optimizer.state_dict() if dist.get_rank() == 0 else None
        run.close()
        out[kind] = got
        dist.barrier()
    return out
