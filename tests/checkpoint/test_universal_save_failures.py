"""A ``save_universal`` that fails on one rank fails on every rank, at once, with the cause.

Two gloo ranks save a small DDP model, then fail a second save in four ways: an
``OSError`` on rank 1 while it writes its shard file, a ``RuntimeError`` from rank 0's
model state, rank 0 unable to write the manifest (the commit), and a ``ValueError``
(bad input) on rank 1. Every rank must raise within seconds (not the process group's
timeout), name the failing rank and the exception, chain it on the failing rank, and
leave the first checkpoint committed: ``latest`` unchanged, no staging directory left,
and ``load_universal`` loading exactly the first save's values.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.checkpoint import CheckpointError, manifest
from shardkit.checkpoint.agreement import RankFailure, describe_failures
from shardkit.checkpoint.manifest import LATEST_NAME
from shardkit.checkpoint.universal import load_universal, save_universal, writer
from shardkit.checkpoint.universal.shardfile import ShardFile

ELAPSED_LIMIT_S = 20.0  # the run's timeout is 60 s: a rank left waiting would exceed this


def _trained(seed: int) -> tuple[nn.Module, torch.optim.AdamW]:
    """A small model and AdamW after one step, the same on every rank."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
    model(x).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _values(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``) by name."""
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i, state in optimizer.state_dict()["state"].items():
        out.update({f"state.{i}.{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    return out


def _failure(save: Callable[[], object]) -> dict[str, Any]:
    """What ``save()`` raised (type, message, the chained cause) and how long it took."""
    start = time.monotonic()
    try:
        save()
    except Exception as err:
        cause = err.__cause__
        return {
            "type": type(err).__name__,
            "message": str(err),
            "cause": None if cause is None else f"{type(cause).__name__}: {cause}",
            "elapsed_s": time.monotonic() - start,
        }
    return {"type": None, "elapsed_s": time.monotonic() - start}


def _on(rank: int, target: Any, name: str, **kwargs: Any) -> contextlib.AbstractContextManager[Any]:
    """``mock.patch.object(target, name, **kwargs)`` on ``rank`` only."""
    if dist.get_rank() != rank:
        return contextlib.nullcontext()
    return mock.patch.object(target, name, **kwargs)


@contextlib.contextmanager
def _state_fails_on(rank: int, model: nn.Module) -> Iterator[None]:
    """``model.state_dict()`` raises a ``RuntimeError`` on ``rank`` in the block."""

    def unreadable(*_: Any) -> None:
        raise RuntimeError("layer 0 weight is unreadable")

    handle = model.register_state_dict_pre_hook(unreadable) if dist.get_rank() == rank else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def _disk_full(self: ShardFile, handle: Any) -> None:
    handle.write(b"half a shard file")
    raise OSError(errno.ENOSPC, "No space left on device")


def _failures_worker(root: Path) -> dict[str, Any]:
    model, optimizer = _trained(1)
    save_universal(root, 1, DistributedDataParallel(model), optimizer)
    newer_model, newer_opt = _trained(2)
    newer = DistributedDataParallel(newer_model)
    out: dict[str, Any] = {"saved": _values(model, optimizer), "root": root}

    def save() -> Path:
        return save_universal(root, 2, newer, newer_opt)

    with _on(1, ShardFile, "write_to", new=_disk_full):
        out["write"] = _failure(save)
    with _state_fails_on(0, newer_model):
        out["state"] = _failure(save)
    denied = PermissionError(errno.EACCES, "Permission denied")
    with _on(0, manifest, "_write_manifest", side_effect=denied):
        out["commit"] = _failure(save)
    with _on(1, writer, "check_entry", side_effect=ValueError("piece [0, 3) of 'x' is bad")):
        out["input"] = _failure(save)
    out["latest"] = (root / LATEST_NAME).read_text().strip()
    out["listing"] = sorted(os.listdir(root))
    dist.barrier()  # both ranks listed the root before anything loads from it
    loaded_model, loaded_opt = _trained(3)
    loaded = load_universal(root, DistributedDataParallel(loaded_model), loaded_opt)
    out["loaded step"] = loaded.step
    out["loaded"] = _values(loaded_model, loaded_opt)
    # a root whose first save fails at the commit: nothing to load, said so
    first = root / "first"
    with _on(0, manifest, "_write_manifest", side_effect=denied):
        out["first commit"] = _failure(lambda: save_universal(first, 1, newer, newer_opt))
    out["first listing"] = sorted(os.listdir(first))
    out["first load"] = _failure(lambda: load_universal(first, newer, newer_opt))
    return out


@pytest.fixture(scope="module")
def failed(rank_pool: Any, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("save_failures")
    result: list[dict[str, Any]] = rank_pool(2).run(_failures_worker, root, timeout_s=60)
    return result


def _failed(out: dict[str, Any], reason: str) -> str:
    """The message of a failed save of step 2 in the worker's root."""
    return f"saving {out['root'] / 'ckpt-000002'} failed, {reason}"


def test_write_failure_on_rank_1_raises_everywhere(failed: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(failed):
        got = out["write"]
        assert got["type"] == "CheckpointError", got
        assert got["elapsed_s"] < ELAPSED_LIMIT_S, got
        assert got["message"] == _failed(
            out, "not committed: rank 1: OSError: [Errno 28] No space left on device"
        ), got
        expected = "OSError: [Errno 28] No space left on device" if rank == 1 else None
        assert got["cause"] == expected, (rank, got)


def test_model_state_failure_on_rank_0_raises_everywhere(failed: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(failed):
        got = out["state"]
        assert got["type"] == "CheckpointError", got
        assert got["elapsed_s"] < ELAPSED_LIMIT_S, got
        assert got["message"] == _failed(
            out, "not committed: rank 0: RuntimeError: layer 0 weight is unreadable"
        ), got
        expected = "RuntimeError: layer 0 weight is unreadable" if rank == 0 else None
        assert got["cause"] == expected, (rank, got)


def test_commit_failure_on_rank_0_raises_everywhere(failed: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(failed):
        got = out["commit"]
        assert got["type"] == "CheckpointError", got
        assert got["elapsed_s"] < ELAPSED_LIMIT_S, got
        assert got["message"] == _failed(
            out, "not committed: rank 0: PermissionError: [Errno 13] Permission denied"
        ), got
        expected = "PermissionError: [Errno 13] Permission denied" if rank == 0 else None
        assert got["cause"] == expected, (rank, got)


def test_bad_input_on_one_rank_keeps_its_type(failed: list[dict[str, Any]]) -> None:
    rank_0, rank_1 = failed[0]["input"], failed[1]["input"]
    assert (rank_0["type"], rank_0["message"]) == (
        "ValueError",
        "rank 1: piece [0, 3) of 'x' is bad",
    )
    assert (rank_1["type"], rank_1["message"]) == ("ValueError", "piece [0, 3) of 'x' is bad")
    assert max(rank_0["elapsed_s"], rank_1["elapsed_s"]) < ELAPSED_LIMIT_S


def test_failed_saves_leave_the_previous_checkpoint(failed: list[dict[str, Any]]) -> None:
    for out in failed:
        assert out["latest"] == "ckpt-000001"
        assert out["listing"] == ["ckpt-000001", LATEST_NAME]  # no ckpt-000002(.new) left
        assert out["loaded step"] == 1
        saved, loaded = out["saved"], out["loaded"]
        assert sorted(saved) == sorted(loaded) and len(saved) == 4 + 4 * 3
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key


def test_failed_first_save_leaves_nothing_to_load(failed: list[dict[str, Any]]) -> None:
    for out in failed:
        commit, load = out["first commit"], out["first load"]
        assert commit["type"] == "CheckpointError" and "not committed: rank 0:" in commit["message"]
        assert out["first listing"] == []  # the staging directory was deleted
        assert load["type"] == "FileNotFoundError", load
        assert "is not a checkpoint root (no 'latest' file)" in load["message"], load


# ---- one process ----------------------------------------------------------------------


class _TwoArgError(ValueError):
    """An exception whose ``__init__`` takes other arguments than its message."""

    def __init__(self, key: str, count: int) -> None:
        super().__init__(f"{key}: {count} elements")


def test_rank_failure_is_text_that_pickles() -> None:
    failure = RankFailure.of(3, _TwoArgError("w", 7))
    assert pickle.loads(pickle.dumps(failure)) == failure
    assert failure.builtins == ("ValueError", "Exception", "BaseException")
    assert str(failure) == "rank 3: _TwoArgError: w: 7 elements"
    other = RankFailure.of(1, PermissionError(errno.EACCES, "Permission denied"))
    assert describe_failures([None, other, {"keys": {}}, failure]) == (
        "rank 1: PermissionError: [Errno 13] Permission denied; rank 3: _TwoArgError: w: 7 elements"
    )
    assert describe_failures([None, {}]) == ""


def test_one_rank_runtime_error_is_a_checkpoint_error(tmp_path: Path) -> None:
    model, optimizer = _trained(1)
    save_universal(tmp_path, 1, model, optimizer)

    def unreadable(*_: Any) -> None:
        raise RuntimeError("layer 0 weight is unreadable")

    model.register_state_dict_pre_hook(unreadable)
    with pytest.raises(CheckpointError) as info:
        save_universal(tmp_path, 2, model, optimizer)
    assert str(info.value) == (
        f"saving {tmp_path / 'ckpt-000002'} failed, not committed: rank 0: RuntimeError: "
        "layer 0 weight is unreadable"
    )
    assert info.value.problem == "save" and isinstance(info.value.__cause__, RuntimeError)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000001", LATEST_NAME]


def test_latest_written_then_failing_is_committed(tmp_path: Path) -> None:
    """``latest`` := ``ckpt-<step>.new`` done, then an error (an fsync of the root): the
    save is committed; it was reported as "not committed" while ``latest`` named it."""
    save_universal(tmp_path, 1, *_trained(1))
    real, named = manifest._point_latest, []

    def named_then_failed(root: Path, name: str) -> None:
        real(root, name)
        named.append(name)
        if len(named) == 1:
            raise OSError(errno.EIO, "Input/output error")

    model, optimizer = _trained(2)
    with mock.patch.object(manifest, "_point_latest", side_effect=named_then_failed):
        ckpt = save_universal(tmp_path, 2, model, optimizer)
    assert named == ["ckpt-000002.new", "ckpt-000002"]
    assert ckpt == tmp_path / "ckpt-000002"
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000001", "ckpt-000002", LATEST_NAME]
    loaded_model, loaded_opt = _trained(3)
    assert load_universal(tmp_path, loaded_model, loaded_opt).step == 2
    saved, loaded = _values(model, optimizer), _values(loaded_model, loaded_opt)
    assert all(torch.equal(loaded[k], v) for k, v in saved.items()) and len(saved) == 16
