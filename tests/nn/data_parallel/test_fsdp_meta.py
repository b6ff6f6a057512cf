"""FSDP deferred initialisation: a model built on the meta device, one unit at a time."""

from __future__ import annotations

from typing import Any

import torch

from shardkit.testing import assert_tensors_close
from tests.nn.data_parallel import fsdp_meta_workers as w


def test_meta_gpt_trains_like_the_plain_model(rank_pool: Any) -> None:
    for nesting in ("block", "flat"):
        results = rank_pool(2).run(w.meta_gpt_trains_like_plain, nesting)
        for r in results:
            assert r["finite"]
            assert_tensors_close(
                torch.tensor(r["got"]), torch.tensor(r["ref"]), atol=1e-5, name=f"{nesting} losses"
            )
            # every rank ends with its half (padding: < 2 elements per unit)
            assert r["total_elems"] / 2 <= r["local_elems"] <= r["total_elems"] / 2 + 8
        # rank 0's initialisation won on both ranks (seeded differently)
        assert results[0]["full_norm"] == results[1]["full_norm"]
        if nesting == "block":  # blocks were shards when the root's modules were made
            for r in results:
                assert 0 < r["block_elems_at_root_init"] <= r["block_full_elems"] / 2 + 8


def test_meta_default_init_and_errors(rank_pool: Any) -> None:
    r = rank_pool(1).run(w.meta_defaults_and_errors)[0]
    assert r["default_keys"] == ["0.bias", "0.weight", "1.bias", "1.weight", "2.bias", "2.weight"]
    assert r["default_ln_weight"] == [1.0] * 5 and r["default_finite"]
    assert r["bare"].startswith("ValueError: module `_Bare` (_Bare) has parameters")
    assert "no reset_parameters()" in r["bare"] and "param_init_fn" in r["bare"]
    assert r["lazy"].startswith("ValueError") and "left" in r["lazy"]
    assert "meta device" in r["lazy"]
    assert r["nested"].startswith("RuntimeError")
    assert "inside another summon_full_params()" in r["nested"]
