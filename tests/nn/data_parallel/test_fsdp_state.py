"""FSDP state round-trips, sharded checkpoints across world sizes, memory, bad inputs."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from shardkit.memory import zero_memory_estimate
from shardkit.testing import assert_state_dicts_close, assert_tensors_close
from tests.nn.data_parallel import fsdp_workers as w


def _assert_optim_close(got: dict[str, Any], want: dict[str, Any], atol: float) -> None:
    assert sorted(got["state"]) == sorted(want["state"])
    for index, entry in want["state"].items():
        for key, value in entry.items():
            assert_tensors_close(got["state"][index][key], value, atol=atol, name=f"{index}.{key}")
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]]


def test_state_dict_and_optimizer_roundtrips(rank_pool: Any) -> None:
    results = rank_pool(2).run(w.state_roundtrips)
    first = results[0]
    assert_state_dicts_close(first["plain"], first["ref"], atol=2e-5, rtol=1e-4)
    _assert_optim_close(first["full_optim"], first["ref_optim"], atol=1e-5)
    assert results[1]["full_optim"] is None  # gathered on rank 0 only
    assert_state_dicts_close(first["resumed"], first["continued"], atol=0.0, rtol=0.0)
    assert_state_dicts_close(first["local_back"], first["before"], atol=0.0, rtol=0.0)
    assert [r["rank0_only_keys"] for r in results] == [len(first["before"]), 0]
    # a tied parameter is one tensor under each of its names, as in the plain state dict
    # (each name had its own copy: save_pretrained / safetensors wrote it once per name)
    assert first["tied_ref"] == [["lm_head.weight", "wte.weight"]]
    for nesting in w.NESTINGS:
        assert first["tied"][nesting] == first["tied_ref"], nesting


def test_sharded_checkpoint_loads_at_other_world_sizes(rank_pool: Any, tmp_path: Path) -> None:
    saved = rank_pool(2).run(w.save_sharded, str(tmp_path))[0]
    for world_size in (3, 1):
        loaded = rank_pool(world_size).run(w.load_sharded, str(tmp_path))[0]
        assert_state_dicts_close(loaded["state"], saved["state"], atol=0.0, rtol=0.0)
        _assert_optim_close(loaded["optim"], saved["optim"], atol=0.0)


def test_memory_per_rank_is_a_shard_plus_padding(rank_pool: Any) -> None:
    for world_size in (2, 4):
        for r in rank_pool(world_size).run(w.memory_and_unsharded_count):
            b, shard = r["bytes"], r["shard_elems"]
            assert b["parameters"] == 4 * shard  # one fp32 local shard per unit
            assert b["gradients"] == 4 * shard
            assert 8 * shard <= b["optimizer_state"] <= 8 * shard + 4 * r["n_params"]  # + steps
            padding_bytes = 16 * (world_size - 1) * r["units"]
            estimate = zero_memory_estimate(r["numel"], world_size, 3, mixed_precision=False)
            model_state = b["parameters"] + b["gradients"] + b["optimizer_state"]
            assert abs(model_state - estimate.total) <= padding_bytes + 4 * r["n_params"]
            # root + the running block + the prefetched block, never more
            assert r["max_unsharded"] <= 3


def test_bad_inputs_raise_clear_errors(rank_pool: Any) -> None:
    errors = rank_pool(1).run(w.bad_inputs)[0]
    assert errors["double"] == "0 own, 2 total"
    assert errors["twice"].startswith("ValueError") and "wrapped twice" in errors["twice"]
    assert "device" in errors["devices"] and "meta" in errors["devices"]
    assert "built before wrapping" in errors["optimizer"]
    assert errors["tie"].startswith("SharedParameterError")
    assert "wte.weight" in errors["tie"] and "Linear" in errors["tie"]


def test_edge_cases_match_unsharded(rank_pool: Any) -> None:
    for r in rank_pool(2).run(w.edge_cases):
        assert_state_dicts_close(r["state"], r["ref_state"], atol=1e-6, rtol=1e-5)
        assert_tensors_close(r["eval"], r["ref_eval"], atol=1e-6, name="eval output")
        assert set(r["states_after_eval"]) == {"SHARDED"}


def test_frozen_layer_before_trainable_in_one_unit(rank_pool: Any) -> None:
    for r in rank_pool(2).run(w.frozen_first_in_unit):
        assert_state_dicts_close(r["state"], r["ref_state"], atol=1e-6, rtol=1e-5)


def test_shard_then_gather_is_identity_and_ownership_exact(rank_pool: Any) -> None:
    rng = random.Random(0)
    shape_lists = [
        [
            [rng.choice([0, 1, 3, 7]) for _ in range(rng.randint(0, 3))]
            for _ in range(rng.randint(1, 4))
        ]
        for _ in range(8)
    ]
    for world_size in (3, 4):
        per_rank = rank_pool(world_size).run(w.shard_gather_identity, shape_lists)
        for shapes, r in zip(shape_lists, per_rank[0]):
            assert_state_dicts_close(r["gathered"], r["original"], atol=0.0, rtol=0.0)
            numels = [torch.Size(s).numel() for s in shapes]
            assert r["owned"] == numels, f"{shapes}: elements owned {r['owned']} != {numels}"
            assert r["shard_numel"] * world_size - sum(numels) < world_size
