"""Mixed precision, loss scaling, CPU offload and activation checkpointing with FSDP and
OSS + ShardedDataParallel, against an fp32 unsharded reference (tiny GPT, 2 ranks).

Tolerances (measured on this CPU box, 3 SGD steps with momentum): the relative error of
the parameter update, ``max |delta_run - delta_ref| / max |delta_ref|`` with
``delta = final - initial``, is about 6e-3 (FSDP) and 9e-3 (autocast) for bf16 and
about 1e-3 for fp16; the tests allow 3e-2 (bf16) and 5e-3 (fp16). A gradient that is
not averaged or reduced in the wrong place gives an error of order 1.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from shardkit.nn.data_parallel.fully_sharded import MixedPrecision
from shardkit.nn.data_parallel.fully_sharded.config import resolve_offload
from shardkit.nn.data_parallel.fully_sharded.precision import (
    cast_floating,
    resolve_mixed_precision,
)
from shardkit.testing import assert_state_dicts_close
from shardkit.testing.compare import max_abs_diff
from tests.nn.data_parallel import precision_workers as pw
from tests.nn.data_parallel.fsdp_workers import run_all, tiny_gpt

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
FAIRSCALE_BF16 = {"mixed_precision": True, "compute_dtype": BF16}
RUNS: dict[str, tuple[str, dict[str, Any]]] = {
    "fsdp": ("fsdp", {}),
    "fsdp_bf16": ("fsdp", {"fsdp": FAIRSCALE_BF16}),
    "fsdp_bf16_policy": (
        "fsdp",
        {"fsdp": {"mixed_precision": MixedPrecision(param_dtype=BF16, reduce_dtype=FP32)}},
    ),
    "fsdp_fp16": (
        "fsdp",
        {"fsdp": {"mixed_precision": True, "fp32_reduce_scatter": True}, "scaler": True},
    ),
    "fsdp_offload": ("fsdp", {"fsdp": {"move_params_to_cpu": True}}),
    "fsdp_offload_bf16": ("fsdp", {"fsdp": {**FAIRSCALE_BF16, "cpu_offload": True}}),
    "fsdp_ckpt": ("fsdp", {"ckpt": True}),
    "fsdp_ckpt_bf16": ("fsdp", {"ckpt": True, "fsdp": FAIRSCALE_BF16}),
    "fsdp_inf": ("fsdp", {"scaler": True, "ref_scaler": True, "inf_step": 1}),
    "fsdp_overflow": (
        "fsdp",
        {"fsdp": {"mixed_precision": True}, "scaler": True, "init_scale": 2.0**24},
    ),
    "sdp": ("sdp", {}),
    "sdp_bf16": ("sdp", {"autocast": BF16}),
    "sdp_fp16": ("sdp", {"autocast": FP16, "scaler": True}),
    "sdp_inf": ("sdp", {"scaler": True, "ref_scaler": True, "inf_step": 1}),
    "sdp_ckpt": ("sdp", {"ckpt": True}),
}
TOLERANCE = {"bf16": 3e-2, "fp16": 5e-3, "fp32": 1e-5}


@pytest.fixture(scope="module")
def results(rank_pool: Any) -> dict[str, Any]:
    fns = [
        functools.partial(pw.grid, list(RUNS.values())),
        functools.partial(pw.checkpoint_memory, "fsdp"),
        functools.partial(pw.checkpoint_memory, "sdp"),
        pw.state_and_buffers,
    ]
    per_rank = rank_pool(2).run(run_all, fns)
    grid, fsdp_mem, sdp_mem, states = per_rank[0]
    out = dict(zip(RUNS, grid))
    out["memory"] = {"fsdp": fsdp_mem, "sdp": sdp_mem}
    out["states"] = states
    out["rank1"] = dict(zip(RUNS, per_rank[1][0]))
    return out


def _update_error(run: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    init = tiny_gpt().state_dict()
    num = max(max_abs_diff(run[k] - init[k], v - init[k]) for k, v in ref.items())
    return num / max(float((v - init[k]).abs().max()) for k, v in ref.items())


def _precision(name: str) -> str:
    return next((p for p in ("bf16", "fp16") if p in name), "fp32")


@pytest.mark.parametrize(
    "name", ["fsdp", "fsdp_bf16", "fsdp_bf16_policy", "fsdp_fp16", "sdp_bf16", "sdp_fp16"]
)
def test_training_matches_fp32_reference(results: dict[str, Any], name: str) -> None:
    run, ref = results[name]["run"], results[name]["ref"]
    tol = TOLERANCE[_precision(name)]
    error = _update_error(run["state"], ref["state"])
    assert error < tol, f"{name}: relative update error {error:.2e} >= {tol:g}"
    for step, (got, want) in enumerate(zip(run["losses"], ref["losses"])):
        assert abs(got - want) <= 2 * tol * abs(want) + 1e-5, f"{name} step {step}: {got} vs {want}"
    for key, value in results["rank1"][name]["run"]["state"].items():  # ranks agree
        assert torch.equal(value, run["state"][key]), f"{name}: ranks differ at {key}"


@pytest.mark.parametrize(
    ("name", "compute", "reduce"),
    [
        ("fsdp", "float32", "float32"),
        ("fsdp_bf16", "bfloat16", "bfloat16"),
        ("fsdp_bf16_policy", "bfloat16", "float32"),
        ("fsdp_fp16", "float16", "float32"),
        ("fsdp_offload_bf16", "bfloat16", "bfloat16"),
        ("fsdp_ckpt_bf16", "bfloat16", "bfloat16"),
    ],
)
def test_fsdp_dtypes_follow_the_options(
    results: dict[str, Any], name: str, compute: str, reduce: str
) -> None:
    run = results[name]["run"]
    seen = run["seen"]
    f = f"torch.{compute}"
    # inside forward (a hook on a Linear of a block unit): weights, inputs, outputs
    assert seen["forward_weight"] == seen["forward_input"] == seen["forward_output"] == {f}
    assert seen["all_gather"] == {f}
    assert seen["reduce_scatter"] == {f"torch.{reduce}"}
    # the master shards, their gradients and the optimizer state stay fp32
    assert seen["grad"] == {"torch.float32"}
    for state in [*run["between"], run["after"]]:  # after each backward, after training
        assert state["master"] == state["param"] == {"torch.float32"}
        assert state["sharded"] == {"SHARDED"}
    assert run["after"]["optim_state"] == {"torch.float32"}


def test_autocast_with_sharded_ddp_keeps_fp32_state(results: dict[str, Any]) -> None:
    for name, low in (("sdp_bf16", "torch.bfloat16"), ("sdp_fp16", "torch.float16")):
        run = results[name]["run"]
        assert run["seen"]["forward_weight"] == {"torch.float32"}  # autocast casts per op
        assert run["seen"]["forward_output"] == {low}
        assert run["optim_state"] == {"torch.float32"}


def test_offload_keeps_shards_and_grads_on_cpu_and_matches(results: dict[str, Any]) -> None:
    for name, same_as in (("fsdp_offload", "fsdp"), ("fsdp_offload_bf16", "fsdp_bf16")):
        run = results[name]["run"]
        for state in [*run["between"], run["after"]]:  # after backward, after the step
            assert state["shard_device"] == state["param_device"] == {"cpu"}
            assert not state["pinned"]  # pinned only where CUDA exists
        assert run["seen"]["grad_device"] == {"cpu"}
        assert run["seen"]["forward_device"] == {"cpu"}  # the compute device
        assert_state_dicts_close(run["state"], results[same_as]["run"]["state"], atol=0, rtol=0)


@pytest.mark.parametrize(("name", "kind"), [("fsdp_inf", "FSDP"), ("sdp_inf", "ShardedDDP")])
def test_inf_on_one_rank_skips_the_step_on_every_rank(
    results: dict[str, Any], name: str, kind: str
) -> None:
    run, ref = results[name]["run"], results[name]["ref"]
    # rank 1 alone saw an inf at step 1: every rank skipped it and halved the scale,
    # exactly like torch's GradScaler on the unsharded model with the inf
    assert run["scales"] == ref["scales"] == [1024.0, 512.0, 512.0], kind
    assert results["rank1"][name]["run"]["scales"] == run["scales"]
    assert_state_dicts_close(run["state"], ref["state"], atol=2e-5, rtol=1e-4)


def test_fp16_overflow_backs_off_and_skips(results: dict[str, Any]) -> None:
    run = results["fsdp_overflow"]["run"]
    # fp16 gradients of a loss scaled by 2**24 overflow: each step skipped, scale halved
    assert run["scales"] == [2.0**23, 2.0**22, 2.0**21]
    assert_state_dicts_close(run["state"], tiny_gpt().state_dict(), atol=0, rtol=0)


def test_checkpoint_wrapper_gives_equal_training(results: dict[str, Any]) -> None:
    for name, plain in (
        ("fsdp_ckpt", "fsdp"),
        ("fsdp_ckpt_bf16", "fsdp_bf16"),
        ("sdp_ckpt", "sdp"),
    ):
        got, want = results[name]["run"], results[plain]["run"]
        assert_state_dicts_close(got["state"], want["state"], atol=0, rtol=0)
        assert got["losses"] == want["losses"], name


def test_checkpointing_keeps_fewer_activation_bytes(results: dict[str, Any]) -> None:
    for kind, mem in results["memory"].items():
        assert mem["checkpointed"] < 0.6 * mem["plain"], f"{kind}: {mem}"


def test_state_dicts_are_full_precision_and_buffers_cast(results: dict[str, Any]) -> None:
    r = results["states"]
    assert set(r["dtypes"].values()) == set(r["local_master"].values()) == {"torch.float32"}
    assert any(r["beyond_bf16"].values()), "state_dict was gathered through bf16"
    assert_state_dicts_close(r["loaded"], r["target"], atol=0, rtol=0)
    # FairScale's default: buffer_dtype = compute_dtype; state dicts restore the original
    assert r["bn_live"]["1.running_mean"] == "torch.bfloat16"
    assert r["bn_live"]["1.num_batches_tracked"] == "torch.int64"
    for dtypes in (r["bn_state"], r["bn_local"]):
        assert dtypes["1.running_mean"] == dtypes["1.running_var"] == "torch.float32"
    assert r["bn_weight_grad"] == "torch.float32"


def test_single_rank_casts_and_offloads(rank_pool: Any) -> None:
    names = ["fsdp_bf16_policy", "fsdp_offload_bf16", "fsdp_ckpt"]
    for name, result in zip(names, rank_pool(1).run(pw.grid, [RUNS[n] for n in names])[0]):
        error = _update_error(result["run"]["state"], result["ref"]["state"])
        assert error < TOLERANCE[_precision(name)], f"{name}: {error:.2e}"


def test_fairscale_arguments_map_onto_the_policy() -> None:
    assert resolve_mixed_precision(False, None, None, False) is None
    assert resolve_mixed_precision(True, None, None, False) == MixedPrecision(FP16, FP16, FP16)
    assert resolve_mixed_precision(True, BF16, FP32, True) == MixedPrecision(BF16, FP32, FP32)
    policy = MixedPrecision(param_dtype=BF16)
    assert resolve_mixed_precision(policy, None, None, False) is policy
    assert policy.gradient_dtype(FP32) == BF16 and MixedPrecision().compute_dtype(FP32) == FP32
    with pytest.raises(ValueError, match=r"would override it"):
        resolve_mixed_precision(policy, BF16, None, False)
    with pytest.raises(ValueError, match=r"need mixed_precision=True"):
        resolve_mixed_precision(False, None, None, True)
    with pytest.raises(ValueError, match=r"param_dtype must be one of"):
        MixedPrecision(param_dtype=torch.int8)
    assert resolve_offload(False, True, None) and not resolve_offload(False, False, None)
    with pytest.raises(ValueError, match=r"move_grads_to_cpu=False with move_params_to_cpu=True"):
        resolve_offload(True, False, False)


def test_only_floating_inputs_are_cast() -> None:
    ids, x = torch.ones(2, dtype=torch.int64), torch.ones(2)
    args, kwargs = cast_floating(((ids, [x]), {"mask": torch.ones(2, dtype=torch.bool)}), BF16)
    assert args[0].dtype == torch.int64 and args[1][0].dtype == BF16
    assert kwargs["mask"].dtype == torch.bool
