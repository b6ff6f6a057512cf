"""FSDP's reduce-scatter over gloo (a send and a receive per pair of ranks, commit
4962263) against the plain model, step by step, where the pairing could go wrong:
shard groups whose global ranks are not 0..k-1 (hybrid), a subgroup with a rank left
out, reshard_after_forward=2, a bf16 reduction, one or every reduction in flight,
no_sync, frozen and unused parameters, user isend/irecv with tag 0 across the backward,
two roots; and a rank that skips a backward ends its peer's in a CollectiveError."""

from __future__ import annotations

from typing import Any

import pytest

from tests.nn.data_parallel import gloo_scatter_workers as workers

# fp32: the sharded sum differs from the full-batch backward's in rounding only; the
# plain model's update per step is ~1e-2, so a misrouted chunk is far above this
FP32_PARAM, FP32_LOSS = 1e-6, 1e-5


@pytest.mark.parametrize("world", [2, 3, 4])
def test_training_matches_the_plain_model(rank_pool: Any, world: int) -> None:
    results = rank_pool(world).run(workers.grid, world)
    for rank, result in enumerate(results):
        calls = result["calls"]
        assert calls["native"] == 0, rank  # gloo's own reduce-scatter never ran
        assert calls["scatter_sends"] > 0, rank
        for key, got in result["results"].items():
            if not got["param"]:  # the rank outside the FSDP subgroup
                assert key.startswith("subgroup") and rank == 0, (key, rank)
                continue
            assert len(got["param"]) == workers.STEPS, key
            assert got["exchange_ok"], (key, rank)  # the user's tag-0 messages intact
            if "bound" in got:  # bf16 reduction: step 1 within 4 half-ulps, then drift
                assert got["param"][0] <= got["bound"], (key, got)
                assert max(got["param"]) <= 3 * got["bound"], (key, got)
                assert max(got["loss"]) <= 1e-4, (key, got)
            else:
                assert max(got["param"]) <= FP32_PARAM, (key, rank, got)
                assert max(got["loss"]) <= FP32_LOSS, (key, rank, got)
            if "unused_unchanged" in got:
                assert got["unused_unchanged"], key


def test_a_skipped_backward_ends_in_a_collective_error(rank_pool: Any) -> None:
    """Rank 1 skips the backward on a group with a 3 s timeout: rank 0's reduce-scatter
    fails with a CollectiveError naming it, after about the timeout (not a hang)."""
    first, second = rank_pool(2).run(workers.skipped_backward)
    assert first["outcome"].startswith(
        "CollectiveError: FullyShardedDataParallel: reduce-scatter of gradients failed on "
        "rank 0 of a group of 2"
    ), first
    assert 2.5 <= first["seconds"] <= 20.0, first
    assert second["outcome"] == "ok"
