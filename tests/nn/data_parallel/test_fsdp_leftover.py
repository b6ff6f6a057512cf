"""Full parameters left after a forward without backward: reused while current, re-gathered
on every rank once any rank's shard moved (the decision rides on the trainable-set
agreement, so the all-gathers stay paired)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel.fully_sharded import unit as fsdp_unit
from tests.nn.data_parallel.fsdp_workers import count_calls


def _gathers_of(step: Any) -> int:
    """All-gathers of parameters issued while ``step()`` runs."""
    return count_calls(fsdp_unit, "all_gather_flat", step)


def _scenarios() -> dict[str, Any]:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    model = FSDP(nn.Sequential(*[m for m in plain]))  # one unit, the root
    x = torch.ones(2, 4) * (dist.get_rank() + 1)
    out: dict[str, Any] = {}

    def train() -> None:
        model(x).sum().backward()

    model(x)  # forward without backward: the root keeps its full parameters
    out["reuse"] = _gathers_of(train)  # nothing written since: no all-gather
    model(x)
    with torch.no_grad():  # only this rank writes its shard
        if dist.get_rank() == 0:
            next(iter(model.parameters())).add_(1.0)
    out["one_rank_wrote"] = _gathers_of(train)  # every rank re-gathers
    with torch.no_grad():
        out["rank0_row"] = model(torch.eye(4)).flatten().tolist()  # same full params
    return out


def test_leftover_full_parameters_reused_or_regathered_on_every_rank(rank_pool: Any) -> None:
    first, second = rank_pool(2).run(_scenarios)
    assert first["reuse"] == second["reuse"] == 0
    assert first["one_rank_wrote"] == second["one_rank_wrote"] == 1
    assert first["rank0_row"] == second["rank0_row"]
