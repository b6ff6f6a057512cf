"""``python -m shardkit.checkpoint inspect|convert`` on checkpoints written by 2 real ranks.

The ranks (the shared 2-rank pool) train a GPT under FSDP (one unit per Block + the
root) for one AdamW step and save it with ``save_fsdp_sharded``; also a small model
whose flat parameter needs padding (and has BatchNorm buffers), the tied GPT, and an
OSS sharded checkpoint. ``save_fsdp_sharded`` and ``OSS.save_sharded`` write universal
checkpoints (until the previous release they had formats of their own: their
inspection and conversion are in ``test_legacy_convert.py``). This process, with no
process group, inspects and converts them; the converted file loads into the plain
model with ``strict=True`` and equals the FSDP model's own full ``state_dict()``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from shardkit.checkpoint.cli import main
from shardkit.checkpoint.manifest import read_manifest
from shardkit.checkpoint.universal import FORMAT as UNIVERSAL
from shardkit.models import GPT, gpt_config
from shardkit.models.gpt import Block
from shardkit.nn import FullyShardedDataParallel
from shardkit.nn.data_parallel.fully_sharded import save_fsdp_sharded
from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy
from shardkit.optim import OSS
from tests.checkpoint.payload import plant_payload

VOCAB, SEQ = 64, 16


def _gpt(tied: bool) -> GPT:
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", vocab_size=VOCAB, block_size=SEQ))
    if not tied:
        model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone() * 0.5)
    return model


def _padded_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))  # 21 elements: 1 of padding


def _save_all(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    """On each pool rank: train one step and save sharded; rank 0 returns the FSDP
    models' full state dicts (every rank gathers them: a collective)."""
    rank, full = dist.get_rank(), {}
    for name, tied in (("gpt", False), ("tied", True)):
        with enable_wrap(wrapper_cls=FullyShardedDataParallel):
            wrapped = auto_wrap(_gpt(tied), transformer_auto_wrap_policy({Block}))
        model = FullyShardedDataParallel(wrapped)
        optim = torch.optim.AdamW(model.parameters(), lr=0.01)
        idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(rank))
        model(idx, idx)[1].backward()
        optim.step()
        save_fsdp_sharded(model, root / name, optim, step=5)
        full[name] = {k: v.clone() for k, v in model.state_dict().items()}
    model = FullyShardedDataParallel(_padded_model())
    model(torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))).sum().backward()
    save_fsdp_sharded(model, root / "padded", step=2)  # no optimizer
    full["padded"] = {k: v.clone() for k, v in model.state_dict().items()}
    plain = nn.Linear(4, 3)
    oss = OSS(plain.parameters(), optim=torch.optim.Adam, lr=0.1)
    plain(torch.ones(2, 4)).sum().backward()
    oss.step()
    oss.save_sharded(root / "oss", step=7)
    return full if rank == 0 else {}


@pytest.fixture(scope="module")
def saved(rank_pool: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    root = tmp_path_factory.mktemp("cli")
    full = rank_pool(2).run(_save_all, root, timeout_s=180)[0]
    return root, full


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_fsdp(saved: tuple[Path, Any], capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = saved
    ckpt = root / "gpt" / "ckpt-000005"
    code, out, _ = _run(capsys, "inspect", str(root / "gpt"), "--json")
    assert code == 0
    info = json.loads(out)
    assert info["directory"] == str(ckpt)  # the root's newest committed step
    assert (info["format"], info["step"], info["world_size"]) == (UNIVERSAL, 5, 2)
    assert info["layout"]["strategy"] == "fsdp"
    files = [
        (f["name"], f["rank"], f["size_bytes"], f["sha256"], f["status"]) for f in info["files"]
    ]
    expected = []
    for r in range(2):
        for name in (f"shard-{r}-of-2.safetensors", f"extra-{r}.pt"):
            path = ckpt / name
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            expected.append((path.name, r, path.stat().st_size, digest, "ok"))
    assert sorted(files) == sorted(expected)
    plain = _gpt(tied=False).state_dict()
    params = {p["name"]: p["shape"] for p in info["params"]}
    assert params == {k: list(v.shape) for k, v in plain.items()}
    assert {p["dtype"] for p in info["params"]} == {"float32"}
    assert info["units"] == {}
    opt = info["optimizer"]
    assert opt["class"] == "AdamW"
    assert opt["state_keys"] == ["exp_avg", "exp_avg_sq"]
    assert opt["scalar_keys"] == ["step"]
    assert [g["hyperparameters"]["lr"] for g in opt["param_groups"]] == [0.01]
    n_params = len(list(_gpt(tied=False).parameters()))
    assert [g["num_params"] for g in opt["param_groups"]] == [n_params]
    # the text form: the same values, one line each
    code, text, _ = _run(capsys, "inspect", str(root / "gpt"))
    assert code == 0
    lines = text.splitlines()
    assert lines[0] == f"checkpoint  {ckpt}"
    assert "step        5" in lines and "world size  2" in lines
    size0 = (ckpt / "shard-0-of-2.safetensors").stat().st_size
    digest0 = dict((f[0], f[3]) for f in expected)["shard-0-of-2.safetensors"]
    assert f"  shard-0-of-2.safetensors  rank 0  {size0:,} bytes  sha256 {digest0}  ok" in lines
    qkv = [line.split() for line in lines if line.startswith("  blocks.2.attn.qkv.weight ")]
    assert qkv == [
        ["blocks.2.attn.qkv.weight", "[384,", "128]", "float32", f"{384 * 128 * 4:,}", "bytes"]
    ]


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_convert_fsdp_loads_strict(
    saved: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    """The converted file loads into the plain GPT with strict=True and equals the
    FSDP model's full state_dict bit for bit."""
    root, full = saved
    out = tmp_path / f"model{suffix}"
    code, text, err = _run(capsys, "convert", str(root / "gpt"), str(out))
    assert (code, err) == (0, "")
    assert text.startswith(f"wrote {out}: 53 tensors, ")
    state = load_file(out) if suffix == ".safetensors" else torch.load(out, weights_only=True)
    model = _gpt(tied=False)
    model.load_state_dict(state, strict=True)
    expected = full["gpt"]
    assert list(model.state_dict()) == list(expected)
    differ = [k for k, v in model.state_dict().items() if not torch.equal(v, expected[k])]
    assert not differ, differ
    assert not torch.equal(expected["lm_head.weight"], _gpt(tied=False).lm_head.weight)  # trained


def test_convert_padding_and_buffers(
    saved: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A unit of 21 elements at 2 ranks (11 + 11, one of padding) and BatchNorm buffers."""
    root, full = saved
    code, out, _ = _run(capsys, "inspect", str(root / "padded"), "--json")
    assert code == 0
    info = json.loads(out)
    assert info["optimizer"] is None
    assert sorted(p["name"] for p in info["params"]) == sorted(_padded_model().state_dict())
    code, _, _ = _run(capsys, "convert", str(root / "padded"), str(tmp_path / "p.pt"))
    assert code == 0
    model = _padded_model()
    model.load_state_dict(torch.load(tmp_path / "p.pt", weights_only=True), strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, full["padded"][k]), k


def test_convert_tied_gpt_keeps_every_name(
    saved: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The format records every state-dict key of a parameter (a tied LM head under
    both names): the output loads strictly and equals the FSDP model's state dict."""
    root, full = saved
    code, _, _ = _run(capsys, "convert", str(root / "tied"), str(tmp_path / "t.pt"))
    assert code == 0
    state = torch.load(tmp_path / "t.pt", weights_only=True)
    assert sorted(state) == sorted(full["tied"])
    model = _gpt(tied=True)
    model.load_state_dict(state, strict=True)
    assert all(torch.equal(v, full["tied"][k]) for k, v in model.state_dict().items())


def test_oss_inspect_and_convert(
    saved: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """OSS.save_sharded: a universal checkpoint of the optimizer's parameters under
    ``params.<index>`` with their state; convert writes them as a state dict."""
    root, _ = saved
    code, out, _ = _run(capsys, "inspect", str(root / "oss"), "--json")
    assert code == 0
    info = json.loads(out)
    assert (info["format"], info["step"], info["world_size"]) == (UNIVERSAL, 7, 2)
    assert [(p["name"], p["shape"]) for p in info["params"]] == [
        ("params.0", [3, 4]),
        ("params.1", [3]),
    ]
    opt = info["optimizer"]
    assert (opt["class"], opt["state_keys"], opt["scalar_keys"]) == (
        "Adam",
        ["exp_avg", "exp_avg_sq"],
        ["step"],
    )
    assert opt["params_with_state"] == 2  # weight and bias, one per rank
    code, _, err = _run(capsys, "convert", str(root / "oss"), str(tmp_path / "o.pt"))
    assert (code, err) == (0, "")
    assert sorted(torch.load(tmp_path / "o.pt", weights_only=True)) == ["params.0", "params.1"]


def test_damaged_and_unsafe(
    saved: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A corrupted file: inspect says which (exit 1), convert refuses. A planted pickle
    payload in a rank's extra file (the only pickle of a universal checkpoint), with a
    matching manifest: inspect and convert never unpickle it; nothing runs."""
    root, _ = saved
    copy = tmp_path / "gpt"
    shutil.copytree(root / "gpt", copy)
    ckpt = copy / "ckpt-000005"
    path = ckpt / "shard-1-of-2.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    code, out, _ = _run(capsys, "inspect", str(copy), "--json")
    statuses = {f["name"]: f["status"].split(":")[0] for f in json.loads(out)["files"]}
    assert code == 1 and statuses.pop(path.name) == "corrupted", statuses
    assert set(statuses.values()) == {"ok"}
    code, _, err = _run(capsys, "convert", str(copy), str(tmp_path / "x.pt"))
    assert code == 1 and f"{path} is corrupted: sha256" in err
    path.write_bytes((root / "gpt" / "ckpt-000005" / path.name).read_bytes())
    plant_payload(ckpt, "extra-1.pt", tmp_path / "marker")
    extra = next(f for f in read_manifest(ckpt).files if f.name == "extra-1.pt")
    assert extra.sha256 == hashlib.sha256((ckpt / "extra-1.pt").read_bytes()).hexdigest()
    for argv in (["inspect", str(copy)], ["convert", str(copy), str(tmp_path / "x.pt")]):
        code, _, err = _run(capsys, *argv)
        assert (code, err) == (0, ""), err
    assert not (tmp_path / "marker").exists()


def test_module_entry_point(saved: tuple[Path, Any]) -> None:
    """``python -m shardkit.checkpoint`` runs the same command line (no ranks)."""
    root, _ = saved
    proc = subprocess.run(
        [sys.executable, "-m", "shardkit.checkpoint", "inspect", str(root / "padded")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "format      shardkit.universal/1: universal" in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "shardkit.checkpoint", "convert", str(root / "padded")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "the following arguments are required: out" in bad.stderr


def test_inspect_unfinished_save_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: a ``ckpt-<step>`` directory whose save never wrote its manifest was
    inspected as 'format unknown, files 0' with exit status 0."""
    unfinished = tmp_path / "ckpt-000006"
    unfinished.mkdir()
    (unfinished / "shard-0-of-2.safetensors").write_bytes(b"partial")
    assert main(["inspect", str(unfinished)]) == 1
    err = capsys.readouterr().err
    assert "did not finish" in err and "shard-0-of-2.safetensors" in err


def test_inspect_json_reports_errors_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression (fresh-user test): ``inspect --json`` of a path it cannot read printed
    its error as text on stderr, which a script parsing stdout cannot read. Now: one
    JSON object on stdout, nothing on stderr, the same exit status 1; without
    ``--json`` the text line is unchanged."""
    missing = tmp_path / "nope"
    bad_manifest = tmp_path / "ckpt-000001"
    bad_manifest.mkdir()
    (bad_manifest / "manifest.json").write_text("{not json")
    unfinished = tmp_path / "ckpt-000006"
    unfinished.mkdir()
    (unfinished / "shard-0-of-2.safetensors").write_bytes(b"partial")
    cases = [
        (missing, "not found", f"{missing} is not a directory"),
        (bad_manifest, "manifest", f"{bad_manifest / 'manifest.json'} is unreadable: "),
        (unfinished, "not found", f"{unfinished}: this save did not finish"),
    ]
    prefix = "python -m shardkit.checkpoint inspect: error: "
    for path, problem, start in cases:
        assert main(["inspect", str(path)]) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(prefix + start) and err.count("\n") == 1, err
        assert main(["inspect", str(path), "--json"]) == 1
        out, json_err = capsys.readouterr()
        assert json_err == ""
        message = err.removeprefix(prefix).rstrip("\n")
        assert json.loads(out) == {"ok": False, "problem": problem, "message": message}
