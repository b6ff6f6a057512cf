"""Tensor parallelism composed with the data-parallel wrappers (issue 18), on 4 ranks.

2-D: ``tp = 2`` x data parallel 2, the data-parallel wrapper (FSDP with one root unit or
one unit per block, or ShardedDDP with OSS) over the mesh's data-parallel group, the tensor-parallel GPT inside. Three SGD
steps on a global batch of 4 sequences (2 per data-parallel rank) against the plain GPT
on the whole batch: losses per step and the final parameters (tensor-parallel shards
gathered, FSDP's full state dict) agree to fp32 rounding. ``clip_grad_norm_`` of the
tensor-parallel model equals torch's on the plain model for p = 1, 2, inf. The ``*-clip``
keys clip every step (the FSDP root's ``clip_grad_norm_``, also under hybrid sharding
``tp 2 x dp_replicate 2``): its norm equals the plain model's on every rank (the root
once summed only its tensor-parallel rank's part, each tp rank clipping by its own
factor), and the clipped steps equal the plain model's.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.nn.tensor_parallel import tp_workers as w

LOSS_TOL, PARAM_TOL = 1e-5, 2e-5
JOBS: dict[str, tuple[str, dict[str, Any]]] = {
    "sdp": ("tp_with_data_parallel", {"tp": 2, "wrapper": "sdp"}),
    "fsdp": ("tp_with_data_parallel", {"tp": 2, "wrapper": "fsdp"}),
    "fsdp-nested": ("tp_with_data_parallel", {"tp": 2, "wrapper": "fsdp", "nested": True}),
    "sdp-clip": ("tp_with_data_parallel", {"tp": 2, "wrapper": "sdp", "clip": 0.5}),
    "fsdp-clip": ("tp_with_data_parallel", {"tp": 2, "wrapper": "fsdp", "clip": 0.5}),
    "fsdp-nested-clip": (
        "tp_with_data_parallel",
        {"tp": 2, "wrapper": "fsdp", "nested": True, "clip": 0.5},
    ),
    "hsdp-clip": (
        "tp_with_data_parallel",
        {"tp": 2, "dp_replicate": 2, "wrapper": "hsdp", "nested": True, "clip": 0.5},
    ),
    "oss-clip": ("oss_clip_refused", {"tp": 2}),
    "clip-2": ("clip_parity", {"tp": 2}),
    "clip-4": ("clip_parity", {"tp": 4}),
}


@pytest.fixture(scope="module")
def results(rank_pool: Any) -> dict[str, list[Any]]:
    per_rank = rank_pool(4).run(w.run_jobs, list(JOBS.values()))
    return {key: [r[i] for r in per_rank] for i, key in enumerate(JOBS)}


@pytest.mark.parametrize(
    "key", ["fsdp", "fsdp-nested", "sdp", "sdp-clip", "fsdp-clip", "fsdp-nested-clip", "hsdp-clip"]
)
def test_tp_times_data_parallel_equals_plain(results: Any, key: str) -> None:
    for rank, r in enumerate(results[key]):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        for step, (got, want) in enumerate(zip(r["losses"], r["ref_losses"], strict=True)):
            assert abs(got - want) < LOSS_TOL, f"rank {rank} step {step}: {got} != {want}"
        for name, d in r["params"].items():
            assert d < PARAM_TOL, f"rank {rank}: {name} differs by {d:.3e} after {w.STEPS} steps"
        # the parameters moved: the comparison is not of two initial states
        assert r["losses"][-1] < r["losses"][0] - 1e-3
    if key.endswith("-clip"):
        ref_norms = results[key][0]["ref_norms"]
        assert all(n > 0.5 for n in ref_norms), "clipping never engaged"
        for rank, r in enumerate(results[key]):
            for step, (got, want) in enumerate(zip(r["norms"], ref_norms, strict=True)):
                assert abs(got - want) < 1e-5 * want, (
                    f"rank {rank} step {step}: norm {got} != plain model's {want}"
                )


def test_oss_clip_grad_norm_refuses_tensor_parallel_parts(results: Any) -> None:
    """Regression: ``OSS.clip_grad_norm`` over the data-parallel group of a
    tensor-parallel model returned its tensor-parallel rank's norm; it now refuses on
    every rank (before any collective) and names ``tp.clip_grad_norm_``."""
    for rank, r in enumerate(results["oss-clip"]):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert "outside the optimizer's group" in r["result"], f"rank {rank}: {r['result']}"
        assert "shardkit.nn.tensor_parallel.clip_grad_norm_" in r["result"]


@pytest.mark.parametrize("t", [2, 4])
def test_clip_grad_norm_is_global(results: Any, t: int) -> None:
    for rank, r in enumerate(results[f"clip-{t}"]):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        for norm_type, v in r.items():
            assert v["clipped"], f"p={norm_type}: max_norm too large to test clipping"
            assert v["total"] < 1e-6, f"rank {rank} p={norm_type}: total norm off by {v['total']}"
            assert v["grads"] < 1e-7, (
                f"rank {rank} p={norm_type}: clipped grads off by {v['grads']}"
            )
