"""One stage per rank: parity with the plain model for GPipe and 1F1B on 2 and 4 ranks,
pipeline x data parallel (2 x 2 with torch DDP, shardkit ShardedDataParallel + OSS or
FullyShardedDataParallel inside each stage), consolidated state."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.nn.data_parallel import FSDP, ShardedDataParallel
from shardkit.nn.pipe import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    consolidated_state_dict,
    load_stage_state_dict,
    stage_module,
)
from shardkit.nn.pipe.p2p import P2P
from shardkit.optim import OSS
from shardkit.testing import assert_state_dicts_close, assert_tensors_close

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class EmbedPair(nn.Module):
    """``(x, ids) -> (x + emb(ids), ids)``: an int64 tensor travels between stages."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)

    def forward(self, xi: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, ids = xi
        return x + self.emb(ids), ids


class PairLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, hi: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, ids = hi
        return torch.tanh(self.lin(h)) * (1 + ids.unsqueeze(1)), ids


class PairHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, hi: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.lin(hi[0])


def make_model(kind: str, stages: int) -> tuple[nn.Sequential, list[int]]:
    """A model of ``stages`` partitions and its balance (same weights on every rank)."""
    torch.manual_seed(0)
    if kind == "pair":
        layers = [EmbedPair(), *[PairLinear() for _ in range(stages - 1)], PairHead()]
        return nn.Sequential(*layers), [2] + [1] * (stages - 1)
    layers = []
    for _ in range(stages):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    layers[-1] = nn.Linear(8, 4)
    return nn.Sequential(*layers), [2] * stages


def make_batch(kind: str, rows: int, seed: int) -> tuple[Any, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=g)
    y = torch.randn(rows, 4, generator=g)
    if kind == "pair":
        return (x, torch.randint(0, 10, (rows,), generator=g)), y
    return x, y


def run_parity(configs: list[tuple[str, str, int, str]]) -> list[int]:
    """Per config (kind, schedule, chunks, checkpoint): one step's loss and gradients, and
    an inference forward, against the plain model; returns each config's peak in-flight."""
    rank, p = dist.get_rank(), dist.get_world_size()
    peaks = []
    for kind, schedule, chunks, checkpoint in configs:
        label = f"rank {rank} {kind} {schedule} chunks={chunks} checkpoint={checkpoint}"
        full, balance = make_model(kind, p)
        reference = copy.deepcopy(full)
        stage = PipelineStage(stage_module(full, balance, rank), checkpoint=checkpoint)
        runner = SCHEDULES[schedule](stage, chunks, loss_fn=F.mse_loss)
        x, y = make_batch(kind, 11, seed=chunks)
        loss = runner.step(x if stage.is_first else None, target=y if stage.is_last else None)
        want = F.mse_loss(reference(x), y)
        want.backward()
        if stage.is_last:
            assert loss is not None
            assert_tensors_close(loss, want, atol=1e-6, name=f"loss {label}")
        else:
            assert loss is None
        ref_params = dict(reference.named_parameters())
        for name, param in stage.module.named_parameters():
            assert param.grad is not None, f"{label}: no gradient for {name}"
            assert_tensors_close(
                param.grad, ref_params[name].grad, atol=1e-5, name=f"{name} {label}"
            )  # type: ignore[arg-type]
        peaks.append(stage.peak_in_flight)
        out = runner.forward(x if stage.is_first else None)
        if stage.is_last:
            assert isinstance(out, torch.Tensor)
            assert_tensors_close(out, reference(x), atol=1e-6, name=f"inference {label}")
    return peaks


def run_training(schedule: str, steps: int) -> dict[str, torch.Tensor] | None:
    """``steps`` SGD steps through the pipeline; the consolidated state on rank 0."""
    rank, p = dist.get_rank(), dist.get_world_size()
    full, balance = make_model("mlp", p)
    reference = copy.deepcopy(full)
    stage = PipelineStage(stage_module(full, balance, rank))
    runner = SCHEDULES[schedule](stage, 4, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(stage.module.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = make_batch("mlp", 8, seed=100 + step)
        opt.zero_grad()
        runner.step(x if stage.is_first else None, target=y if stage.is_last else None)
        opt.step()
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
    state = consolidated_state_dict(stage.module)
    if rank == 0:
        assert state is not None
        assert_state_dicts_close(state, reference.state_dict(), atol=1e-5)
    fresh, _ = make_model("mlp", p)
    fresh_stage = stage_module(fresh, balance, rank)
    load_stage_state_dict(fresh_stage, reference.state_dict())
    assert_state_dicts_close(fresh_stage.state_dict(), stage.module.state_dict(), atol=1e-5)
    return state


def test_two_stages_match_the_plain_model(rank_pool: Any) -> None:
    configs = [
        (kind, schedule, chunks, "never")
        for kind in ("mlp", "pair")
        for schedule in ("gpipe", "1f1b")
        for chunks in (1, 3, 4, 5)
    ]
    configs += [("mlp", "1f1b", 4, "always"), ("pair", "gpipe", 3, "always")]
    peaks = rank_pool(2).run(run_parity, configs)
    for i, (_, schedule, chunks, _) in enumerate(configs):
        if schedule == "gpipe":
            assert [peaks[r][i] for r in range(2)] == [chunks, chunks]
        else:  # 1F1B: stage s holds at most p - s micro-batches
            assert [peaks[r][i] for r in range(2)] == [min(2, chunks), 1]


def run_p2p_headers() -> list[tuple[tuple[int, ...], str, bool]]:
    """Rank 0 sends a tuple whose header needs two messages (12 tensors), then one that
    fits in one; rank 1 returns what it received (shape, dtype, requires_grad)."""
    p2p = P2P(dist.group.WORLD, torch.device("cpu"))  # type: ignore[arg-type]
    many = [torch.full((i + 1, 2, 3), float(i)).requires_grad_(i % 2 == 0) for i in range(12)]
    few = [torch.arange(5), torch.ones(2, 2, dtype=torch.float64)]
    if dist.get_rank() == 0:
        p2p.send(many, 1, atomic=False)
        p2p.send(few, 1, atomic=False)
        p2p.wait()
        return []
    got = []
    for sent in (many, few):
        atomic, metas = p2p.recv_header(0)
        tensors = p2p.recv(metas, 0)
        assert not atomic and all(torch.equal(a, b) for a, b in zip(tensors, sent))
        got += [(tuple(t.shape), str(t.dtype), t.requires_grad) for t in tensors]
    return got


def test_headers_longer_than_one_message(rank_pool: Any) -> None:
    got = rank_pool(2).run(run_p2p_headers)[1]
    assert got[:3] == [
        ((1, 2, 3), "torch.float32", True),
        ((2, 2, 3), "torch.float32", False),
        ((3, 2, 3), "torch.float32", True),
    ]
    assert len(got) == 14 and got[-2:] == [
        ((5,), "torch.int64", False),
        ((2, 2), "torch.float64", False),
    ]


def test_training_steps_and_consolidated_state(rank_pool: Any) -> None:
    states = rank_pool(2).run(run_training, "1f1b", 3)
    assert states[0] is not None and states[1] is None
    assert set(states[0]) == {f"{i}.{w}" for i in (0, 2, 3) for w in ("weight", "bias")}


def wrap_stage(
    base: nn.Module, wrapper: str, group: dist.ProcessGroup
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``base`` wrapped for data parallelism over ``group``, and its AdamW: torch DDP
    (``ddp``), ShardedDataParallel + OSS (``sdp``), FSDP of the whole stage (``fsdp``),
    FSDP with the stage's first layer a nested unit (``fsdp-nested``; ``fsdp-keep``: the
    same with ``reshard_after_forward=False``)."""
    adamw = {"lr": 0.01, "weight_decay": 0.1}
    if wrapper == "sdp":
        opt: torch.optim.Optimizer = OSS(
            base.parameters(), optim=torch.optim.AdamW, group=group, **adamw
        )
        return ShardedDataParallel(base, opt, process_group=group), opt
    part: nn.Module
    if wrapper == "ddp":
        part = DistributedDataParallel(base, process_group=group)
    else:
        keep = {"reshard_after_forward": wrapper != "fsdp-keep"}
        if wrapper != "fsdp":
            base[0] = FSDP(base[0], process_group=group, **keep)
        part = FSDP(base, process_group=group, **keep)
    return part, torch.optim.AdamW(part.parameters(), **adamw)


def stage_grad_norm(part: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """The 2-norm of the stage's whole (reduced) gradient, however it is sharded."""
    if isinstance(opt, OSS):
        return opt.clip_grad_norm(1e9)
    if isinstance(part, FSDP):
        return part.clip_grad_norm_(1e9)
    return torch.nn.utils.clip_grad_norm_(part.parameters(), 1e9)


def run_two_d(configs: list[tuple[str, str]], steps: int) -> list[dict[str, torch.Tensor] | None]:
    """2 stages x 2 replicas: ranks (replica r, stage s) = 2r + s, each stage wrapped (see
    :func:`wrap_stage`) over {s, s + 2}; per config (schedule, wrapper) ``steps`` AdamW
    steps against the plain model on the global batch: each replica's loss, and the
    consolidated state on stage 0 (returned; None on stage 1)."""
    rank = dist.get_rank()
    replica, s = divmod(rank, 2)
    pp_groups = [dist.new_group([2 * r, 2 * r + 1]) for r in range(2)]
    dp_groups = [dist.new_group([j, j + 2]) for j in range(2)]
    states = []
    for schedule, wrapper in configs:
        label = f"{wrapper} {schedule} rank {rank}"
        full, balance = make_model("mlp", 2)
        reference = copy.deepcopy(full)
        base = stage_module(full, balance, s)
        ref_params = dict(reference.named_parameters())
        mine_params = [ref_params[name] for name, _ in base.named_parameters()]
        part, opt = wrap_stage(base, wrapper, dp_groups[s])
        stage = PipelineStage(part, process_group=pp_groups[replica])
        runner = SCHEDULES[schedule](stage, 3, loss_fn=F.mse_loss)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)
        for step in range(steps):
            x, y = make_batch("mlp", 12, seed=step)
            mine = slice(6 * replica, 6 * replica + 6)
            opt.zero_grad()
            loss = runner.step(
                x[mine] if stage.is_first else None, target=y[mine] if stage.is_last else None
            )
            if stage.is_last:
                assert loss is not None
                want = F.mse_loss(reference(x[mine]), y[mine])
                assert_tensors_close(loss, want, atol=1e-6, name=f"loss step {step} {label}")
            ref_opt.zero_grad()
            F.mse_loss(reference(x), y).backward()  # the global batch: replicas averaged
            # AdamW hides a gradient's scale (sum vs mean over replicas): check the norm
            want_norm = torch.stack([p.grad.norm() for p in mine_params]).norm()  # type: ignore[union-attr]
            got_norm = stage_grad_norm(part, opt)
            assert_tensors_close(got_norm, want_norm, atol=1e-6, name=f"grad norm {label}")
            opt.step()
            ref_opt.step()
        state = consolidated_state_dict(part, process_group=pp_groups[replica])
        if state is not None:
            assert_state_dicts_close(state, reference.state_dict(), atol=1e-5)
        states.append(state)
    return states


def test_four_stages_and_pipeline_times_data_parallel(rank_pool: Any) -> None:
    pool = rank_pool(4)
    configs = [
        ("mlp", schedule, chunks, "never") for schedule in ("gpipe", "1f1b") for chunks in (1, 5)
    ]
    configs.append(("pair", "1f1b", 4, "never"))
    peaks = pool.run(run_parity, configs)
    assert [peaks[r][3] for r in range(4)] == [4, 3, 2, 1]  # 1F1B, 5 micro-batches: p - s
    assert [peaks[r][1] for r in range(4)] == [5, 5, 5, 5]  # GPipe: all of them
    reference, _ = make_model("mlp", 2)
    two_d = [("gpipe", "ddp"), ("1f1b", "ddp"), ("1f1b", "sdp")]
    two_d += [(schedule, "fsdp") for schedule in ("gpipe", "1f1b")]
    two_d += [("1f1b", "fsdp-nested"), ("gpipe", "fsdp-keep")]
    states = pool.run(run_two_d, two_d, 3)
    for i, config in enumerate(two_d):
        assert states[1][i] is None and states[3][i] is None, config
        for r in (0, 2):  # stage 0 of each replica holds the whole model; replicas agree
            assert set(states[r][i]) == set(reference.state_dict()), config
        assert_state_dicts_close(states[0][i], states[2][i], atol=0.0)


def run_profiled_step() -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    rank = dist.get_rank()
    full, balance = make_model("tensor", 2)
    stage = PipelineStage(stage_module(full, balance, rank), checkpoint="never")
    runner = Schedule1F1B(stage, 2, loss_fn=F.mse_loss)
    x, y = make_batch("tensor", 4, seed=0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.step(x if stage.is_first else None, target=y if stage.is_last else None)
    return sorted({e.name for e in prof.events() if e.name.startswith("Pipe::")})


def test_profiler_labels_of_stage_actions(rank_pool: Any) -> None:
    first, last = rank_pool(2).run(run_profiled_step)
    for s, labels in ((0, first), (1, last)):
        for i in range(2):
            assert f"Pipe::stage={s} forward micro_batch={i}" in labels, labels
            assert f"Pipe::stage={s} backward micro_batch={i}" in labels, labels
    assert {"Pipe::send activations micro_batch=1", "Pipe::recv gradients micro_batch=1"} <= set(
        first
    )
    assert {"Pipe::recv activations micro_batch=1", "Pipe::send gradients micro_batch=1"} <= set(
        last
    )
    assert not any("recv activations" in n or "send gradients" in n for n in first)
