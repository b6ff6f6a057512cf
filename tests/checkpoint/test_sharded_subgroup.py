"""``save_fsdp_sharded`` of an FSDP model over a subgroup of the world.

The save tells every rank of the model's group about a failure on any of them (one
exchange over the shard group, and one over the replica group under hybrid
sharding). Without hybrid sharding the replica group is None, and that exchange ran
over ``None``, the world: ranks outside the model's group never joined, and the save
hung until the collective timeout (here: FSDP over ranks 0 and 1 of 3, rank 2 doing
something else). Now only the model's group takes part; the checkpoint loads back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.nn import FSDP
from shardkit.nn.data_parallel.fully_sharded import load_fsdp_sharded, save_fsdp_sharded
from shardkit.testing import run_distributed


def _worker(root: str) -> Any:
    group = dist.new_group([0, 1])
    if dist.get_rank() == 2:
        return "outside"
    torch.manual_seed(0)
    model = FSDP(nn.Linear(4, 4), process_group=group)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    saved = model.state_dict()
    save_fsdp_sharded(model, root, optimizer, step=1)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    load_fsdp_sharded(model, root, optimizer)
    loaded = model.state_dict()
    return all(torch.equal(loaded[k], saved[k]) for k in saved)


@pytest.mark.timeout(120)
def test_save_over_a_subgroup_of_the_world(tmp_path: Path) -> None:
    out = run_distributed(_worker, 3, str(tmp_path), timeout_s=40)
    assert out == [True, True, "outside"], out
