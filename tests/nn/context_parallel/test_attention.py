"""Ulysses and ring attention against full-sequence single-process SDPA (issue 31).

One spawned group of 4 ranks runs every config: cp = 2 (two groups, [0, 1] and [2, 3])
and cp = 4; causal and not; fp32 (held to 1e-5 against fp64 SDPA) and bf16 (held to
twice single-process bf16 SDPA's own error against fp64, plus one bf16 ulp of the
values' scale). Outputs and q/k/v gradients are gathered over the cp group and
compared whole.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardkit.nn.context_parallel import RingAttention, ring_attention
from tests.nn.context_parallel.cp_workers import (
    run_attention_parity,
    run_bad_inputs,
    run_token_mean_loss,
)

CONFIGS: list[dict[str, Any]] = (
    [
        {"cp": cp, "method": m, "causal": c, "seq": 16, "dtype": torch.float32}
        for cp in (2, 4)
        for m in ("ulysses", "ring")
        for c in (False, True)
    ]
    + [
        {
            "cp": 2,
            "method": "ulysses",
            "causal": False,
            "seq": 16,
            "dtype": torch.float32,
            "mask": True,
        },
        {"cp": 4, "method": "ring", "causal": True, "seq": 24, "dtype": torch.bfloat16},
        {"cp": 2, "method": "ulysses", "causal": True, "seq": 24, "dtype": torch.bfloat16},
    ]
    + [  # ring's query tiles smaller than, and not dividing, the chunks (6 and 10 rows)
        {"cp": 2, "method": "ring", "causal": True, "seq": 24, "dtype": torch.float32, "tile": 4},
        {"cp": 4, "method": "ring", "causal": False, "seq": 40, "dtype": torch.float32, "tile": 3},
        {"cp": 2, "method": "ring", "causal": True, "seq": 24, "dtype": torch.bfloat16, "tile": 5},
    ]
)


def test_parity_with_full_sequence_sdpa_and_each_other(rank_pool: Any) -> None:
    per_rank = rank_pool(4).run(run_attention_parity, CONFIGS)
    for i, cfg in enumerate(CONFIGS):
        groups = {tuple(per_rank[r][i]["ranks"]) for r in range(4)}
        assert groups == ({(0, 1), (2, 3)} if cfg["cp"] == 2 else {(0, 1, 2, 3)})
        for rank in range(4):
            res = per_rank[rank][i]
            for name, err in res["err"].items():
                if cfg["dtype"] == torch.float32:
                    assert err < 1e-5, (cfg, rank, name, err)
                else:
                    bound = 2 * res["plain_err"][name] + 2**-8
                    assert err < bound, (cfg, rank, name, err, bound)
    # Ulysses and ring agree (same inputs per cp): configs 0-3 are cp=2, 4-7 cp=4, each
    # ulysses non-causal, causal, ring non-causal, causal
    for i in (0, 4):
        for causal in (0, 1):
            uly, ring = per_rank[0][i + causal]["out"], per_rank[0][i + 2 + causal]["out"]
            assert uly.shape == ring.shape == (2, 4, 16, 8)
            assert (uly - ring).abs().max().item() < 1e-6


def test_bad_inputs_raise_clear_errors(rank_pool: Any) -> None:
    per_rank = rank_pool(4).run(run_bad_inputs)
    assert all(msgs == per_rank[0] for msgs in per_rank)
    heads, length, odd, piped = per_rank[0]
    assert "multiple of 2" in heads and "ring attention" in heads
    assert "keeps the sequence length" in length
    assert "divisible by 2 x cp" in odd
    assert "build the mesh with cp=1 or without pp" in piped


def test_token_mean_loss_is_the_global_token_mean(rank_pool: Any) -> None:
    for res in rank_pool(4).run(run_token_mean_loss):
        assert res["loss"] < 1e-6 and res["grad"] < 1e-7, res


def test_ring_query_tile_must_be_positive() -> None:
    x = torch.randn(2, 4, 4, 8)
    with pytest.raises(ValueError, match="query_tile must be a positive number .* got 0"):
        ring_attention(x, x, x, None, query_tile=0)  # type: ignore[arg-type]  # checked first


@pytest.mark.parametrize("tile", [0, -3])
def test_ring_attention_module_refuses_query_tile_at_construction(tile: int) -> None:
    """Regression: ``RingAttention(query_tile=0)`` was accepted and failed only at the
    first forward; the module refuses it when built (no group needed to see it)."""
    with pytest.raises(ValueError, match=f"query_tile must be a positive .* got {tile}"):
        RingAttention(None, query_tile=tile)  # type: ignore[arg-type]  # checked first
    assert RingAttention(None, query_tile=1).query_tile == 1  # type: ignore[arg-type]
