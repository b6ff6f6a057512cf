"""The main job's pipe and offload checkpoints convert to a plain GPT state dict that
loads with ``strict=True`` (``gpt_wrappers.GPTKeys`` records the tied LM-head key).

Regression: their manifests had no ``aliases``, so ``python -m shardkit.checkpoint
convert`` left out ``lm_head.weight`` and ``GPT.load_state_dict(..., strict=True)``
failed ("Missing key(s) in state_dict: lm_head.weight"); the other strategies' adapters
recorded it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from strategies import StrategyConfig, build_strategy

from shardkit.checkpoint.cli import main as cli_main
from shardkit.checkpoint.manifest import read_manifest
from shardkit.checkpoint.universal import save_universal
from shardkit.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def _save(root: Path) -> None:
    """On 2 pool ranks: the untrained GPT under pipe (two stages) and offload, saved."""
    for name in ("pipe", "offload"):
        strategy = build_strategy(_gpt(), StrategyConfig(name=name), torch.device("cpu"))
        save_universal(root / name, 0, strategy.checkpoint_module(), strategy.optimizer)
        dist.barrier()


def test_pipe_and_offload_convert_loads_strict(rank_pool: Any, tmp_path: Path) -> None:
    rank_pool(2).run(_save, tmp_path, timeout_s=120)
    want = _gpt().state_dict()
    for name in ("pipe", "offload"):
        layout = read_manifest(tmp_path / name / "ckpt-000000").layout
        assert layout["aliases"] == {"lm_head.weight": "wte.weight"}, name
        out = tmp_path / f"{name}.pt"
        assert cli_main(["convert", str(tmp_path / name), str(out)]) == 0
        model = GPT(CONFIG)
        model.load_state_dict(torch.load(out, weights_only=True), strict=True)
        got = model.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), name
