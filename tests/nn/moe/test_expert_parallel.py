"""Expert parallelism on 4 spawned gloo ranks: MoE at ep = 1, 2, 4 against the
single-process layer (outputs, gate and expert gradients, the edp reduction), the
all-to-all bytes against the formula, DDP with experts over edp, clipping with OSS over
edp, FairScale's MOELayer
over an ep group, and a universal checkpoint of 8 experts across ep degrees."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardkit.checkpoint.universal import load_universal
from tests.nn.moe import moe_workers as w

WORLD = 4
ATOL = 1e-5

PARITY = [
    {"ep": ep, "k": k, "drop": drop, "factor": factor}
    for ep in (1, 2, 4)
    for k, drop, factor in ((1, True, 0.5), (2, True, 0.75), (1, False, 1.0), (2, False, 1.0))
]


def test_moe_parity_at_ep_1_2_4(rank_pool: Any) -> None:
    per_rank = rank_pool(WORLD).run(w.run_parity, PARITY, timeout_s=240)
    for i, cfg in enumerate(PARITY):
        dropped = sum(per_rank[r][i]["dropped"] for r in range(WORLD))
        assert (dropped > 0) == cfg["drop"], (cfg, dropped)  # capacity binds when on
        for rank in range(WORLD):
            res = per_rank[rank][i]
            for key in ("init", "out", "gate", "expert1", "expert2", "edp1", "edp2"):
                assert res[key] < ATOL, (cfg, rank, key, res[key])
            # bytes handed to all_to_all_single per direction: kept choices x M x 4 bytes,
            # = tokens x k x M x 4 when dropless; E x 8 bytes of counts
            sent = res["bytes"]
            if cfg["ep"] == 1:
                assert sent == {"counts": 0, "dispatch": 0, "combine": 0}
                continue
            want = res["kept"] * w.M * 4
            assert sent == {"counts": w.E * 8, "dispatch": want, "combine": want}, (cfg, rank)
            if not cfg["drop"]:
                assert want == res["tokens"] * cfg["k"] * w.M * 4


def test_ddp_dense_over_dp_experts_over_edp(rank_pool: Any) -> None:
    cfg = {"ep": 2, "k": 2, "drop": True, "factor": 1.0}
    for res in rank_pool(WORLD).run(w.run_ddp, cfg, timeout_s=120):
        assert res["ignored"] == ["moe.experts.w1", "moe.experts.w2"]
        assert res["reduced"] == 2
        assert max(res["errors"]) < ATOL, res["errors"]  # clipped gradients
        assert res["want_norm"] > 2 * w.MAX_NORM  # clipping binds
        assert abs(res["norm"] - res["want_norm"]) < ATOL, res
        assert len(res["refused"]) == 2, res["refused"]  # world and edp: not the ep group
        assert all("split over ranks" in m and "mesh.group('ep')" in m for m in res["refused"])


def test_clip_under_oss_over_edp_equals_the_plain_clipped_step(rank_pool: Any) -> None:
    """``shardkit.nn.moe.clip_grad_norm_`` with OSS (over edp) stepping: the norm and
    the clipped SGD step equal the single-process layer's; OSS's own clip_grad_norm,
    which would sum over edp only, is refused."""
    cfg = {"ep": 2, "k": 2, "drop": True, "factor": 1.0}
    for rank, res in enumerate(rank_pool(WORLD).run(w.run_oss, cfg, timeout_s=120)):
        assert res["want_norm"] > 2 * w.MAX_NORM  # clipping binds
        assert abs(res["norm"] - res["want_norm"]) < ATOL * res["want_norm"], (rank, res)
        assert max(res["errors"]) < ATOL, (rank, res["errors"])
        assert res["moved"] > 1e-3, res  # the step is not a no-op
        assert "outside the optimizer's group" in res["refused"], res["refused"]


def test_moelayer_over_an_ep_group(rank_pool: Any) -> None:
    for ep in (2, 4):
        for res in rank_pool(WORLD).run(w.run_moelayer, ep, timeout_s=120):
            assert res["world"] == (1, ep)
            assert max(res["out"], res["gate"], res["experts"]) < ATOL, (ep, res)


def test_checkpoint_of_8_experts_saved_at_ep4_loads_at_ep2_and_in_one_process(
    rank_pool: Any, tmp_path: Path
) -> None:
    pool = rank_pool(WORLD)
    saved = pool.run(w.run_checkpoint, str(tmp_path), 4, True, timeout_s=120)
    loaded = pool.run(w.run_checkpoint, str(tmp_path), 2, False, timeout_s=120)
    for rank in range(WORLD):
        torch.testing.assert_close(loaded[rank]["out"], saved[0]["out"], atol=1e-6, rtol=1e-5)
        q = rank % 2  # ep=2 groups (0, 1), (2, 3): experts 4q .. 4q+3
        full = torch.cat([saved[r]["w1"] for r in range(WORLD)])
        assert torch.equal(loaded[rank]["w1"], full[4 * q : 4 * q + 4])
    torch.manual_seed(1)
    plain = w._Block(w.MoE(w.M, w.F_HIDDEN, w.E, k=2, drop_tokens=False))
    load_universal(tmp_path, plain)
    assert torch.equal(plain.moe.experts.w1.detach(), full)
    x, _ = w._tokens(0)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), saved[0]["out"], atol=1e-6, rtol=1e-5)


def test_activation_checkpointing_around_expert_parallel_moe(rank_pool: Any) -> None:
    for rank_results in rank_pool(WORLD).run(w.run_activation_checkpointing, [2, 4], timeout_s=120):
        for res in rank_results:
            assert max(res["gate"], res["w1"]) < ATOL, res
            assert res["dispatch"] > 0  # the all-to-all ran


def test_bf16_expert_parallel_bytes_and_rounding(rank_pool: Any) -> None:
    for res in rank_pool(WORLD).run(w.run_bf16, 2, timeout_s=120):
        assert res["dtype"] == "torch.bfloat16"
        assert res["dispatch"] == res["tokens"] * 2 * w.M * 2  # T x k x M x 2 bytes
        assert res["rel"] < 2e-2, res  # bf16 keeps 8 bits of mantissa


def test_experts_not_divisible_by_ep_is_refused_at_construction(rank_pool: Any) -> None:
    for message in rank_pool(WORLD).run(w.run_bad_expert_count, 4, 6, timeout_s=60):
        assert message == (
            "num_experts (6) must be a multiple of the expert-parallel size (4); "
            "choose ep among the divisors of 6"
        )


FSDP_CONFIGS = [
    {"ep": 2, "k": 2, "drop": True, "factor": 1.0},
    {"ep": 4, "k": 1, "drop": False, "factor": 1.0},
    {"ep": 2, "k": 2, "drop": False, "factor": 1.0, "dp_replicate": 2},
    {"ep": 2, "k": 2, "drop": False, "factor": 1.0, "bf16": True},
]


def test_fsdp_dense_over_dp_experts_in_a_unit_over_edp(rank_pool: Any) -> None:
    pool = rank_pool(WORLD)
    for cfg in FSDP_CONFIGS:
        for res in pool.run(w.run_fsdp, cfg, timeout_s=120):
            # the single-process model's norm (hybrid sharding once counted the expert
            # shards of one replica only: 4.09 for 6.09 with ep = dp_shard)
            assert res["want_norm"] > 2 * w.MAX_NORM
            tol = 2e-2 * res["want_norm"] if cfg.get("bf16") else ATOL
            assert abs(res["norm"] - res["want_norm"]) < tol, (cfg, res)
            if not cfg.get("bf16"):
                assert max(res["errors"]) < ATOL, (cfg, res["errors"])
                continue
            # bf16 compute (8-bit mantissa): within 2% of the step, and not exact
            for err, moved in zip(res["errors"], res["moved"], strict=True):
                assert 0 < err < 2e-2 * moved, (cfg, res)


@pytest.mark.parametrize("dp_replicate", [1, 2])
def test_fsdp_wrapped_experts_save_under_their_names_and_load_in_one_process(
    rank_pool: Any, tmp_path: Path, dp_replicate: int
) -> None:
    """Under hybrid sharding (dp_replicate 2) the experts' unit over edp spans the
    replicas: each of its shards is written by the rank holding it, not by replica 0."""
    saved = rank_pool(WORLD).run(
        w.run_fsdp_checkpoint, str(tmp_path), 2, dp_replicate, timeout_s=120
    )
    torch.manual_seed(0)
    want = w._Block(w.MoE(w.M, w.F_HIDDEN, w.E, k=2, drop_tokens=False))
    torch.manual_seed(1)
    plain = w._Block(w.MoE(w.M, w.F_HIDDEN, w.E, k=2, drop_tokens=False))
    load_universal(tmp_path, plain)  # strict: the keys are the unwrapped names
    for name, value in want.state_dict().items():
        assert torch.equal(plain.state_dict()[name], value), name
    x, _ = w._tokens(0)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), saved[0]["out"], atol=1e-6, rtol=1e-5)


def test_ddp_or_oss_over_ranks_holding_other_experts_is_refused(rank_pool: Any) -> None:
    """Without ``ignore_experts_in_ddp`` DDP over dp would average expert e's gradient
    with another expert's (training on, silently wrong): refused at the forward, OSS
    at construction; over edp both are right and accepted."""
    for res in rank_pool(WORLD).run(w.run_data_parallel_guards, timeout_s=120):
        for key in ("ddp_dp", "ddp_dp_again"):
            msg = res[key]
            assert msg.startswith("torch DistributedDataParallel: parameter `moe.experts.w1`"), msg
            assert "split over 'ep'" in msg and "ignore_experts_in_ddp" in msg, msg
            assert "process group (ranks [0, 1, 2, 3]) holds 2 of its parts" in msg, msg
        assert res["oss_dp"].startswith("OSS: parameter `param_groups[0][1]`"), res["oss_dp"]
        assert "mesh.group('edp')" in res["oss_dp"]
        assert res["oss_edp"] == "no error"
        assert max(res["edp_errors"]) < ATOL, res["edp_errors"]


def test_parallelize_model_accepts_tp_refuses_unwrapped_experts_then_matches(
    rank_pool: Any,
) -> None:
    for res in rank_pool(WORLD).run(w.run_parallelize_model, timeout_s=120):
        assert res["tp"] == "no error", res
        msg = res["fsdp_dp"]
        assert msg.startswith("parallelize_model(data_parallel='fsdp'): parameter `moe.experts.w1`")
        assert "split over 'ep'" in msg and "mesh.group('edp')" in msg, msg
        assert max(res["errors"]) < ATOL, res["errors"]


def test_expert_bias_update_sums_the_loads_over_the_group(rank_pool: Any) -> None:
    for res in rank_pool(WORLD).run(w.run_expert_bias_update, timeout_s=60):
        assert res["load"] == res["bias"] == res["same"] == 0.0, res
        assert res["moved"] > 0, res
