"""FSDP's step-time choices keep the results: the reduce-scatter over gloo (an
all-to-all and a sum) is the sum in rank order."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardkit.nn.data_parallel.fully_sharded import collectives
from tests.nn.data_parallel.fsdp_workers import count_calls


def _reduce_scatter_grid() -> dict[str, Any]:
    """reduce_scatter_flat on every (dtype, async) against the all-gathered inputs'
    sum in rank order; and how often gloo's own reduce-scatter was called."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    native = [0]

    def action() -> None:
        for dtype in (torch.float32, torch.bfloat16):
            for async_op in (False, True):
                shard = 1001  # not a round number of elements
                g = torch.Generator().manual_seed(100 + rank)
                flat = torch.randn(world * shard, generator=g).to(dtype)
                every = [torch.empty_like(flat) for _ in range(world)]
                dist.all_gather(every, flat)
                expected = torch.stack(every)[:, rank * shard : (rank + 1) * shard].sum(0)
                got = torch.full((shard,), float("nan"), dtype=dtype)
                pending = collectives.reduce_scatter_flat(got, flat, None, async_op=async_op)
                ran: list[bool] = []
                pending.then = functools.partial(ran.append, True)
                pending.wait()
                out[f"{dtype}-{async_op}"] = {
                    "max_diff": float((got.float() - expected.float()).abs().max()),
                    "then_ran": ran == [True],
                    "flat_unchanged": torch.equal(flat, every[rank]),
                }

    native[0] = count_calls(dist, "reduce_scatter_single", action)
    out["native_calls"] = native[0]
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_over_gloo_is_the_sum_in_rank_order(rank_pool: Any, world: int) -> None:
    for result in rank_pool(world).run(_reduce_scatter_grid):
        assert result.pop("native_calls") == 0  # the all-to-all, not gloo's clone + all-reduce
        for key, got in result.items():
            assert got["max_diff"] == 0.0, key  # bitwise: the same sum in the same order
            assert got["then_ran"] and got["flat_unchanged"], key
