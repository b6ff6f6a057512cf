"""FSDP trains like the unsharded model on the same global batch (DDP semantics).

Tiny GPT with the LM head tied to the token embedding, AdamW, two steps; the
FSDP model sees ``1 / N`` of each global batch. Losses (averaged over ranks), clip
norms and the final full state dicts match the reference to fp32 rounding.
"""

from __future__ import annotations

from typing import Any

import pytest

from shardkit.testing import assert_state_dicts_close
from tests.nn.data_parallel import fsdp_workers as w

FLAT = {"nesting": "flat"}
SIZE = {"nesting": "size"}
BLOCK_KEEP = {"nesting": "block", "raf": False}
NO_SYNC = {"nesting": "block", "no_sync": True, "micro": 2}
ACCUMULATE = {"nesting": "size", "micro": 2}
FROZEN_GROUPS = {"nesting": "block", "frozen": True, "groups": True}
CLIP = {"nesting": "block", "clip": True}
TWO_FORWARDS = {"nesting": "flat", "two_forwards": True}

ALL = [FLAT, SIZE, BLOCK_KEEP, NO_SYNC, ACCUMULATE, FROZEN_GROUPS, CLIP, TWO_FORWARDS]
GRID = {
    1: [FLAT, NO_SYNC],
    2: ALL,
    3: [SIZE, FROZEN_GROUPS],
    4: [BLOCK_KEEP, TWO_FORWARDS],
}


def _check(cfg: dict[str, Any], result: dict[str, Any]) -> None:
    assert result["names"] == result["ref_names"], "named_parameters() lost the original names"
    for step, (got, want) in enumerate(zip(result["losses"], result["ref_losses"])):
        assert abs(got - want) < 1e-5, f"{cfg}: step {step} loss {got} != reference {want}"
    for got, want in zip(result["norms"], result["ref_norms"]):
        assert abs(got - want) < 1e-5 * max(1.0, want), f"{cfg}: clip norm {got} != {want}"
    assert_state_dicts_close(result["state"], result["ref_state"], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_parity_with_unsharded_gpt(rank_pool: Any, world_size: int) -> None:
    configs = GRID[world_size]
    per_rank = rank_pool(world_size).run(w.parity_grid, configs)
    for cfg, result in zip(configs, per_rank[0]):
        _check(cfg, result)
    for other in per_rank[1:]:  # every rank returns the same full state
        for mine, theirs in zip(per_rank[0], other):
            assert_state_dicts_close(theirs["state"], mine["state"], atol=0.0, rtol=0.0)
    if world_size == 2:
        assert all(r["norms"] for cfg, r in zip(configs, per_rank[0]) if cfg.get("clip"))


def test_frozen_parameter_gets_no_grad_or_state(rank_pool: Any) -> None:
    for result in rank_pool(2).run(w.frozen_state_check):
        assert result == {"grad": True, "state": True}
