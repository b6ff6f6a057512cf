"""Optimizers that need whole tensors (Muon + AdamW, Adafactor, a LAMB written in the
workers) under FSDP (flat, nested, hybrid) with WholeTensorOptimizer, and under
ShardedDataParallel and OSS: parameters after 3 steps equal the plain single-process
model's within 2e-5; a universal checkpoint saved at 2 ranks (and at 4, hybrid) resumes
at another world size and continues as the plain model; a plain whole-tensor optimizer over FSDP's shards is
refused before any update.

One ``pool.run`` per world size (2, 3, and 4 for hybrid sharding as 2 shards x 2
replicas) runs every configuration; the workers are in
:mod:`tests.optim.whole_tensor_workers`. The strategies x optimizers grid is split
over the two world sizes so that each pair runs once.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from shardkit.optim import OSS, WholeTensorOptimizer, needs_whole_tensors
from shardkit.optim.whole_tensor_exchange import Pieces, check_pieces, plan_exchange
from shardkit.testing import RankPool
from tests.optim import whole_tensor_workers as workers

TOL = 2e-5
PARITY_2 = [
    ("fsdp-flat", "muon"),
    ("fsdp-flat", "adafactor"),
    ("fsdp-flat", "lamb"),
    ("fsdp-block", "muon"),
    ("hybrid", "lamb"),
    ("sdp", "muon"),
    ("sdp", "adafactor"),
    ("oss", "muon"),
    ("oss", "lamb"),
    ("ddp+one", "muon"),  # "+one": every group in one optimizer (the main job's ddp,
    ("oss+one", "muon"),  # oss and sdp): WholeTensorOptimizer(groups), alone or as
    ("sdp+one", "muon"),  # OSS(groups, optim=WholeTensorOptimizer)
]
PARITY_3 = [
    ("fsdp-flat", "muon"),
    ("fsdp-block", "adafactor"),
    ("fsdp-block", "lamb"),
    ("hybrid", "muon"),
    ("sdp", "lamb"),
    ("oss", "adafactor"),
    ("sdp+one", "muon"),
]
PARITY_4 = [("hybrid", "muon"), ("hybrid", "adafactor"), ("hybrid", "lamb")]  # 2 x 2
SAVED_AT_2 = [
    ("fsdp-block", "muon"),
    ("fsdp-flat", "lamb"),
    ("sdp", "lamb"),
    ("fsdp-flat", "adafactor"),
    ("ddp", "adafactor"),  # every rank writes 1/N of each tensor; rank 0 the factors
]
RESUMED_AT_4 = [("fsdp-flat", "hybrid", "lamb")]  # (saved by, resumed by, optimizer)
SAVED_AT_4 = [("hybrid", "muon")]
RESUMED_AT_3 = [
    ("fsdp-block", "fsdp-flat", "muon"),
    ("fsdp-flat", "sdp", "lamb"),
    ("sdp", "fsdp-block", "lamb"),
    ("hybrid", "fsdp-block", "muon"),  # saved at 4 ranks, 2 shards x 2 replicas
]
ADAFACTOR_RESUMED_AT_3 = [  # factored moments: per-tensor state
    ("fsdp-flat", "fsdp-block", "adafactor"),
    ("fsdp-flat", "oss", "adafactor"),
    ("ddp", "fsdp-flat", "adafactor"),
]
# the pairs the grids above run at one world size only, at the other
GAPS_2 = [("fsdp-block", "adafactor"), ("sdp", "lamb"), ("oss", "adafactor")]
GAPS_3 = [("fsdp-flat", "lamb"), ("fsdp-block", "muon"), ("sdp", "muon"), ("oss", "muon")]
RESUMED_IN_ONE_PROCESS = [  # a plain model, no process group
    ("fsdp-flat", "plain", "adafactor"),
    ("fsdp-block", "plain", "muon"),  # Muon + AdamW: a WholeTensorOptimizer of one rank
]


@pytest.fixture(scope="module")
def root() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as path:
        yield path


@pytest.fixture(scope="module")
def results(rank_pool: Callable[[int], RankPool], root: str) -> dict[int, dict[str, Any]]:
    two = rank_pool(2).run(
        workers.run_all,
        [
            ("parity", (PARITY_2,)),
            ("refusals", ()),
            ("save_after", (SAVED_AT_2, root, 3)),
            ("local_state_roundtrip", ("fsdp-block", "adafactor")),
        ],
    )
    four = rank_pool(4).run(  # a pool other tests share
        workers.run_all,
        [
            ("parity", (PARITY_4,)),
            ("resume", (RESUMED_AT_4, root, 3, 5)),
            ("save_after", (SAVED_AT_4, root, 3)),
        ],
    )
    three = rank_pool(3).run(
        workers.run_all,
        [
            ("parity", (PARITY_3,)),
            ("resume", (RESUMED_AT_3, root, 3, 5)),
        ],
    )
    return {2: two[0], 3: three[0], 4: four[0]}


@pytest.fixture(scope="module")
def more(
    rank_pool: Callable[[int], RankPool], root: str, results: dict[int, dict[str, Any]]
) -> dict[int, dict[str, Any]]:
    """The Adafactor checkpoints (saved by ``results``) resumed at 3 ranks and in one
    process, and the parity pairs of the grids' gaps."""
    two = rank_pool(2).run(workers.run_all, [("parity", (GAPS_2,))])
    three = rank_pool(3).run(
        workers.run_all,
        [
            ("parity", (GAPS_3,)),
            ("resume", (ADAFACTOR_RESUMED_AT_3, root, 3, 5)),
            ("per_tensor_state_refused", (root, "fsdp-flat-adafactor")),
        ],
    )
    with workers.fp32_muon():
        one = workers.resume(RESUMED_IN_ONE_PROCESS, root, 3, 5)
    return {1: {"resume": one}, 2: two[0], 3: three[0]}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_parity_with_the_plain_model(results: dict[int, dict[str, Any]], world: int) -> None:
    for row in results[world]["parity"]:
        assert row["moved"] > 1e-2, row  # the plain model trained: the check can fail
        assert row["diff"] < TOL, row


def test_universal_checkpoint_resumes_at_another_world_size(
    results: dict[int, dict[str, Any]],
) -> None:
    for world, expected in ((3, RESUMED_AT_3), (4, RESUMED_AT_4)):
        rows = results[world]["resume"]
        assert [(r["saved"], r["strategy"], r["kind"]) for r in rows] == expected
        for row in rows:
            assert row["diff"] < TOL, row


def test_adafactor_factored_state_resumes_elsewhere(more: dict[int, dict[str, Any]]) -> None:
    """Adafactor's factored moments (per-tensor state), saved by FSDP + WholeTensorOptimizer
    and by DDP at 2 ranks, resumed by FSDP and OSS at 3 ranks and by a plain model in one
    process (Muon + AdamW too): 2 more steps equal the uninterrupted plain run."""
    for world, expected in ((3, ADAFACTOR_RESUMED_AT_3), (1, RESUMED_IN_ONE_PROCESS)):
        rows = more[world]["resume"]
        assert [(r["saved"], r["strategy"], r["kind"]) for r in rows] == expected
        for row in rows:
            assert row["diff"] < TOL, row


@pytest.mark.parametrize("world", [2, 3])
def test_parity_of_the_grids_gaps(more: dict[int, dict[str, Any]], world: int) -> None:
    expected = GAPS_2 if world == 2 else GAPS_3
    rows = more[world]["parity"]
    assert [(r["strategy"], r["kind"]) for r in rows] == expected
    for row in rows:
        assert row["moved"] > 1e-2, row
        assert row["diff"] < TOL, row


def test_plain_whole_tensor_optimizer_over_fsdp_shards_is_refused(
    results: dict[int, dict[str, Any]],
) -> None:
    out = results[2]["refusals"]
    for name in ("adafactor", "lamb"):
        assert out[name].startswith("ValueError"), out[name]
        assert "needs whole tensors" in out[name] and "WholeTensorOptimizer" in out[name]
        assert "`wte.weight`" in out[name]
        assert out[name + "-unchanged"] == "True"  # refused before any update
    assert "Muon only supports 2D parameters" in out["muon"]  # torch's own refusal
    assert out["ddp-whole"].startswith("ValueError") and "OSS" in out["ddp-whole"]


def test_needs_whole_tensors() -> None:
    assert needs_whole_tensors(torch.optim.Muon) and needs_whole_tensors(torch.optim.Adafactor)
    assert needs_whole_tensors(workers.Lamb)  # declared by its attribute
    for cls in (torch.optim.AdamW, torch.optim.SGD, WholeTensorOptimizer):
        assert not needs_whole_tensors(cls)


def test_pieces_must_cover_the_tensor_once() -> None:
    check_pieces(Pieces("w", (3, 4), ((0, 5), (5, 12))))
    check_pieces(Pieces("b", (2,), ((0, 2), (0, 0))))  # an empty piece
    for ranges in (((0, 12), (0, 12)), ((0, 5), (6, 12)), ((0, 5), (5, 11))):
        with pytest.raises(ValueError, match=r"`w` \(3, 4\) \(12 elements\)"):
            check_pieces(Pieces("w", (3, 4), ranges))


def _cut(shapes: list[tuple[int, int]], world: int, flat: bool) -> list[Pieces]:
    """Pieces of ``shapes``: each cut evenly over the ranks (``flat=False``, FSDP2's
    per-parameter sharding), or one flat buffer cut into ``world`` (FSDP's layout)."""
    numels = [a * b for a, b in shapes]
    size = -(-sum(numels) // world)
    params, at = [], 0
    for i, (shape, n) in enumerate(zip(shapes, numels)):
        if flat:  # the rank ranges of the flat buffer, intersected with this parameter
            cuts = [(max(r * size, at), min((r + 1) * size, at + n)) for r in range(world)]
            ranges = tuple((a - at, b - at) if b > a else (0, 0) for a, b in cuts)
        else:
            per = -(-n // world)
            ranges = tuple((min(r * per, n), min((r + 1) * per, n)) for r in range(world))
        params.append(Pieces(f"p{i}", shape, ranges))
        at += n
    return params


@pytest.mark.parametrize("world", [2, 3, 4])
def test_exchange_bytes_and_balance(world: int) -> None:
    """Every parameter cut evenly: each rank sends 3 (N - 1) P / N**2 elements per
    step, 3 / N of the reduce-scatter's (N - 1) P / N. FSDP's flat layout: only the
    parameters straddling a shard boundary move, far less. No rank owns more than
    P / N plus the largest parameter."""
    shapes = [(64, 48), (48, 64), (32, 32), (96, 16), (16, 8), (8, 8)]
    total = sum(a * b for a, b in shapes)
    even = _cut(shapes, world, flat=False)
    sent = [plan_exchange(even, rank, world).bytes_per_step(4) for rank in range(world)]
    assert sum(sent) / world == pytest.approx(3 * (world - 1) * total / world**2 * 4, rel=0.02)
    flat = _cut(shapes, world, flat=True)
    flat_sent = [plan_exchange(flat, rank, world).bytes_per_step(4) for rank in range(world)]
    assert sum(flat_sent) < sum(sent) / 2
    for params in (even, flat):
        plan = plan_exchange(params, 0, world)
        loads = [sum(params[i].numel for i in plan.owned(r)) for r in range(world)]
        assert max(loads) <= total / world + max(p.numel for p in params), loads
        for i, pieces in enumerate(params):  # a parameter held mostly by one rank stays there
            longest = max(range(world), key=pieces.length)
            if pieces.length(longest) == pieces.numel:
                assert plan.owners[i] == longest


def test_per_tensor_state_into_flat_shards_is_refused(more: dict[int, dict[str, Any]]) -> None:
    """Adafactor's factored moments load only where the optimizer holds whole tensors:
    a plain Adafactor over FSDP's flat shards is refused before anything is written."""
    out = more[3]["per_tensor_state_refused"]
    assert out["error"].startswith("CheckpointMismatchError"), out
    assert "per-tensor optimizer state" in out["error"], out
    assert "row_var" in out["error"] and "col_var" in out["error"], out
    assert "WholeTensorOptimizer" in out["error"], out
    assert out["unchanged"] == "True", out


def test_local_state_dict_round_trip_at_the_same_world_size(
    results: dict[int, dict[str, Any]],
) -> None:
    """WholeTensorOptimizer.state_dict() (this rank's state, Adafactor's factored moments
    included) loads back into a new run, which continues as the plain model."""
    assert results[2]["local_state_roundtrip"] < TOL


def _small_run(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    groups = [
        {"params": [p for p in model.parameters() if p.ndim == 2], "optim": torch.optim.Muon},
        {"params": [p for p in model.parameters() if p.ndim != 2], "optim": torch.optim.AdamW},
    ]
    if kind == "oss":
        return model, OSS(groups, optim=WholeTensorOptimizer, lr=0.02)
    return model, WholeTensorOptimizer(groups, lr=0.02)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("kind", ["alone", "oss"])
def test_without_a_model_the_state_dict_round_trips(kind: str) -> None:
    """WholeTensorOptimizer(groups) (its own state dict) and OSS(groups,
    optim=WholeTensorOptimizer) (a plain torch state dict, loaded into the
    WholeTensorOptimizer inside) in one process: saved after 2 steps and loaded into a
    new run, 2 more steps give the uninterrupted run's parameters exactly; ``lr`` given
    once reaches both groups. (Newton-Schulz in fp32: torch's bf16 one is slow on CPU.)"""
    with workers.fp32_muon():
        whole, whole_opt = _small_run(kind)
        _train(whole, whole_opt, range(4))
        first, first_opt = _small_run(kind)
        _train(first, first_opt, range(2))
        saved_model, saved_opt = first.state_dict(), first_opt.state_dict()
        second, second_opt = _small_run(kind)
        second.load_state_dict(saved_model)
        second_opt.load_state_dict(saved_opt)
        _train(second, second_opt, range(2, 4))
    for a, b in zip(whole.parameters(), second.parameters()):
        assert torch.equal(a, b)
    assert [g["lr"] for g in second_opt.param_groups] == [0.02, 0.02]
    assert len(second_opt.state) == 6  # every parameter has state (Muon's, AdamW's)


def test_oss_over_whole_tensor_optimizer_repartitions_after_freezing() -> None:
    """OSS(groups, optim=WholeTensorOptimizer) rebuilds its local optimizer when a
    parameter is frozen between steps; AdamW's group holds ``decoupled_weight_decay``,
    which its constructor does not take (was a TypeError). 2 steps, freeze the first
    weight, 2 steps: equal to torch's Muon + AdamW on the plain model."""
    with workers.fp32_muon():
        model, opt = _small_run("oss")
        torch.manual_seed(0)
        plain = torch.nn.Sequential(
            torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4)
        )
        muon = torch.optim.Muon([p for p in plain.parameters() if p.ndim == 2], lr=0.02)
        adamw = torch.optim.AdamW([p for p in plain.parameters() if p.ndim != 2], lr=0.02)
        for step in range(4):
            if step == 2:
                model[0].weight.requires_grad_(False)
                plain[0].weight.requires_grad_(False)
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
            for net in (model, plain):
                net(x).square().mean().backward()
            for o in (opt, muon, adamw):
                o.step()
                o.zero_grad()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(a, b, atol=1e-6), float((a - b).abs().max())
