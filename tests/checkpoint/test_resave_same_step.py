"""Saving again at a step already saved is crash-safe (regression).

A re-save at the step ``latest`` names (a resumed run saving at its resume step) used
to rewrite ``ckpt-<step>``'s files in place: with ``keep=1`` a crash mid-save left no
intact checkpoint. Now the new files go to ``ckpt-<step>.new`` and are swapped in
(see [Note: commit order] in ``shardkit.checkpoint.manifest``). The tests crash a
universal re-save at every file-system change it makes (one process) and on one rank
of two (gloo): the checkpoint that loads holds exactly the old tensors before the
commit point, exactly the new ones after it, and the next save tidies up.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.checkpoint import manifest
from shardkit.checkpoint.manifest import LATEST_NAME, CheckpointError, list_checkpoints
from shardkit.checkpoint.universal import load_universal, save_universal

STEP = 5


class _Crash(BaseException):
    """The process dies here: no ``except Exception`` handles it."""


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model and its Adam after one step (so it has element-wise state)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * seed)
    model(torch.randn(5, 3)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    for state in optimizer.state_dict()["state"].values():
        tensors += [v.clone() for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    return tensors


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _load(root: Path) -> list[torch.Tensor]:
    """Load ``root``'s newest checkpoint into a fresh model; a fallback warning fails."""
    model, optimizer = _trained(99)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_universal(root, model, optimizer)
    return _snapshot(model, optimizer)


@contextmanager
def _crash_at(n: int, crashed: list[str]) -> Iterator[None]:
    """Raise :class:`_Crash` at the ``n``-th file-system change of a save (counting
    from 0): a file written atomically, a directory deleted (this one half-deleted:
    one file removed, then the crash), a directory renamed. ``crashed`` gets the
    change's name."""
    count = [0]

    def hook(name: str, real: Callable[..., Any], before: Callable[..., None] = lambda *a: None):
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if count[0] == n:
                crashed.append(name)
                before(*args)
                raise _Crash(name)
            count[0] += 1
            return real(*args, **kwargs)

        return wrapped

    def half_delete(path: Any, *_: Any) -> None:
        files = sorted(p for p in Path(path).iterdir() if p.is_file())
        if files:
            files[0].unlink()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(manifest, "atomic_save", hook("atomic_save", manifest.atomic_save))
        patch.setattr(manifest, "atomic_write", hook("atomic_write", manifest.atomic_write))
        patch.setattr(shutil, "rmtree", hook("rmtree", shutil.rmtree, half_delete))
        patch.setattr(os, "rename", hook("rename", os.rename))
        yield


def test_crash_at_every_point_of_a_resave_leaves_old_or_new(tmp_path: Path) -> None:
    old_model, old_opt = _trained(1)
    new_model, new_opt = _trained(2)
    old, new = _snapshot(old_model, old_opt), _snapshot(new_model, new_opt)
    assert not _same(old, new)
    outcomes = []
    for n in range(20):
        root = tmp_path / f"crash{n}"
        save_universal(root, STEP, old_model, old_opt, keep=1)
        assert _same(_load(root), old)
        crashed: list[str] = []
        with _crash_at(n, crashed), suppress(_Crash):
            save_universal(root, STEP, new_model, new_opt, keep=1)
        if not crashed:  # the save ran to its end: every point was tried
            break
        loaded = _load(root)
        assert _same(loaded, old) or _same(loaded, new), (n, crashed)
        outcomes.append((crashed[0], "old" if _same(loaded, old) else "new"))
        # the next save at the same step finishes or discards the interrupted one
        save_universal(root, STEP, old_model, old_opt, keep=1)
        assert _same(_load(root), old), (n, crashed)
        assert sorted(os.listdir(root)) == ["ckpt-000005", LATEST_NAME], (n, os.listdir(root))
    # writes, manifest, latest -> ckpt-000005.new (the commit point), then the swap
    assert outcomes == [
        ("atomic_save", "old"),  # the shard file
        ("atomic_save", "old"),  # the extra file
        ("atomic_write", "old"),  # the manifest
        ("atomic_write", "old"),  # latest -> ckpt-000005.new
        ("rmtree", "new"),  # the previous ckpt-000005, half deleted
        ("rename", "new"),  # ckpt-000005.new -> ckpt-000005
        ("atomic_write", "new"),  # latest -> ckpt-000005
    ]
    assert _same(_load(tmp_path / "crash6"), old)  # re-saved after the crash above
    assert (root / LATEST_NAME).read_text() == "ckpt-000005\n"


def test_latest_naming_the_staging_directory(tmp_path: Path) -> None:
    """A crash between the commit point and the rename: ``latest`` names
    ``ckpt-<step>.new``, listed while it exists, else ``ckpt-<step>``."""
    model, optimizer = _trained(1)
    save_universal(tmp_path, STEP, model, optimizer)
    (tmp_path / LATEST_NAME).write_text("ckpt-000005.new\n")
    assert list_checkpoints(tmp_path) == [tmp_path / "ckpt-000005"]
    os.rename(tmp_path / "ckpt-000005", tmp_path / "ckpt-000005.new")
    assert list_checkpoints(tmp_path) == [tmp_path / "ckpt-000005.new"]
    assert _same(_load(tmp_path), _snapshot(model, optimizer))


def test_completed_resave_loads_new_values(tmp_path: Path) -> None:
    for seed in (1, 2, 3):
        model, optimizer = _trained(seed)
        save_universal(tmp_path, STEP, model, optimizer, keep=1)
        assert _same(_load(tmp_path), _snapshot(model, optimizer))
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000005", LATEST_NAME]


# ---- 2 gloo ranks -------------------------------------------------------------------


def _two_rank_resave(root: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    old_model, old_opt = _trained(1)  # the same on both ranks: replicas, as under DDP
    new_model, new_opt = _trained(2)
    old, new = _snapshot(old_model, old_opt), _snapshot(new_model, new_opt)
    out: dict[str, Any] = {}
    save_universal(root, STEP, old_model, old_opt, keep=1)
    real_save, real_rename = manifest.atomic_save, os.rename
    calls = [0]

    def dies_on_rank_1(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if rank == 1 and calls[0] == 2:  # its shard file is written, its extra is not
            raise OSError("rank 1 died")
        real_save(*args, **kwargs)

    manifest.atomic_save = dies_on_rank_1  # type: ignore[assignment]
    try:
        save_universal(root, STEP, new_model, new_opt, keep=1)
    except CheckpointError as err:
        out["writer crash"] = str(err)
    finally:
        manifest.atomic_save = real_save  # type: ignore[assignment]
    out["after writer crash is old"] = _same(_load(root), old)

    def refused(*args: Any) -> None:
        raise OSError("rename refused")

    os.rename = refused  # type: ignore[assignment]
    try:  # rank 0 commits, then cannot move ckpt-000005.new into place
        save_universal(root, STEP, new_model, new_opt, keep=1)
    except CheckpointError as err:
        out["rename failure"] = str(err)
    finally:
        os.rename = real_rename  # type: ignore[assignment]
    dist.barrier()
    out["latest after rename failure"] = (root / LATEST_NAME).read_text().strip()
    out["after rename failure is new"] = _same(_load(root), new)
    newer_model, newer_opt = _trained(3)
    save_universal(root, STEP, newer_model, newer_opt, keep=1)
    out["completed resave is newer"] = _same(_load(root), _snapshot(newer_model, newer_opt))
    out["listing"] = sorted(os.listdir(root))
    return out


def test_resave_on_two_ranks(rank_pool: Any, tmp_path: Path) -> None:
    out = rank_pool(2).run(_two_rank_resave, tmp_path, timeout_s=120)
    for rank in range(2):
        got = out[rank]
        assert "not committed: rank 1: OSError: rank 1 died" in got["writer crash"], got
        assert got["after writer crash is old"], got
        assert "committed as ckpt-000005.new (latest names it)" in got["rename failure"], got
        assert "OSError: rename refused" in got["rename failure"], got
        assert got["latest after rename failure"] == "ckpt-000005.new"
        assert got["after rename failure is new"], got
        assert got["completed resave is newer"], got
        assert got["listing"] == ["ckpt-000005", LATEST_NAME], got


def test_crashed_first_save_is_named_unfinished(tmp_path: Path) -> None:
    """A root whose first save crashed holds ``ckpt-<step>.new`` only: the load says
    it never finished saving; the next save deletes it."""
    model, optimizer = _trained(1)
    crashed: list[str] = []
    with _crash_at(1, crashed), suppress(_Crash):  # after the shard file
        save_universal(tmp_path, STEP, model, optimizer)
    assert crashed == ["atomic_save"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000005.new"]
    with pytest.raises(FileNotFoundError, match=r"\['ckpt-000005.new'\] never finished saving"):
        load_universal(tmp_path, *_trained(2))
    with pytest.raises(CheckpointError, match="manifest.json is missing: the save of ckpt-000005"):
        load_universal(tmp_path / "ckpt-000005.new", *_trained(2))
    save_universal(tmp_path, 6, model, optimizer)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000006", LATEST_NAME]
    assert _same(_load(tmp_path), _snapshot(model, optimizer))


def test_crash_during_recovery_of_a_crashed_resave(tmp_path: Path) -> None:
    """Two crashes in a row, ``keep=1``: a re-save crashed at point ``a``, then the next
    re-save of the same step (which first finishes or discards what the first left)
    crashed at point ``b``, for every ``a`` and ``b``. After each crash an intact
    checkpoint loads (no fallback warning) holding exactly one save's tensors: the
    committed one before, or a later one once committed; never a mix, never none."""
    saves = [_trained(seed) for seed in (1, 2, 3)]
    snaps = [_snapshot(m, o) for m, o in saves]
    assert not any(_same(snaps[i], snaps[j]) for i in range(3) for j in range(i))
    tried = 0
    for a in range(8):
        for b in range(12):
            root = tmp_path / f"crash{a}-{b}"
            save_universal(root, STEP, *saves[0], keep=1)
            first: list[str] = []
            with _crash_at(a, first), suppress(_Crash):
                save_universal(root, STEP, *saves[1], keep=1)
            if not first:
                break
            after_first = _load(root)
            assert _same(after_first, snaps[0]) or _same(after_first, snaps[1]), (a, first)
            second: list[str] = []
            with _crash_at(b, second), suppress(_Crash):
                save_universal(root, STEP, *saves[2], keep=1)
            loaded = _load(root)
            allowed = [after_first] if second else [snaps[2]]
            if second:  # the second save may have committed before its crash
                allowed.append(snaps[2])
            assert any(_same(loaded, s) for s in allowed), (a, first, b, second)
            tried += 1
            if not second:
                break
    assert tried > 40
