"""A ``load_fsdp_sharded`` that fails leaves every rank's model and optimizer unchanged.

Before, the shards and buffers were copied as soon as they were read, and the
optimizer state checked afterwards: loading with an optimizer from a checkpoint saved
without one raised ``ValueError`` with the model already loaded; a read failing on
one rank left that rank partly loaded while the others loaded everything. Now every
rank reads and checks everything first, the ranks agree, then the values are copied.
The sibling ``load_local_state_dict`` checked each shape just before its copy: a
wrong last shape raised with every earlier shard loaded; now every shape is checked
first. And ``FSDP.load_state_dict`` (torch's ``load_state_dict`` copies every tensor
it can before raising on a size mismatch, and the summoned full parameters were
written back into the shards): the shards and buffers are now restored.

2 ranks, a 2-unit FSDP model that has stepped (optimizer state and ``step`` to keep).
``load_fsdp_sharded`` is ``load_universal`` now: the read failure is raised as
``CheckpointError`` (problem ``read``) on the failing rank too, and a checkpoint
without optimizer state as ``CheckpointMismatchError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.checkpoint.universal import loader
from shardkit.nn import FSDP
from shardkit.nn.data_parallel.fully_sharded import load_fsdp_sharded, save_fsdp_sharded


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    inner = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model = FSDP(nn.Sequential(FSDP(inner), nn.Linear(4, 2)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * seed)
    model(torch.randn(6, 3)).square().sum().backward()  # the same batch: equal buffers
    optimizer.step()
    return model, optimizer


def _snapshot(model: Any, optimizer: torch.optim.Optimizer) -> list[Any]:
    out: list[Any] = [t.clone() for t in model.local_state_dict().values()]
    for param in model.parameters():
        state = optimizer.state.get(param, {})
        out.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    out += [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return out


def _same(a: list[Any], b: list[Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        return bool(x == y)

    return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))


def _outcome(load: Any) -> str:
    try:
        load()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "loaded"


def _worker(root: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    saved, saved_opt = _model(1)
    save_fsdp_sharded(saved, root / "no_optim", step=1)
    save_fsdp_sharded(saved, root / "with_optim", saved_opt, step=1)
    want = _snapshot(saved, saved_opt)
    model, optimizer = _model(2)
    before = _snapshot(model, optimizer)
    out: dict[str, Any] = {}
    out["no optim"] = _outcome(lambda: load_fsdp_sharded(model, root / "no_optim", optimizer))
    out["no optim unchanged"] = _same(_snapshot(model, optimizer), before)
    real = loader._FileSource.read
    calls = [0]

    def counts(*args: Any) -> torch.Tensor:
        calls[0] += 1
        return real(*args)

    probe, probe_optimizer = _model(3)  # how many byte ranges a load reads on this rank
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader._FileSource, "read", counts)
        load_fsdp_sharded(probe, root / "with_optim", probe_optimizer)
    reads, calls[0] = calls[0], 0
    out["probe reads"] = reads

    def fails_late_on_rank_1(*args: Any) -> torch.Tensor:
        calls[0] += 1
        if rank == 1 and calls[0] == reads:  # the last read
            raise OSError("Input/output error")
        return real(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader._FileSource, "read", fails_late_on_rank_1)
        out["read failure"] = _outcome(
            lambda: load_fsdp_sharded(model, root / "with_optim", optimizer)
        )
    out["reads"] = calls[0]
    out["read failure unchanged"] = _same(_snapshot(model, optimizer), before)
    local = saved.local_state_dict()  # type: ignore[operator]
    last = list(local)[-1]  # a buffer: every flat shard comes before it
    local[last] = torch.zeros(local[last].numel() + 1)
    out["local"] = _outcome(lambda: model.load_local_state_dict(local))  # type: ignore[operator]
    out["local last key"] = last
    out["local unchanged"] = _same(_snapshot(model, optimizer), before)
    full = saved.state_dict()
    last = list(full)[-1]
    full[last] = torch.zeros(full[last].numel() + 1)
    out["full"] = _outcome(lambda: model.load_state_dict(full))
    out["full last key"] = last
    out["full unchanged"] = _same(_snapshot(model, optimizer), before)
    load_fsdp_sharded(model, root / "with_optim", optimizer)
    out["loaded"] = _same(_snapshot(model, optimizer), want)
    return out


@pytest.mark.timeout(180)
def test_failed_sharded_load_changes_nothing(rank_pool: Any, tmp_path: Path) -> None:
    out = rank_pool(2).run(_worker, tmp_path)
    for rank, got in enumerate(out):
        assert got["local"].startswith(f"ValueError: {got['local last key']}: shape "), got
        assert "!= this rank's" in got["local"], got
        assert got["local unchanged"], (rank, got)
        assert got["full unchanged"], (rank, got)
        assert got["full"].startswith("RuntimeError: Error(s) in loading state_dict"), got
        assert f"size mismatch for {got['full last key']}" in got["full"], got
        ckpt = tmp_path / "no_optim" / "ckpt-000001"
        assert got["no optim"].startswith(
            f"CheckpointMismatchError: {ckpt}: the checkpoint has no optimizer state"
        ), got
        assert got["no optim unchanged"], (rank, got)
        assert got["read failure unchanged"], (rank, got)
        assert got["loaded"], (rank, got)
    assert out[1]["read failure"].startswith("CheckpointError: loading "), out[1]
    assert "OSError: Input/output error" in out[1]["read failure"], out[1]
    assert out[0]["read failure"].startswith("CheckpointError: loading failed on rank 1"), out
    assert out[1]["reads"] == out[1]["probe reads"] > 1, out  # rank 1 failed on the last one
