"""``FSDP.load_state_dict`` with a state dict that fails on one rank only loads nowhere.

Each rank holds 1/N of every parameter, so a full-state-dict load is only whole when
every rank loads. Before, a rank whose state dict did not fit (here: rank 1's copy has
one tensor of another shape; also what a rank passing ``{}`` gets, e.g. after a
``state_dict_on_rank_0_only`` save) raised and restored its own shards, while rank 0
returned normally with its shards loaded: the model then held parameters that were
neither the old values nor the new ones (``0.weight`` half old, half new), and rank 0
had no error to act on. Now the ranks agree first: every rank keeps its values and
raises, the other ranks naming the rank that failed.

2 ranks; a flat FSDP model and a nested one (an inner unit with a BatchNorm).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.nn import FSDP


def _model(kind: str) -> FSDP:
    torch.manual_seed(0)
    if kind == "flat":
        return FSDP(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)))
    inner = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    return FSDP(nn.Sequential(FSDP(inner), nn.Linear(6, 2)))


def _worker() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for kind in ("flat", "nested"):
        model = _model(kind)
        before = model.state_dict()
        new = {k: v + 1 for k, v in before.items()}
        if rank == 1:  # only this rank's copy does not fit
            last = list(new)[-1]
            new[last] = torch.zeros(new[last].numel() + 1)
        try:
            model.load_state_dict(new)
            out[kind] = "loaded"
        except RuntimeError as err:
            out[kind] = str(err)
        after = model.state_dict()
        out[f"{kind} unchanged"] = [k for k in before if not torch.equal(after[k], before[k])]
        good = {k: v + 2 for k, v in before.items()}  # a state dict that fits everywhere
        model.load_state_dict(good)
        after = model.state_dict()
        out[f"{kind} then loads"] = all(torch.equal(after[k], good[k]) for k in good)
    return out


@pytest.mark.timeout(120)
def test_load_failing_on_one_rank_loads_on_none(rank_pool: Any) -> None:
    out = rank_pool(2).run(_worker)
    for kind in ("flat", "nested"):
        assert "size mismatch for 1.bias" in out[1][kind], out[1]
        assert out[0][kind].startswith("Error(s) in loading state_dict"), out[0]
        assert "failed on another rank (rank 1: RuntimeError" in out[0][kind], out[0]
        for rank in (0, 1):
            assert out[rank][f"{kind} unchanged"] == [], (rank, kind, out[rank])
            assert out[rank][f"{kind} then loads"], (rank, kind, out[rank])
