"""Universal checkpoints: damage falls back, a planted pickle is refused, bad input is named.

- A flipped byte or a truncated shard file in the newest checkpoint: ``load_universal``
  of the root loads the previous one with a ``CheckpointFallbackWarning``; the damaged
  directory itself raises ``CheckpointCorruptError`` naming the file.
- A pickle payload planted in an ``extra-<rank>.pt`` (with a matching manifest) is
  refused with ``CheckpointUnsafeError`` and never runs.
- A shard whose index lost a piece (manifest rewritten to match): the load names the
  key and the missing elements; a non-universal checkpoint is refused; an ``extra``
  that would not load back is refused at save time.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn

from shardkit.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFallbackWarning,
    CheckpointMismatchError,
    CheckpointUnsafeError,
    save_checkpoint,
)
from shardkit.checkpoint.manifest import MANIFEST_NAME
from shardkit.checkpoint.universal import TensorView, load_universal, save_universal
from shardkit.checkpoint.universal.shardfile import ShardFile, read_index
from tests.checkpoint.payload import plant_payload
from tests.checkpoint.test_unsafe_load import assert_refused


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def _save_two(root: Path) -> tuple[nn.Module, nn.Module]:
    first, second = _model(1), _model(2)
    save_universal(root, 1, first)
    save_universal(root, 2, second)
    return first, second


def _rewrite_manifest(ckpt: Path, name: str) -> None:
    raw = json.loads((ckpt / MANIFEST_NAME).read_text())
    for record in raw["files"]:
        if record["name"] == name:
            record["size_bytes"] = (ckpt / name).stat().st_size
            record["sha256"] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    (ckpt / MANIFEST_NAME).write_text(json.dumps(raw))


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_newest_falls_back(tmp_path: Path, damage: str) -> None:
    first, second = _save_two(tmp_path)
    shard = tmp_path / "ckpt-000002" / "shard-0-of-1.safetensors"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[-3] ^= 0xFF  # tensor bytes: only the checksum can tell
        shard.write_bytes(bytes(data))
    else:
        shard.write_bytes(bytes(data[:100]))
    target = _model(3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loaded = load_universal(tmp_path, target)
    assert loaded.step == 1 and _same(target, first) and not _same(target, second)
    messages = [str(w.message) for w in seen if w.category is CheckpointFallbackWarning]
    assert len(messages) == 1 and "ckpt-000002" in messages[0], messages
    problem = "corrupted" if damage == "flip" else "truncated"
    assert problem in messages[0]
    with pytest.raises(CheckpointCorruptError) as caught:
        load_universal(tmp_path / "ckpt-000002", target)
    assert caught.value.problem == problem and caught.value.path == shard
    (tmp_path / "ckpt-000001" / "extra-0.pt").write_bytes(b"")
    with pytest.raises(CheckpointCorruptError, match="no usable checkpoint"):
        load_universal(tmp_path, target)


def test_planted_payload_in_extra_refused(tmp_path: Path) -> None:
    model = _model(1)
    save_universal(tmp_path, 1, model, extra={"pos": 3})
    ckpt = tmp_path / "ckpt-000001"
    marker = tmp_path / "marker"
    plant_payload(ckpt, "extra-0.pt", marker)
    with pytest.raises(CheckpointUnsafeError) as caught:
        load_universal(tmp_path, _model(2))
    assert_refused(caught.value, "extra-0.pt")
    assert not marker.exists()


def test_extra_that_would_not_load_refused_at_save(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="extra of rank 0 holds something other than"):
        save_universal(tmp_path, 1, _model(1), extra={"rng": np.zeros(3)})
    assert not (tmp_path / "latest").exists()


def test_lost_piece_named(tmp_path: Path) -> None:
    model = _model(1)
    ckpt = save_universal(tmp_path, 1, model)
    name = "shard-0-of-1.safetensors"
    pieces, scalars = read_index(ckpt / name)
    with safe_open(str(ckpt / name), framework="pt") as f:
        kept = [(p, f.get_tensor(p.name).clone()) for p in pieces if p.key != "1.weight"]
    (lost,) = [p for p in pieces if p.key == "1.weight"]
    kept.append((replace(lost, stop=3), torch.zeros(3)))  # elements [3, 8) lost
    with (ckpt / name).open("wb") as handle:
        ShardFile(kept, scalars).write_to(handle)
    _rewrite_manifest(ckpt, name)
    with pytest.raises(
        CheckpointMismatchError, match=r"'1.weight': part 0 of 1: elements \[3, 8\) missing"
    ):
        load_universal(tmp_path, _model(2))


def test_not_universal_refused(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, {"rank0.pt": {"w": torch.ones(2)}})
    with pytest.raises(CheckpointMismatchError, match="is not a universal checkpoint") as caught:
        load_universal(tmp_path, _model(1))
    assert caught.value.problem == "format"


def test_other_optimizer_class_refused(tmp_path: Path) -> None:
    model = _model(1)
    adam = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    adam.step()
    save_universal(tmp_path, 1, model, adam)
    target = _model(2)
    sgd = torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(
        CheckpointMismatchError, match="holds the state of a Adam optimizer, this run steps a SGD"
    ):
        load_universal(tmp_path, target, sgd)
    assert not _same(target, model)  # refused before any piece was filled
    load_universal(tmp_path, target)  # the model alone
    assert _same(target, model)


@pytest.mark.parametrize(
    ("lie", "message"),
    [
        ({"stop": 8}, r"tensor '\d+' is F32 \[3\], the index says F32 \[8\]"),
        ({"dtype": "float64"}, r"tensor '\d+' is F32 \[3\], the index says F64 \[3\]"),
        ({"view": TensorView((8,), 0, 5, 2, 1)}, r"need parts >= 1, stride >= 1 and 0 <= part"),
        ({"start": 6, "stop": 9}, r"piece \[6, 9\) outside the local tensor of 8 elements"),
    ],
)
def test_index_that_lies_about_its_tensor_refused(
    tmp_path: Path, lie: dict[str, Any], message: str
) -> None:
    """A shard file whose index does not match its tensors (a crafted or buggy file with
    a matching manifest) is refused as unreadable before any byte is copied: before, a
    range past the stored tensor failed inside a copy with a shape error (the model
    half filled), and a part outside its view went to ``as_strided``."""
    ckpt = save_universal(tmp_path, 1, _model(1))
    name = "shard-0-of-1.safetensors"
    pieces, scalars = read_index(ckpt / name)
    with safe_open(str(ckpt / name), framework="pt") as f:
        kept = [(p, f.get_tensor(p.name).clone()) for p in pieces if p.key != "1.weight"]
    (bias,) = [p for p in pieces if p.key == "1.weight"]  # 8 elements
    kept.append((replace(replace(bias, stop=3), **lie), torch.zeros(3)))  # 3 stored
    with (ckpt / name).open("wb") as handle:
        ShardFile(kept, scalars).write_to(handle)
    _rewrite_manifest(ckpt, name)
    target = _model(2)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=message) as caught:
        load_universal(tmp_path, target)
    assert caught.value.problem == "index"
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
