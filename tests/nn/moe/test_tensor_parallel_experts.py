"""Tensor parallel inside each expert: ``MoE(..., tp_group=...)`` on 4 spawned ranks
(ep 2 x tp 2, and tp 2 with ep 1) and on 2 (tp 2 alone) against the single-process
layer of the same weights (outputs, input and parameter gradients, one SGD step;
clipped by ``shardkit.nn.moe.clip_grad_norm_`` with ``tp_group``: the norm and the step
equal the plain layer's);
``parallelize_model`` over ep x tp; a universal checkpoint saved at (ep 2, tp 2) loaded
at (ep 1, tp 2), (ep 2, tp 1) and into the plain layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shardkit.checkpoint.universal import load_universal
from tests.nn.moe import tp_workers as w
from tests.nn.moe.moe_workers import F_HIDDEN, E, M, _Block, _tokens

ATOL = 1e-5

WORLD4 = [
    {"ep": 2, "tp": 2, "k": 2, "drop": True, "factor": 0.75, "clip": True},
    {"ep": 2, "tp": 2, "k": 1, "drop": False, "factor": 1.0},
    {"ep": 1, "tp": 2, "k": 2, "drop": True, "factor": 0.75, "clip": True},
]
WORLD2 = [
    {"ep": 1, "tp": 2, "k": 2, "drop": False, "factor": 1.0},
    {"ep": 1, "tp": 2, "k": 1, "drop": True, "factor": 0.5},
]


def _check_parity(configs: list[dict[str, Any]], per_rank: list[list[dict[str, Any]]]) -> None:
    for i, cfg in enumerate(configs):
        dropped = sum(per_rank[r][i]["dropped"] for r in range(len(per_rank)))
        assert (dropped > 0) == cfg["drop"], (cfg, dropped)  # capacity binds when on
        for rank, results in enumerate(per_rank):
            res = results[i]
            local_experts, hidden = E // cfg["ep"], F_HIDDEN // cfg["tp"]
            assert res["shapes"] == [(local_experts, M, hidden), (local_experts, hidden, M)]
            assert res["moved"] > 1e-3, (cfg, res)  # the step changes the experts
            sent, formula = res["all_reduce_bytes"]
            assert sent == formula > 0, (cfg, rank, sent, formula)
            for key in ("init", "out", "x", "gate", "w1", "w2", "step_w1", "step_out"):
                assert res[key] < ATOL, (cfg, rank, key, res[key])
            if cfg.get("clip"):  # the clipped step is checked by step_w1 / step_out
                # regression: without tp_group the norm summed over ep only (each tp
                # rank its own part); now refused, and right with tp_group
                assert res["clip"]["norm"] < 1e-5, (cfg, rank, res["clip"])
                assert "pass tp_group=mesh.group('tp')" in res["clip"]["refused"], res["clip"]


def test_experts_split_over_ep_and_tp_equal_the_plain_layer(rank_pool: Any) -> None:
    _check_parity(WORLD4, rank_pool(4).run(w.run_tp_parity, WORLD4, timeout_s=240))
    _check_parity(WORLD2, rank_pool(2).run(w.run_tp_parity, WORLD2, timeout_s=240))


SEQUENCE_PARALLEL = [
    {"ep": 2, "tp": 2, "k": 2, "drop": True, "factor": 0.75},
    {"ep": 1, "tp": 2, "k": 1, "drop": False, "factor": 1.0},
]


def test_sequence_parallel_moe_routes_the_gathered_sequence(rank_pool: Any) -> None:
    """Each tensor-parallel rank holds a chunk of the sequence; the layer gathers it,
    routes every token and returns this rank's chunk: outputs and gradients equal the
    single-process layer's on the whole sequence."""
    per_rank = rank_pool(4).run(w.run_sequence_parallel, SEQUENCE_PARALLEL, timeout_s=120)
    for i, cfg in enumerate(SEQUENCE_PARALLEL):
        dropped = sum(per_rank[r][i]["dropped"] for r in range(4))
        assert (dropped > 0) == cfg["drop"], (cfg, dropped)
        for rank, results in enumerate(per_rank):
            res = results[i]
            assert res["shape"] == (2, 4, M), res  # this rank's half of 8 positions
            for key in ("out", "x", "gate", "w1", "w2"):
                assert res[key] < ATOL, (cfg, rank, key, res[key])


def test_parallelize_model_with_experts_over_ep_and_tp(rank_pool: Any) -> None:
    for rank, res in enumerate(rank_pool(4).run(w.run_parallelize_moe_tp, timeout_s=120)):
        assert res["moved"] > 1e-3, res
        ep_peers = [rank % 2, rank % 2 + 2]  # ep groups (0, 2), (1, 3); tp groups (0, 1), (2, 3)
        for name in ("dp", "world"):
            msg = res[name]
            assert msg.startswith("FullyShardedDataParallel: parameter `w1`"), (name, msg)
            assert f"split over 'ep' across ranks {ep_peers}" in msg, (name, msg)
        assert max(res["errors"]) < ATOL, res["errors"]


def test_checkpoint_saved_at_ep2_tp2_loads_at_other_layouts(rank_pool: Any, tmp_path: Path) -> None:
    pool = rank_pool(4)
    plain = _Block(w._moe({"k": 2, "factor": 1.0, "drop": False}, None))
    full1, full2 = plain.moe.experts.w1.detach(), plain.moe.experts.w2.detach()
    saved = pool.run(w.run_tp_checkpoint, str(tmp_path), 2, 2, True, timeout_s=120)
    for ep, tp in ((1, 2), (2, 1)):
        loaded = pool.run(w.run_tp_checkpoint, str(tmp_path), ep, tp, False, timeout_s=120)
        for res in loaded:
            lo, hi = res["experts"]
            f = F_HIDDEN // tp
            cols = slice(res["tp_rank"] * f, (res["tp_rank"] + 1) * f)
            assert torch.equal(res["w1"], full1[lo:hi, :, cols]), (ep, tp)
            assert torch.equal(res["w2"], full2[lo:hi, cols, :]), (ep, tp)
            assert torch.equal(res["gate"], plain.moe.gate.wg.weight.detach())
            torch.testing.assert_close(res["out"], saved[0]["out"], atol=1e-6, rtol=1e-5)
    for res in saved:  # each rank saved its own part
        lo, hi = res["experts"]
        cols = slice(res["tp_rank"] * F_HIDDEN // 2, (res["tp_rank"] + 1) * F_HIDDEN // 2)
        assert torch.equal(res["w1"], full1[lo:hi, :, cols])
    torch.manual_seed(1)
    alone = _Block(w._moe({"k": 2, "factor": 1.0, "drop": False}, None))
    with torch.no_grad():
        for p in alone.parameters():
            p.uniform_(-1.0, 1.0)
    load_universal(tmp_path, alone)
    assert torch.equal(alone.moe.experts.w1.detach(), full1)
    assert torch.equal(alone.moe.experts.w2.detach(), full2)
    with torch.no_grad():
        torch.testing.assert_close(alone(_tokens(0)[0]), saved[0]["out"], atol=1e-6, rtol=1e-5)


def test_unequal_sequence_chunks_raise_on_every_rank(rank_pool: Any) -> None:
    """Regression: tensor-parallel ranks passing chunks of different shapes to a
    sequence-parallel MoE layer hung or died inside gloo's all-gather; now every rank
    raises a ValueError naming each rank's shape, and no rank is left waiting."""
    per_rank = rank_pool(2).run(w.run_unequal_sequence_chunks, timeout_s=60)
    for res in per_rank:
        positions, batch = res["errors"]
        assert "rank 0 (2, 3, 6), rank 1 (2, 5, 6)" in positions, positions
        assert "rank 0 (2, 4, 6), rank 1 (3, 4, 6)" in batch, batch
        assert "the same shape on every rank" in positions, positions
        assert res["shape"] == (2, 4, M), res
