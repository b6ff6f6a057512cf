"""A refused ``load_universal`` leaves the model and optimizer exactly as they were.

Regression: the load filled the tensors and then read the rank's ``extra`` file, so a
planted pickle was refused after the model had been overwritten (on 2 ranks, rank 0
was filled when rank 1 refused); a hyperparameter it could not set failed after the
fill too. Now every check runs, and the ranks agree, before the first tensor is
written. A failure while reading the tensors (an I/O error after the checks, on any
rank; its last piece read in the tests) leaves every rank's model and optimizer
unchanged too: the pieces are read first, the ranks agree, then they are copied in
(before, the earlier pieces had been copied: problem ``partial``). A shard file
deleted after the checks still reads (opened up front).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointUnsafeError,
)
from shardkit.checkpoint.manifest import MANIFEST_NAME
from shardkit.checkpoint.universal import load_universal, loader, save_universal
from shardkit.nn import FSDP
from tests.checkpoint.payload import plant_payload

SHARD = "shard-0-of-1.safetensors"


def _trained(seed: int, lr: float | torch.Tensor = 0.01) -> tuple[nn.Module, Any]:
    """A small model and its Adam after one step (element-wise state and ``step``)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model(torch.randn(5, 3)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def _snapshot(model: nn.Module, optimizer: Any) -> list[Any]:
    out: list[Any] = [t.detach().clone() for t in model.state_dict().values()]
    state = optimizer.state_dict()
    for per_param in state["state"].values():
        out += [v.clone() for _, v in sorted(per_param.items())]
    out += [
        {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items()}
        for g in state["param_groups"]
    ]
    return out


def _same(a: list[Any], b: list[Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, dict) and isinstance(y, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        return bool(x == y)

    return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, list[Any]]:
    model, optimizer = _trained(1)
    ckpt = save_universal(tmp_path, 3, model, optimizer, extra={"pos": 7})
    return ckpt, _snapshot(model, optimizer)


def test_unsafe_extra_refused_before_any_write(saved: tuple[Path, list[Any]]) -> None:
    ckpt, _ = saved
    marker = ckpt.parent / "marker"
    plant_payload(ckpt, "extra-0.pt", marker)
    model, optimizer = _trained(2)
    before = _snapshot(model, optimizer)
    with pytest.raises(CheckpointUnsafeError, match="extra-0.pt"):
        load_universal(ckpt.parent, model, optimizer)
    assert _same(_snapshot(model, optimizer), before)
    assert not marker.exists()


def test_damaged_shard_refused_unchanged(saved: tuple[Path, list[Any]]) -> None:
    ckpt, _ = saved
    data = bytearray((ckpt / SHARD).read_bytes())
    data[-5] ^= 0xFF  # tensor bytes: only the checksum tells
    (ckpt / SHARD).write_bytes(bytes(data))
    model, optimizer = _trained(2)
    before = _snapshot(model, optimizer)
    with pytest.raises(CheckpointCorruptError, match="is corrupted"):
        load_universal(ckpt, model, optimizer)
    assert _same(_snapshot(model, optimizer), before)
    (ckpt / SHARD).unlink()
    with pytest.raises(CheckpointCorruptError, match="is missing"):
        load_universal(ckpt, model, optimizer)
    assert _same(_snapshot(model, optimizer), before)


def test_hyperparameter_that_cannot_be_set_refused_before_any_write(
    saved: tuple[Path, list[Any]],
) -> None:
    ckpt, _ = saved
    raw = json.loads((ckpt / MANIFEST_NAME).read_text())  # not hashed: layout only
    raw["layout"]["optimizer"]["param_groups"][0]["hyper"]["lr"] = "fast"
    (ckpt / MANIFEST_NAME).write_text(json.dumps(raw))
    model, optimizer = _trained(2, lr=torch.tensor(0.02))  # a tensor lr: filled in place
    before = _snapshot(model, optimizer)
    with pytest.raises(
        CheckpointMismatchError, match=r"param group 0: 'lr' is a tensor here, the checkpoint"
    ):
        load_universal(ckpt, model, optimizer)
    assert _same(_snapshot(model, optimizer), before)


def test_shard_deleted_after_the_checks_still_loads(
    saved: tuple[Path, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, want = saved
    real_read = loader._read

    def delete_then_read(*args: Any) -> Any:
        (ckpt / SHARD).unlink()  # the file is open (memory-mapped) since the checks
        return real_read(*args)

    monkeypatch.setattr(loader, "_read", delete_then_read)
    model, optimizer = _trained(2)
    load_universal(ckpt, model, optimizer)
    assert not (ckpt / SHARD).exists()
    assert _same(_snapshot(model, optimizer), want)


def _fail_last_read(monkeypatch: pytest.MonkeyPatch, reads: int) -> None:
    """Make the ``reads``-th piece read of the next load raise an I/O error."""
    real_read = loader._FileSource.read
    count = [0]

    def fails(self: Any, *args: Any) -> torch.Tensor:
        count[0] += 1
        if count[0] == reads:
            raise OSError("Input/output error")
        return real_read(self, *args)

    monkeypatch.setattr(loader._FileSource, "read", fails)


def _count_reads(monkeypatch: pytest.MonkeyPatch, load: Any) -> int:
    """The piece reads ``load()`` makes."""
    real_read = loader._FileSource.read
    count = [0]

    def counting(self: Any, *args: Any) -> torch.Tensor:
        count[0] += 1
        return real_read(self, *args)

    with monkeypatch.context() as patch:
        patch.setattr(loader._FileSource, "read", counting)
        load()
    return count[0]


def test_read_failure_after_the_checks_changes_nothing(
    saved: tuple[Path, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last piece read fails (an I/O error after every check): before, every
    earlier piece had been copied in (problem ``partial``)."""
    ckpt, want = saved
    reads = _count_reads(monkeypatch, lambda: load_universal(ckpt, *_trained(3)))
    assert reads > 3
    model, optimizer = _trained(2)
    before = _snapshot(model, optimizer)
    with monkeypatch.context() as patch:
        _fail_last_read(patch, reads)
        with pytest.raises(CheckpointError) as caught:
            load_universal(ckpt, model, optimizer)
    assert caught.value.problem == "read"
    message = str(caught.value)
    assert "failed while reading the tensors, after every check had passed" in message
    assert "OSError: Input/output error" in message
    assert "Nothing was copied: the model and optimizer are unchanged" in message
    assert _same(_snapshot(model, optimizer), before)
    load_universal(ckpt, model, optimizer)  # loading again: every value
    assert _same(_snapshot(model, optimizer), want)


# ---- 2 gloo ranks -------------------------------------------------------------------


def _refused_on_rank_1(root: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    model, optimizer = _trained(1)  # the same on both ranks: replicas
    ckpt = save_universal(root, 3, model, optimizer, extra={"rank": rank})
    if rank == 0:
        plant_payload(ckpt, "extra-1.pt", root / "marker")
    dist.barrier()
    target, target_opt = _trained(2)
    before = _snapshot(target, target_opt)
    out: dict[str, Any] = {}
    try:
        load_universal(root, target, target_opt)
        out["error"] = None
    except CheckpointError as err:
        out["error"] = f"{type(err).__name__}: {err}"
    out["unchanged"] = _same(_snapshot(target, target_opt), before)
    out["marker"] = (root / "marker").exists()
    return out


def test_refused_on_one_rank_leaves_every_rank_unchanged(rank_pool: Any, tmp_path: Path) -> None:
    out = rank_pool(2).run(_refused_on_rank_1, tmp_path, timeout_s=120)
    assert out[0]["error"].startswith("CheckpointError: loading failed on rank 1: "), out[0]
    assert out[1]["error"].startswith("CheckpointUnsafeError: "), out[1]
    assert "extra-1.pt" in out[1]["error"]
    assert [r["unchanged"] for r in out] == [True, True]
    assert [r["marker"] for r in out] == [False, False]


def _read_fails_on_rank_1(root: Path) -> dict[str, Any]:
    """A plain save at 2 ranks loaded into FSDP at 2 ranks (another initialisation,
    one step taken: state to keep); rank 1's last piece read fails."""
    rank = dist.get_rank()
    model, optimizer = _trained(1)
    save_universal(root, 3, model, optimizer)
    torch.manual_seed(5)
    target = FSDP(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)))
    target_opt = torch.optim.Adam(target.parameters(), lr=0.5)
    target(torch.randn(5, 3)).square().sum().backward()
    target_opt.step()
    scratch = FSDP(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)))
    reads = _count_reads(
        pytest.MonkeyPatch(),
        lambda: load_universal(root, scratch, torch.optim.Adam(scratch.parameters())),
    )
    before = _sharded_snapshot(target, target_opt)
    out: dict[str, Any] = {"reads": reads}
    with pytest.MonkeyPatch.context() as patch:
        if rank == 1:
            _fail_last_read(patch, reads)
        try:
            load_universal(root, target, target_opt)
            out["error"] = None
        except CheckpointError as err:
            out["error"] = f"{type(err).__name__} ({err.problem}): {err}"
    out["unchanged"] = _same(_sharded_snapshot(target, target_opt), before)
    load_universal(root, target, target_opt)
    out["loaded"] = not _same(_sharded_snapshot(target, target_opt), before)
    return out


def _sharded_snapshot(model: nn.Module, optimizer: Any) -> list[Any]:
    """This rank's shards, buffers, optimizer state (step included) and groups."""
    out: list[Any] = [t.clone() for t in model.local_state_dict().values()]  # type: ignore[operator]
    for param in model.parameters():
        state = optimizer.state.get(param, {})
        out.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    out += [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return out


def test_read_failure_on_one_rank_leaves_every_rank_unchanged(
    rank_pool: Any, tmp_path: Path
) -> None:
    out = rank_pool(2).run(_read_fails_on_rank_1, tmp_path, timeout_s=120)
    assert all(r["reads"] > 0 for r in out), out
    assert out[0]["error"].startswith("CheckpointError (load): loading failed on rank 1: "), out
    assert out[1]["error"].startswith("CheckpointError (read): "), out
    assert "OSError: Input/output error" in out[1]["error"], out
    assert [r["unchanged"] for r in out] == [True, True]
    assert [r["loaded"] for r in out] == [True, True]
