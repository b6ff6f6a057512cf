"""``inspect`` shows a param group's parameter count apart from its hyperparameters.

Regression: the reader's ``num_params`` (how many parameters a group holds) was
printed inside the group's hyperparameters, ``group 0: {..., "num_params": 2}``, as
if it were one; ``inspect --json`` had it there too, ``{"lr": 0.5, ...,
"num_params": 1}``: now ``{"num_params": 1, "hyperparameters": {"lr": 0.5, ...}}``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from shardkit.checkpoint import reader
from shardkit.checkpoint.cli import _group_line, main
from shardkit.checkpoint.manifest import read_manifest
from shardkit.checkpoint.universal import save_universal


def _three_groups(root: Path) -> tuple[Path, torch.optim.Optimizer]:
    """A universal checkpoint of a model whose AdamW has groups of 2, 1 and 1
    parameters (lr 0.01, 0.5, 0.25); its directory and the optimizer."""
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
    return save_universal(root, 2, model, optimizer), optimizer


def test_inspect_universal_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, _ = _three_groups(tmp_path)
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


def test_inspect_json_universal_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, optimizer = _three_groups(tmp_path)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["optimizer"]["param_groups"]
    # the live optimizer's groups, as JSON holds them (betas: a list)
    live = [
        {k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"}
        for g in optimizer.param_groups
    ]
    assert [(g["lr"], g["weight_decay"], g["betas"]) for g in live] == [
        (0.01, 0.01, [0.9, 0.999]),
        (0.5, 0.01, [0.9, 0.999]),
        (0.25, 0.0, [0.9, 0.999]),
    ]
    assert got == [
        {"num_params": 2, "hyperparameters": live[0]},
        {"num_params": 1, "hyperparameters": live[1]},
        {"num_params": 1, "hyperparameters": live[2]},
    ]


def test_group_hyperparameters_as_json() -> None:
    """A param group's hyperparameters as JSON holds them (the old formats' torch
    param groups went with their reader)."""
    lr = torch.tensor(0.5)  # a tensor lr (torch allows one): shown as its repr
    hyper = {"lr": lr, "nested": [(1, 2), "a"], "betas": (0.9, 0.99), "foreach": None}
    as_json = {
        "num_params": 3,
        "hyperparameters": {
            "lr": "tensor(0.5000)",
            "nested": [[1, 2], "a"],
            "betas": [0.9, 0.99],
            "foreach": None,
        },
    }
    assert reader._group_summary(3, hyper) == as_json
    assert json.loads(json.dumps(as_json)) == as_json


def test_group_line_without_a_count() -> None:
    group = {"num_params": None, "hyperparameters": {"lr": 0.1, "betas": [0.9, 0.99]}}
    assert _group_line(group) == 'hyperparameters {"betas": [0.9, 0.99], "lr": 0.1}'
    group = {"num_params": 0, "hyperparameters": {"lr": 1}}
    assert _group_line(group) == '0 parameters, hyperparameters {"lr": 1}'
