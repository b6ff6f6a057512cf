"""Tensor-parallel layers (issue 18) against the unsplit layers, at degrees 1, 2 and 4.

Every configuration runs on the 4-rank pool inside one ``pool.run`` (a mesh with
``tp`` = 1, 2 or 4). fp32 outputs and gradients must equal the unsplit layer's to
1e-6 (the row-parallel sum adds T partial products in another order: rounding only).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.nn.tensor_parallel.partition import divide, merge_shards, shard
from tests.nn.tensor_parallel import tp_workers as w

DEGREES = [1, 2, 4]
TOL = 1e-6

LINEAR = {
    "column-gather": {"kind": "column", "gather_output": True},
    "column-local": {"kind": "column", "gather_output": False},
    "column-stride3": {"kind": "column", "gather_output": False, "stride": 3},
    "row-full-input": {"kind": "row", "input_is_parallel": False},
    "row-parallel-input": {"kind": "row", "input_is_parallel": True},
}
EMBEDDING = {
    "vocab": {"kind": "vocab"},
    "vocab-padding": {"kind": "vocab", "padding_idx": 5},
    "parallel": {"kind": "parallel"},
}


def _jobs() -> dict[str, tuple[str, dict[str, Any]]]:
    jobs: dict[str, tuple[str, dict[str, Any]]] = {}
    for t in DEGREES:
        for key, cfg in LINEAR.items():
            jobs[f"linear-{key}-{t}"] = ("linear_parity", {**cfg, "tp": t})
        for key, cfg in EMBEDDING.items():
            jobs[f"embedding-{key}-{t}"] = ("embedding_parity", {**cfg, "tp": t})
        jobs[f"init-{t}"] = ("init_method_semantics", {"tp": t})
        jobs[f"ce-{t}"] = ("cross_entropy_parity", {"tp": t})
        jobs[f"map-{t}"] = ("mappings_roundtrip", {"tp": t})
    jobs["rng-2"] = ("rng_tracker", {"tp": 2})
    jobs["dropout-2"] = ("dropout_streams", {})
    return jobs


@pytest.fixture(scope="module")
def results(rank_pool: Any) -> dict[str, list[Any]]:
    jobs = _jobs()
    per_rank = rank_pool(4).run(w.run_jobs, list(jobs.values()))
    return {key: [r[i] for r in per_rank] for i, key in enumerate(jobs)}


def _ok(results: dict[str, list[Any]], key: str) -> list[Any]:
    for rank, r in enumerate(results[key]):
        assert "error" not in r, f"{key} raised on rank {rank}:\n{r['error']}"
    return results[key]


def _assert_small(results: dict[str, list[Any]], key: str, tol: float = TOL) -> None:
    for rank, r in enumerate(_ok(results, key)):
        for name, value in r.items():
            assert value <= tol, f"{key}, rank {rank}: {name} differs by {value:.3e} (> {tol})"


@pytest.mark.parametrize("t", DEGREES)
@pytest.mark.parametrize("key", list(LINEAR))
def test_linear_equals_unsplit(results: Any, key: str, t: int) -> None:
    _assert_small(results, f"linear-{key}-{t}")


@pytest.mark.parametrize("t", DEGREES)
@pytest.mark.parametrize("key", list(EMBEDDING))
def test_embedding_equals_unsplit(results: Any, key: str, t: int) -> None:
    _assert_small(results, f"embedding-{key}-{t}")


@pytest.mark.parametrize("t", DEGREES)
def test_init_method_is_the_master_weights_shard(results: Any, t: int) -> None:
    for r in _ok(results, f"init-{t}"):
        for name in ("column", "row", "vocab", "embedding"):
            assert r[name] == 0.0, f"{name}: shard differs from the master's by {r[name]}"
            assert r[name + "_marked"] == 1.0, f"{name}: weight not marked tensor-parallel"


@pytest.mark.parametrize("t", DEGREES)
def test_vocab_parallel_cross_entropy(results: Any, t: int) -> None:
    for r in _ok(results, f"ce-{t}"):
        assert r["local_width"] == 32 / t  # never the full vocabulary
        assert r["loss"] <= TOL and r["grad"] <= TOL, r


@pytest.mark.parametrize("t", DEGREES)
def test_region_operators(results: Any, t: int) -> None:
    _assert_small(results, f"map-{t}")


def test_rng_tracker_streams(results: Any) -> None:
    per_rank = _ok(results, "rng-2")
    masks = per_rank[0]["masks"]
    coords = [r["coords"] for r in per_rank]
    for r in per_rank:
        assert r["stream_kept"] == 1.0, "the fork moved the default generator"
        assert "call model_parallel_manual_seed" in r["missing"]
    for a in range(4):
        for b in range(4):
            # outside a region: the same mask everywhere (seed 1234 on every rank)
            assert torch.equal(masks["outside"][a], masks["outside"][b])
            same_tp = coords[a]["tp"] == coords[b]["tp"]
            # inside: independent across tensor-parallel ranks, equal across replicas
            assert torch.equal(masks["inside"][a], masks["inside"][b]) == same_tp, (a, b)


def test_gpt_attention_dropout_forks_the_rng(results: Any) -> None:
    """All heads identical: only the RNG stream can make two ranks' heads differ."""
    for rank, r in enumerate(_ok(results, "dropout-2")):
        off, on = r["fork=False"], r["fork=True"]
        assert off["attn_equal_across_tp"] == 1.0, "identical heads differ without the fork"
        assert off["tracker_advanced"] == 0.0
        assert on["attn_equal_across_tp"] == 0.0, f"rank {rank}: same attention dropout masks"
        assert on["tracker_advanced"] == 1.0
        for mode in (off, on):  # the replicated MLP output drops the same elements
            assert mode["mlp_equal_across_tp"] == 1.0
            assert 0.2 < mode["mlp_has_drops"] < 0.4


# pure: shard then merge is the identity -----------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    world=st.sampled_from([1, 2, 3, 4]),
    stride=st.sampled_from([1, 2, 3]),
    data=st.data(),
)
def test_shard_then_merge_is_identity(shape: list[int], world: int, stride: int, data: Any) -> None:
    dim = data.draw(st.integers(0, len(shape) - 1))
    shape[dim] *= world * stride
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
    x = (torch.randn(shape) * 10).to(dtype)
    parts = [shard(x, dim, r, world, stride) for r in range(world)]
    assert all(p.shape[dim] == x.shape[dim] // world for p in parts)
    assert torch.equal(merge_shards(parts, dim, stride), x)
    # every element is held by exactly one rank
    assert sum(p.numel() for p in parts) == x.numel()


def test_uneven_split_names_the_sizes() -> None:
    with pytest.raises(
        ValueError, match=r"vocabulary 66: 66 is not divisible .* 4 \(remainder 2\)"
    ):
        divide(66, 4, "vocabulary 66")
    with pytest.raises(ValueError, match="size 10 of dim 0"):
        shard(torch.zeros(10), 0, 0, 4)
