"""OSS, ShardedDDP and FSDP check at construction that every rank has the same model."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.consistency import ConsistencyError
from shardkit.nn import FullyShardedDataParallel, ShardedDataParallel
from shardkit.optim import OSS


def _model(rank: int, case: str) -> nn.Module:
    width = 5 if case == "oss-shape" and rank == 1 else 4
    model = nn.Sequential()
    model.add_module("first", nn.Linear(4, width))
    name = "renamed" if case == "sdp-name" and rank == 1 else "second"
    model.add_module(name, nn.Linear(width, 2))
    return model


def _construct(case: str) -> str:
    model = _model(dist.get_rank(), case)
    try:
        optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
        ShardedDataParallel(model, optimizer)
    except ConsistencyError as err:
        return str(err)
    return "ok"


def _fsdp(case: str) -> str:
    model = _model(dist.get_rank(), "oss-shape" if case == "fsdp-shape" else "same")
    reshard = not (case == "fsdp-option" and dist.get_rank() == 0)
    try:
        FullyShardedDataParallel(model, reshard_after_forward=reshard)
    except ConsistencyError as err:
        return str(err)
    return "ok"


def _cases() -> dict[str, str]:
    results = {case: _construct(case) for case in ("same", "oss-shape", "sdp-name")}
    results.update({case: _fsdp(case) for case in ("fsdp-same", "fsdp-shape", "fsdp-option")})
    return results


def test_oss_and_sharded_ddp_name_the_mismatch(rank_pool) -> None:
    results = rank_pool(2).run(_cases)
    assert results[0] == results[1]
    assert results[0]["same"] == "ok"
    assert results[0]["oss-shape"].startswith("OSS: ranks disagree at entry 2 of 6: ranks [0] have")
    assert "ranks [1] have 'param_groups[0][0] shape=(5, 4)" in results[0]["oss-shape"]
    assert results[0]["sdp-name"].startswith("ShardedDataParallel: ranks disagree at entry 4")
    assert "ranks [1] have 'renamed.weight shape=(2, 4)" in results[0]["sdp-name"]
    assert results[0]["fsdp-same"] == "ok"
    assert re.match(  # the entry's index moves with the number of exchanged options
        r"FullyShardedDataParallel \(the FSDP unit wrapping Sequential\): ranks disagree at "
        r"entry \d+ of \d+: ",
        results[0]["fsdp-shape"],
    ), results[0]["fsdp-shape"]
    assert "ranks [1] have 'first.weight shape=(5, 4)" in results[0]["fsdp-shape"]
    assert "ranks [0] have 'option reshard_after_forward=False'" in results[0]["fsdp-option"]
