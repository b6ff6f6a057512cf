"""OSS state round trips: consolidated <-> plain optimizer, sharded save at N, load at M."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.optim import OSS
from shardkit.testing import assert_state_dicts_close
from tests.optim.test_oss import Net, average_grads, batch, global_batch, loss_fn, param_groups

OPTIMS: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.AdamW, {"lr": 0.01}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
]


def _train_oss(model: nn.Module, opt: OSS, steps: range) -> None:
    rank = dist.get_rank()
    for step in steps:
        x, y = batch(step, rank)
        loss_fn(model, x, y).backward()
        average_grads(model)
        opt.step()
        opt.zero_grad()


def _train_plain(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x, y = global_batch(step, dist.get_world_size())
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()


def _frozen_net() -> Net:
    torch.manual_seed(0)
    model = Net()
    model.mid.bias.requires_grad_(False)  # a frozen parameter in the middle of group 2
    return model


def _consolidated_round_trips() -> list[str]:
    """OSS -> consolidated -> plain optimizer, and plain -> OSS, continue identically."""
    done = []
    for optim, kw in OPTIMS:
        for recipient in (0, -1):
            model = _frozen_net()
            opt = OSS(param_groups(model, True), optim=optim, **kw)
            _train_oss(model, opt, range(3))
            opt.consolidate_state_dict(recipient_rank=recipient)
            full = None
            if recipient == -1 or dist.get_rank() == recipient:
                full = opt.state_dict()
            payload = [full]
            dist.broadcast_object_list(payload, src=0)
            full = payload[0]
            # into a plain optimizer: continue identically
            plain_model = copy.deepcopy(model)
            plain = optim(param_groups(plain_model, True), **kw)
            plain.load_state_dict(copy.deepcopy(full))
            # and back into a fresh OSS over a copy
            oss_model = copy.deepcopy(model)
            oss2 = OSS(param_groups(oss_model, True), optim=optim, **kw)
            oss2.load_state_dict(copy.deepcopy(full))
            _train_oss(model, opt, range(3, 6))
            _train_oss(oss_model, oss2, range(3, 6))
            _train_plain(plain_model, plain, range(3, 6))
            assert_state_dicts_close(model, plain_model, atol=1e-6)
            assert_state_dicts_close(oss_model, model, atol=0, rtol=0)
            done.append(f"{optim.__name__}->{recipient}")
    return done


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_consolidate_then_plain_and_back(rank_pool, world_size: int) -> None:
    results = rank_pool(world_size).run(_consolidated_round_trips)
    assert results[0] == ["AdamW->0", "AdamW->-1", "SGD->0", "SGD->-1"]


def _save_sharded(directory: str) -> str:
    model = _frozen_net()
    opt = OSS(param_groups(model, True), optim=torch.optim.AdamW, lr=0.01)
    _train_oss(model, opt, range(3))
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), Path(directory) / "model.pt")
    return str(opt.save_sharded(directory))


def _load_sharded_and_continue(directory: str) -> int:
    """Load at this world size; continue like a plain AdamW trained from step 0."""
    model = _frozen_net()
    model.load_state_dict(torch.load(Path(directory) / "model.pt"))
    opt = OSS(param_groups(model, True), optim=torch.optim.AdamW, lr=0.01)
    opt.load_sharded(directory)
    _train_oss(model, opt, range(3, 6))
    ref = _frozen_net()
    ref_opt = torch.optim.AdamW(param_groups(ref, True), lr=0.01)
    # the reference saw steps 0-2 on the saving world size's global batch (2 ranks)
    for step in range(3):
        x, y = global_batch(step, 2)
        loss_fn(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _train_plain(ref, ref_opt, range(3, 6))
    assert_state_dicts_close(model, ref, atol=1e-6)
    return len(opt.state)


def test_sharded_save_at_2_loads_at_1_3_4(rank_pool, tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    Path(directory).mkdir()
    paths = rank_pool(2).run(_save_sharded, directory)
    assert [Path(p).name for p in paths] == [
        "shard-0-of-2.safetensors",  # a universal checkpoint
        "shard-1-of-2.safetensors",
    ]
    trainable = sum(p.requires_grad for p in _frozen_net().parameters())
    for world_size in (1, 3, 4):
        held = rank_pool(world_size).run(_load_sharded_and_continue, directory)
        assert sum(held) == trainable
