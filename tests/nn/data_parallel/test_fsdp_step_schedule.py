"""FSDP's step-time choices keep the results: the reduce-scatter over gloo (an
all-to-all and a sum) is the sum in rank order, and the last unit of the forward order
keeps its full parameters for backward (one all-gather less) with parity intact."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardkit.nn.data_parallel.fully_sharded import collectives
from shardkit.nn.data_parallel.fully_sharded import unit as fsdp_unit
from shardkit.nn.data_parallel.fully_sharded.state import ShardedState
from shardkit.nn.data_parallel.fully_sharded.unit import runtime_of
from shardkit.testing import assert_state_dicts_close
from tests.nn.data_parallel.fsdp_workers import (
    count_calls,
    global_batch,
    local_part,
    tiny_gpt,
    wrap_model,
)


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


def _last_unit_kept() -> dict[str, Any]:
    """3 SGD steps of a 2-block GPT (one unit per block + the root) against the plain
    model; per step, the all-gathers in backward and each unit's state after forward."""
    ref = tiny_gpt()
    model = wrap_model(copy.deepcopy(ref), "block")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    units = [runtime_of(u) for u in model.units()]
    gathers, states = [], []
    for step in range(3):
        x, y = global_batch(step, world)
        ref(x, y)[1].backward()
        loss = model(local_part(x, rank), local_part(y, rank))[1]
        states.append([u.sharded_state.name for u in units if u is not None])
        gathers.append(count_calls(fsdp_unit, "all_gather_flat", loss.backward))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    after = [u.sharded_state is ShardedState.SHARDED for u in units if u is not None]
    return {
        "gathers": gathers,
        "states": states,
        "all_sharded_after": all(after),
        "state": model.state_dict(),
        "ref": ref.state_dict(),
    }


def test_last_unit_keeps_its_full_parameters_for_backward(rank_pool: Any) -> None:
    for result in rank_pool(2).run(_last_unit_kept):
        # units: root, block 0, block 1. The first forward records the order (block 1
        # reshards and backward gathers both blocks); later ones keep block 1.
        assert result["gathers"] == [2, 1, 1]
        assert result["states"][0] == ["UNSHARDED", "SHARDED", "SHARDED"]
        assert result["states"][1] == ["UNSHARDED", "SHARDED", "UNSHARDED"]
        assert result["all_sharded_after"]
        assert_state_dicts_close(result["state"], result["ref"], atol=1e-5, rtol=1e-5)
