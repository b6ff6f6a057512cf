"""save_fsdp_sharded when a rank fails: every rank raises at once, nothing is committed.

4 ranks, hybrid 2 x 2 (the first replica's shard group writes) and full shard over 4:
a rank that cannot build its record (the other ranks used to wait in the save's
collective until the group timeout), a writers' save that fails (the other replica
used to wait in a barrier until the timeout), and the path a non-writing replica gets
back (it was ``ckpt-<step>`` unpadded, a directory that does not exist). The save is
``save_universal`` now: the failures are injected into the FSDP layout's ``entries``
and the universal writer's commit.
"""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from shardkit.checkpoint.manifest import CheckpointError
from shardkit.checkpoint.universal import writer as universal_writer
from shardkit.distributed.hybrid import hybrid_groups
from shardkit.nn.data_parallel.fully_sharded import sharded_checkpoint as sc
from shardkit.nn.data_parallel.fully_sharded.universal_layout import FSDPLayout
from tests.nn.data_parallel.fsdp_workers import tiny_gpt, wrap_model


def _model(hybrid: bool) -> Any:
    groups = hybrid_groups(2)
    if hybrid:
        return wrap_model(
            copy.deepcopy(tiny_gpt()),
            "block",
            process_group=(groups.shard, groups.replicate),
            sharding_strategy="HYBRID_SHARD",
        ), dist.get_rank(groups.replicate) == 0
    return wrap_model(copy.deepcopy(tiny_gpt()), "block"), True


def _latest(directory: str) -> str:
    return (Path(directory) / "latest").read_text().strip()


def _attempt(model: Any, directory: str, step: int) -> dict[str, Any]:
    start = time.monotonic()
    try:
        sc.save_fsdp_sharded(model, directory, step=step)
    except CheckpointError as err:
        return {
            "error": str(err),
            "problem": err.problem,
            "cause": type(err.__cause__).__name__ if err.__cause__ else None,
            "seconds": time.monotonic() - start,
        }
    return {"error": None, "seconds": time.monotonic() - start}


def _failing_build(*args: Any, **kwargs: Any) -> Any:
    if dist.get_rank() == 3:
        raise RuntimeError("no memory for the record")
    return _BUILD(*args, **kwargs)


def _failing_commit(root: Any, step: int, *args: Any, **kwargs: Any) -> Any:
    ckpt = Path(root) / f"ckpt-{step:06d}"
    raise CheckpointError(ckpt, "save", f"saving {ckpt} failed, disk full")


_BUILD, _COMMIT = FSDPLayout.entries, universal_writer.save_checkpoint


def _case(hybrid: bool) -> dict[str, Any]:
    key, out = "hybrid" if hybrid else "full", {}
    model, writer = _model(hybrid)
    directory = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory)
    path = sc.save_fsdp_sharded(model, directory[0], step=1)
    out[f"{key}/path"] = (str(path), path.is_file())
    FSDPLayout.entries = _failing_build  # type: ignore[method-assign]
    try:
        out[f"{key}/build"] = _attempt(model, directory[0], 2)
    finally:
        FSDPLayout.entries = _BUILD  # type: ignore[method-assign]
    out[f"{key}/build/latest"] = _latest(directory[0])
    if hybrid:
        universal_writer.save_checkpoint = _failing_commit  # type: ignore[assignment]
        try:
            out["hybrid/commit"] = _attempt(model, directory[0], 3)
        finally:
            universal_writer.save_checkpoint = _COMMIT
        out["hybrid/writer"] = writer
    out[f"{key}/directory"] = directory[0]
    return out


def _cases() -> dict[str, Any]:
    return {**_case(hybrid=True), **_case(hybrid=False)}


@pytest.fixture(scope="module")
def results(rank_pool: Any) -> list[dict[str, Any]]:
    return rank_pool(4).run(_cases)


@pytest.mark.parametrize("key", ["hybrid", "full"])
def test_every_rank_gets_an_existing_path(results: list[dict[str, Any]], key: str) -> None:
    for rank, r in enumerate(results):
        path, exists = r[f"{key}/path"]
        assert exists, (rank, path)
        assert Path(path).parent == Path(r[f"{key}/directory"]) / "ckpt-000001", (rank, path)


@pytest.mark.parametrize("key", ["hybrid", "full"])
def test_a_rank_that_cannot_build_fails_every_rank_at_once(
    results: list[dict[str, Any]], key: str
) -> None:
    for rank, r in enumerate(results):
        got = r[f"{key}/build"]
        ckpt = Path(r[f"{key}/directory"]) / "ckpt-000002"
        assert got["error"] == (
            f"saving {ckpt} failed, not committed: rank 3: RuntimeError: no memory for the record"
        ), rank
        assert got["problem"] == "save" and got["seconds"] < 20, (rank, got)
        assert got["cause"] == ("RuntimeError" if rank == 3 else None), rank
        assert r[f"{key}/build/latest"] == "ckpt-000001"  # nothing committed


def test_a_failed_write_reaches_the_other_replica(results: list[dict[str, Any]]) -> None:
    writers = [r["hybrid/writer"] for r in results]
    assert sum(writers) == 2  # one shard group of 2 writes
    for rank, r in enumerate(results):
        got = r["hybrid/commit"]
        ckpt = Path(r["hybrid/directory"]) / "ckpt-000003"
        assert got["error"] == f"saving {ckpt} failed, disk full", rank
        assert got["seconds"] < 20, (rank, got)
