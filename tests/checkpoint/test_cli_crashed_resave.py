"""``inspect`` / ``convert`` / ``load_universal`` of the ``ckpt-<step>.new`` directory a
crashed re-save left.

Regression: such a directory passed directly was inspected as "format unknown", exit
status 0 (without a manifest), or as an intact checkpoint (with a manifest, a crash
before the commit point) that no load would use and the next save deletes. Now both
say the save did not finish (exit status 1), as for an unfinished ``ckpt-<step>``;
one that ``latest`` names (committed, a crash before the rename) is read.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import suppress
from pathlib import Path

import pytest
import torch

from shardkit.checkpoint.cli import PROG, main
from shardkit.checkpoint.manifest import LATEST_NAME
from shardkit.checkpoint.universal import load_universal, save_universal
from tests.checkpoint.test_resave_same_step import STEP, _Crash, _crash_at, _trained

OLD, NEW = "ckpt-000005", "ckpt-000005.new"


def _crashed_resave(root: Path, at: int) -> list[str]:
    """Save step 5, then save it again, crashing at the re-save's ``at``-th file-system
    change (0, 1: the two files; 2: the manifest; 3: ``latest`` := ``.new``, the
    commit point; 4: deleting the old ``ckpt-000005``); the crashed change's name."""
    save_universal(root, STEP, *_trained(1), keep=1)
    crashed: list[str] = []
    with _crash_at(at, crashed), suppress(_Crash):
        save_universal(root, STEP, *_trained(2), keep=1)
    return crashed


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_leftover_without_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _crashed_resave(tmp_path, 1) == ["atomic_save"]  # the shard file written
    assert sorted(os.listdir(tmp_path)) == [OLD, NEW, LATEST_NAME]
    new = tmp_path / NEW
    assert os.listdir(new) == ["shard-0-of-1.safetensors"]
    why = (
        f"{new}: this save did not finish (no 'manifest.json'; files: "
        "['shard-0-of-1.safetensors']); use the root's newest committed one"
    )
    assert _cli(capsys, "inspect", str(new)) == (1, "", f"{PROG} inspect: error: {why}\n")
    code, text, err = _cli(capsys, "inspect", str(new), "--json")  # for scripts: JSON
    assert (code, err) == (1, "")
    assert json.loads(text) == {"ok": False, "problem": "not found", "message": why}
    out = tmp_path / "model.pt"
    assert _cli(capsys, "convert", str(new), str(out)) == (1, "", f"{PROG} convert: error: {why}\n")
    assert not out.exists()
    # the root: its committed step, the old save
    code, text, _ = _cli(capsys, "inspect", str(tmp_path), "--json")
    assert (code, json.loads(text)["directory"]) == (0, str(tmp_path / OLD))


def test_leftover_with_manifest_not_committed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _crashed_resave(tmp_path, 3) == ["atomic_write"]  # latest := ckpt-000005.new
    new = tmp_path / NEW
    assert sorted(os.listdir(new)) == [
        "extra-0.pt",
        "manifest.json",
        "shard-0-of-1.safetensors",
    ]
    assert (tmp_path / LATEST_NAME).read_text() == f"{OLD}\n"
    why = (
        f"{new}: this save did not finish (it was never committed: "
        f"{tmp_path / LATEST_NAME} names '{OLD}'); use the root's newest committed one"
    )
    assert _cli(capsys, "inspect", str(new)) == (1, "", f"{PROG} inspect: error: {why}\n")
    out = tmp_path / "model.pt"
    assert _cli(capsys, "convert", str(new), str(out)) == (1, "", f"{PROG} convert: error: {why}\n")
    assert not out.exists()
    (tmp_path / LATEST_NAME).unlink()  # no commit at all
    why = why.replace(f"names '{OLD}'", "names nothing (no file)")
    assert _cli(capsys, "inspect", str(new)) == (1, "", f"{PROG} inspect: error: {why}\n")


def test_leftover_committed_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A crash after the commit point: ``latest`` names ``ckpt-000005.new``, the new
    save, intact; the directory and the root both inspect as it (exit status 0)."""
    assert _crashed_resave(tmp_path, 4) == ["rmtree"]  # the old ckpt-000005 half deleted
    assert (tmp_path / LATEST_NAME).read_text() == f"{NEW}\n"
    new = tmp_path / NEW
    for path in (new, tmp_path):
        code, text, err = _cli(capsys, "inspect", str(path), "--json")
        info = json.loads(text)
        assert (code, err, info["directory"], info["step"]) == (0, "", str(new), STEP)
        assert [f["status"] for f in info["files"]] == ["ok", "ok"]


def test_load_universal_refuses_an_uncommitted_leftover_and_reads_a_committed_one(
    tmp_path: Path,
) -> None:
    """Regression: ``load_universal`` given the ``.new`` directory of a re-save crashed at
    the commit point loaded it (a save never committed, which the CLI refuses); it now
    raises the CLI's sentence and leaves the model as it was. The root loads the old
    save; a ``.new`` that ``latest`` names (a crash after the commit) loads as the new."""
    assert _crashed_resave(tmp_path, 3) == ["atomic_write"]  # latest still names the old
    old_model, _ = _trained(1)
    new_model, _ = _trained(2)
    model, optimizer = _trained(7)
    before = [t.clone() for t in model.state_dict().values()]
    new = tmp_path / NEW
    why = (
        f"{new}: this save did not finish (it was never committed: "
        f"{tmp_path / LATEST_NAME} names '{OLD}'); use the root's newest committed one"
    )
    with pytest.raises(FileNotFoundError) as err:
        load_universal(new, model, optimizer)
    assert str(err.value) == why
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))
    assert load_universal(tmp_path, model, optimizer).step == STEP
    for got, want in zip(model.state_dict().values(), old_model.state_dict().values()):
        assert torch.equal(got, want)

    committed = tmp_path / "after"
    assert _crashed_resave(committed, 4) == ["rmtree"]  # latest := ckpt-000005.new
    assert load_universal(committed / NEW, model, optimizer).step == STEP
    for got, want in zip(model.state_dict().values(), new_model.state_dict().values()):
        assert torch.equal(got, want)


def test_superseded_save_is_refused_by_the_cli_and_the_loader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression (fresh-user test): a crash after the commit point, before the old
    ``ckpt-000005`` was deleted, left it intact while ``latest`` names the new
    ``ckpt-000005.new``; passed directly it inspected as "ok" (exit 0) and
    ``load_universal`` loaded the OLD values. Both now refuse it; the root reads the
    new save."""
    root, other = tmp_path / "run", tmp_path / "other"
    save_universal(root, STEP, *_trained(1), keep=1)
    save_universal(other, STEP, *_trained(2), keep=1)
    shutil.copytree(other / OLD, root / NEW)  # the re-save, complete
    (root / LATEST_NAME).write_text(f"{NEW}\n")  # committed; the rename never ran
    old = root / OLD
    why = (
        f"{old}: superseded by {NEW}, a re-save of step {STEP} that {root / LATEST_NAME} "
        f"names (committed; its rename did not run); read {root / NEW} or the root"
    )
    assert _cli(capsys, "inspect", str(old)) == (1, "", f"{PROG} inspect: error: {why}\n")
    model, optimizer = _trained(7)
    before = [t.clone() for t in model.state_dict().values()]
    with pytest.raises(FileNotFoundError) as err:
        load_universal(old, model, optimizer)
    assert str(err.value) == why
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))
    assert load_universal(root, model, optimizer).step == STEP
    new_model, _ = _trained(2)
    for got, want in zip(model.state_dict().values(), new_model.state_dict().values()):
        assert torch.equal(got, want)
