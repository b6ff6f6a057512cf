"""``inspect`` prints a param group's parameter count apart from its hyperparameters.

Regression: the reader's ``num_params`` (how many parameters a group holds) was
printed inside the group's hyperparameters, ``group 0: {..., "num_params": 2}``, as
if it were one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from shardkit.checkpoint.cli import _group_line, main
from shardkit.checkpoint.manifest import read_manifest
from shardkit.checkpoint.universal import save_universal


def test_inspect_universal_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    groups = [
        {"params": list(model[0].parameters())},
        {"params": [model[1].weight], "lr": 0.5},
        {"params": [model[1].bias], "lr": 0.25, "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    ckpt = save_universal(tmp_path, 2, model, optimizer)
    saved = read_manifest(ckpt).layout["optimizer"]["param_groups"]
    hyper = [json.dumps(g["hyper"], sort_keys=True) for g in saved]
    assert main(["inspect", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    shown = [line for line in lines if line.startswith("  group ")]
    assert shown == [
        f"  group 0: 2 parameters, hyperparameters {hyper[0]}",
        f"  group 1: 1 parameter, hyperparameters {hyper[1]}",
        f"  group 2: 1 parameter, hyperparameters {hyper[2]}",
    ]
    assert '"lr": 0.5' in shown[1] and '"weight_decay": 0.0' in shown[2]
    assert not any("num_params" in line for line in lines)


def test_group_line_without_a_count() -> None:
    assert _group_line({"lr": 0.1, "betas": [0.9, 0.99]}) == (
        'hyperparameters {"betas": [0.9, 0.99], "lr": 0.1}'
    )
    assert _group_line({"num_params": 0, "lr": 1}) == '0 parameters, hyperparameters {"lr": 1}'
