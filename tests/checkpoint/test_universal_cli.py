"""``python -m shardkit.checkpoint inspect|convert`` on a universal checkpoint of a GPT.

A tiny GPT (LM head tied to the token embedding) takes one AdamW step and is saved
with ``save_universal``. ``inspect`` prints the step, strategy, world size, every key
with shape, dtype and bytes, the files with their real sizes and sha256, and the
optimizer; ``convert`` writes a state dict (``.pt`` and ``.safetensors``) that loads
into the plain GPT with ``strict=True`` (the tied name included) and equals it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardkit.checkpoint.cli import main
from shardkit.checkpoint.universal import save_universal
from shardkit.models import GPT, gpt_config

VOCAB, SEQ = 64, 16


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", vocab_size=VOCAB, block_size=SEQ))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT]:
    root = tmp_path_factory.mktemp("universal_cli")
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    model(idx, idx)[1].backward()
    optimizer.step()
    save_universal(root, 7, model, optimizer, extra={"pos": 1})
    return root, model


def test_inspect(saved: tuple[Path, GPT], capsys: pytest.CaptureFixture[str]) -> None:
    root, model = saved
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "format      shardkit.universal/1: universal" in out
    assert "step        7" in lines and "world size  1" in lines
    assert '"strategy": "plain"' in out
    ckpt = root / "ckpt-000007"
    for name in ("shard-0-of-1.safetensors", "extra-0.pt"):
        data = (ckpt / name).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        assert f"  {name}  rank 0  {len(data):,} bytes  sha256 {digest}  ok" in lines
    wte = model.wte.weight
    row = f"wte.weight {list(wte.shape)} float32 {wte.numel() * 4:,} bytes".split()
    assert row in [line.split() for line in lines], out
    keys = {k for k in model.state_dict() if k != "lm_head.weight"}
    listed = {line.split()[0] for line in lines if line.startswith("  ") and "bytes" in line}
    assert keys <= listed
    assert "optimizer   state keys exp_avg, exp_avg_sq" in lines
    assert "  scalar state step" in lines
    assert '"lr": 0.01' in out


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_convert_loads_strict(saved: tuple[Path, GPT], tmp_path: Path, suffix: str) -> None:
    root, model = saved
    out = tmp_path / f"model{suffix}"
    assert main(["convert", str(root), str(out)]) == 0
    state = load_file(out) if suffix == ".safetensors" else torch.load(out, weights_only=True)
    fresh = GPT(gpt_config("tiny", vocab_size=VOCAB, block_size=SEQ))
    fresh.load_state_dict(state, strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_module_entry_point_json(saved: tuple[Path, GPT]) -> None:
    root, model = saved
    done = subprocess.run(
        [sys.executable, "-m", "shardkit.checkpoint", "inspect", str(root), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    info = json.loads(done.stdout)
    assert info["format"] == "shardkit.universal/1" and info["step"] == 7
    params = {p["name"]: p for p in info["params"]}
    assert params["wte.weight"]["size_bytes"] == model.wte.weight.numel() * 4
    assert info["optimizer"]["class"] == "AdamW"
