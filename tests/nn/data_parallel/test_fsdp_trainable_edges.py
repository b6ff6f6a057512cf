"""Regression tests from a fresh user's trial of the trainable set (issue 16 follow-up).

1. A parameter frozen between ``no_sync`` micro-batches keeps the gradient it already
   accumulated and is stepped with it, as in plain torch (FSDP dropped it: parameters
   off by 0.04-0.19 after one to three SGD steps).
2. Ranks that freeze different but same-shaped blocks are caught, naming the
   parameters by their full names (the agreement hashed unit-relative names, which
   were equal, so reduce-scatters of different layers were averaged silently).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardkit.nn.data_parallel.fully_sharded import TrainableMismatchError
from shardkit.testing.compare import assert_state_dicts_close
from tests.nn.data_parallel.fsdp_workers import global_batch, local_part, tiny_gpt, wrap_model


def _freeze_inside_no_sync(nesting: str) -> dict[str, Any]:
    ref = tiny_gpt()
    model = wrap_model(copy.deepcopy(ref), nesting)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mine, plain = dict(model.named_parameters()), dict(ref.named_parameters())
    rank, world = dist.get_rank(), dist.get_world_size()

    def both(names: list[str], flag: bool) -> None:
        for name in names:
            mine[name].requires_grad_(flag)
            plain[name].requires_grad_(flag)

    def micro(index: int, sync: bool) -> None:
        x, y = global_batch(index, world)
        ref(x, y)[1].div(2).backward()
        if sync:
            model(local_part(x, rank), local_part(y, rank))[1].div(2).backward()
        else:
            with model.no_sync():
                model(local_part(x, rank), local_part(y, rank))[1].div(2).backward()

    for step in range(3):
        micro(10 * step, sync=False)
        if step == 0:
            both(["blocks.0.mlp.0.weight", "wte.weight"], False)
        if step == 1:
            both(["blocks.0.mlp.0.weight", "wte.weight"], True)
            both(["blocks.1.attn.proj.weight"], False)
        micro(10 * step + 1, sync=True)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return {"state": model.state_dict(), "ref": ref.state_dict()}


def _disagree() -> str:
    model = wrap_model(tiny_gpt(), "block")
    frozen = "blocks.0." if dist.get_rank() == 0 else "blocks.1."  # same shapes
    for name, param in model.named_parameters():
        if name.startswith(frozen):
            param.requires_grad_(False)
    x, y = global_batch(0, dist.get_world_size())
    try:
        model(local_part(x, dist.get_rank()), local_part(y, dist.get_rank()))[1].backward()
    except TrainableMismatchError as err:
        return str(err)
    return "no error"


def _all() -> dict[str, Any]:
    return {
        "flat": _freeze_inside_no_sync("flat"),
        "block": _freeze_inside_no_sync("block"),
        "disagree": _disagree(),
    }


@pytest.fixture(scope="module")
def results(rank_pool: Any) -> list[Any]:
    return rank_pool(2).run(_all)


@pytest.mark.parametrize("nesting", ["flat", "block"])
def test_parameter_frozen_inside_no_sync_keeps_its_gradient(
    results: list[Any], nesting: str
) -> None:
    for per_rank in results:
        got = per_rank[nesting]
        assert_state_dicts_close(got["state"], got["ref"], atol=2e-5, rtol=1e-4)


def test_ranks_freezing_different_same_shaped_blocks_are_caught(results: list[Any]) -> None:
    for per_rank in results:
        message = per_rank["disagree"]
        assert message.startswith("ranks disagree on which parameters require a gradient")
        assert "24 parameters differ" in message, message  # both blocks: 12 + 12
        assert "`blocks.0." in message and "`blocks.1." in message, message
