"""The previous release's sharded formats: named by ``inspect``, converted by ``convert``.

The fixtures (``fixtures/previous_release/``, written by ``make_previous_release.py``
at the last commit whose runtime wrote them) are real checkpoints of
``save_fsdp_sharded`` (one unit, and three nested units), ``OSS.save_sharded`` and the
tensor-parallel ``save_sharded``, at 2 ranks, with the plain model's state dict and
the plain optimizer's state dict taken right after saving. Each converts to a
universal checkpoint that loads, bit for bit, into the plain model (one process) and
into FSDP / OSS at 3 ranks (another world size); the runtime itself refuses the old
directories and names the command.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardkit.checkpoint import CheckpointError, CheckpointUnsafeError
from shardkit.checkpoint.atomic import atomic_save
from shardkit.checkpoint.cli import main
from shardkit.checkpoint.legacy import FORMATS, detect_format
from shardkit.checkpoint.legacy.oss import load_optimizer_shards
from shardkit.checkpoint.universal import FORMAT as UNIVERSAL
from shardkit.checkpoint.universal import load_universal
from shardkit.nn import FSDP
from shardkit.nn.data_parallel.fully_sharded import load_fsdp_sharded
from shardkit.optim import OSS
from tests.checkpoint.fixtures.make_previous_release import mlp, tp_mlp
from tests.checkpoint.payload import plant_payload

FIXTURES = Path(__file__).parent / "fixtures" / "previous_release"
TAGS = {
    "fsdp_flat": "shardkit.fsdp_sharded/1",
    "fsdp_nested": "shardkit.fsdp_sharded/1",
    "oss": "shardkit.sharded_optim/1",
    "tensor_parallel": "shardkit.tensor_parallel_files",
}


def _expected(name: str) -> dict[str, Any]:
    return torch.load(FIXTURES / name / "expected.pt", weights_only=True)  # type: ignore[no-any-return]


def _differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Keys (and optimizer-state entries) whose values are not bitwise equal."""
    out = [k for k in want if k not in got]
    for key, value in want.items():
        if key not in got:
            continue
        if isinstance(value, dict):
            out += [f"{key}.{d}" for d in _differences(got[key], value)]
        elif isinstance(value, torch.Tensor):
            same = torch.equal(torch.as_tensor(got[key]).to(value.dtype), value)
            out += [] if same else [str(key)]
        elif got[key] != value:
            out.append(str(key))
    return out


def _optim_differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    problems = _differences(got["state"], want["state"])
    for g, w in zip(got["param_groups"], want["param_groups"], strict=True):
        problems += [f"group {k}" for k in w if k != "params" and g[k] != w[k]]
    return problems


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every fixture converted with the command line, in this process."""
    out = {}
    for name in TAGS:
        root = tmp_path_factory.mktemp(name)
        assert main(["convert", str(FIXTURES / name), str(root / "new")]) == 0
        out[name] = root / "new"
    return out


@pytest.mark.parametrize("name", sorted(TAGS))
def test_inspect_names_the_format_and_the_command(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(FIXTURES / name)]) == 0
    out = capsys.readouterr().out
    tag = TAGS[name]
    assert f"format      {tag}: {FORMATS[tag]}" in out
    assert "python -m shardkit.checkpoint convert " in out
    assert (
        detect_format(FIXTURES / name / ("ckpt-000002" if name != "tensor_parallel" else "")) == tag
    )


@pytest.mark.parametrize("name", ["fsdp_flat", "fsdp_nested", "tensor_parallel"])
def test_converted_loads_into_the_plain_model(name: str, converted: dict[str, Path]) -> None:
    """One process: the plain model and a plain AdamW get the saved state exactly
    (hyperparameters included: lr 0.05 over the 1.0 it was built with)."""
    expected = _expected(name)
    model = tp_mlp() if name == "tensor_parallel" else mlp()
    optim = torch.optim.AdamW(model.parameters(), lr=1.0) if expected["optim"] else None
    loaded = load_universal(converted[name], model, optim)
    assert loaded.step == (0 if name == "tensor_parallel" else 2)
    assert list(model.state_dict()) == list(expected["model"])
    assert not _differences(model.state_dict(), expected["model"])
    if optim is not None:
        assert not _optim_differences(optim.state_dict(), expected["optim"])
        assert optim.param_groups[0]["lr"] == 0.05


def _load_at_three(converted: dict[str, Path]) -> dict[str, list[str]]:
    """On each of 3 ranks: every converted checkpoint into the wrapper it came from (the
    tensor-parallel one into FSDP); the differences from the expected state, rank 0."""
    out: dict[str, list[str]] = {}
    for name in ("fsdp_flat", "fsdp_nested", "tensor_parallel"):
        expected = _expected(name)
        inner = tp_mlp() if name == "tensor_parallel" else mlp()
        if name == "fsdp_nested":
            inner[0], inner[3] = FSDP(inner[0]), FSDP(inner[3])
        model = FSDP(inner)
        optim = torch.optim.AdamW(model.parameters(), lr=1.0)
        load_fsdp_sharded(model, converted[name], optim if expected["optim"] else None)
        problems = _differences(model.state_dict(), expected["model"])
        full_optim = model.gather_full_optim_state_dict(optim)
        if expected["optim"] is not None and dist.get_rank() == 0:
            problems += _optim_differences(full_optim, expected["optim"])  # type: ignore[arg-type]
        out[name] = problems
    oss = OSS(mlp().parameters(), optim=torch.optim.AdamW, lr=1.0)
    oss.load_sharded(converted["oss"])
    oss.consolidate_state_dict(recipient_rank=0)
    want = _expected("oss")["optim"]
    out["oss"] = _optim_differences(oss.state_dict(), want) if dist.get_rank() == 0 else []
    return out


def test_converted_loads_at_another_world_size(rank_pool: Any, converted: dict[str, Path]) -> None:
    """Saved at 2 ranks, converted, loaded at 3: FSDP (one unit and nested), OSS, and
    the tensor-parallel files into FSDP; every value equal to the expected state."""
    per_rank = rank_pool(3).run(_load_at_three, converted, timeout_s=240)
    for rank, got in enumerate(per_rank):
        assert got == {name: [] for name in TAGS}, (rank, got)


def test_the_runtime_refuses_an_old_directory_and_names_convert(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="python -m shardkit.checkpoint convert"):
        load_universal(FIXTURES / "fsdp_flat", mlp())
    with pytest.raises(FileNotFoundError, match="not a checkpoint root"):
        load_universal(FIXTURES / "tensor_parallel", tp_mlp())


def test_converted_checkpoint_is_universal(converted: dict[str, Path]) -> None:
    import json

    for name, root in converted.items():
        ckpt = next(root.glob("ckpt-*"))
        layout = json.loads((ckpt / "manifest.json").read_text())["layout"]
        assert layout["format"] == UNIVERSAL, name
        if name != "tensor_parallel":
            assert layout["optimizer"]["class"] == "AdamW", name


def test_damaged_or_unsafe_old_files_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """convert verifies the old checkpoint's checksums and loads its files tensors-only."""
    copy = tmp_path / "oss"
    shutil.copytree(FIXTURES / "oss", copy)
    ckpt = copy / "ckpt-000002"
    plant_payload(ckpt, "optim-shard-1-of-2.pt", tmp_path / "marker")
    assert main(["convert", str(copy), str(tmp_path / "new")]) == 1
    err = capsys.readouterr().err
    assert "optim-shard-1-of-2.pt holds an object that is not a tensor" in err, err
    with pytest.raises(CheckpointUnsafeError):
        load_optimizer_shards(ckpt)
    assert not (tmp_path / "marker").exists() and not (tmp_path / "new").exists()
    path = ckpt / "optim-shard-0-of-2.pt"
    path.write_bytes(path.read_bytes()[:100])
    assert main(["convert", str(copy), str(tmp_path / "new")]) == 1
    assert "optim-shard-0-of-2.pt is truncated" in capsys.readouterr().err


def test_incomplete_or_mixed_oss_files_are_refused(tmp_path: Path) -> None:
    """The old OSS reader refuses files that do not form one save."""
    shard = {"param_groups": [{"params": [0, 1]}], "state": {0: {"x": torch.ones(1)}}}

    def write(rank: int) -> None:
        payload = {"format": "shardkit.sharded_optim/1", "rank": rank, "world_size": 2, **shard}
        atomic_save(payload, tmp_path / f"optim-shard-{rank}-of-2.pt")

    with pytest.raises(ValueError, match="found world sizes"):
        load_optimizer_shards(tmp_path)
    write(0)
    with pytest.raises(ValueError, match=r"shard files of ranks \[1\] \(of 2\) missing"):
        load_optimizer_shards(tmp_path)
    write(1)
    with pytest.raises(ValueError, match="state in more than one shard"):
        load_optimizer_shards(tmp_path)
