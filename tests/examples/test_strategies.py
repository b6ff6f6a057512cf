"""The main job's strategy registry: one spec per strategy, read by the job, the
benchmarks and the docs; the step contract ``train_step(x, y) -> mean loss`` on 2 ranks."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import strategies
import torch
import torch.distributed as dist
from strategies import STRATEGIES, StrategyConfig, StrategySpec, build_strategy, option_error

from shardkit.models import GPT, GPTConfig
from tests.examples import EXAMPLES_DIR

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
DOC = EXAMPLES_DIR.parent / "docs" / "train_gpt.md"


def test_docs_table_is_the_registry() -> None:
    table = strategies.strategy_table()
    assert table in DOC.read_text(), f"docs/train_gpt.md lacks the current table:\n{table}"
    rows = table.splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == [f"| `{name}`" for name in STRATEGIES]


def test_spec_needs_a_loss_scaler_with_precision() -> None:
    with pytest.raises(ValueError, match="precision='autocast' but loss_scaler=None"):
        StrategySpec("x", STRATEGIES["ddp"].factory, "x", zero_stage=0, precision="autocast")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (StrategyConfig(name="nope"), "unknown --strategy 'nope'; choose one of ['ddp', 'fsdp'"),
        (
            StrategyConfig(name="offload", precision="fp16"),
            "--precision fp16 applies to strategies ['ddp', 'fsdp', 'hsdp', 'oss', 'sdp'], not 'offload'",
        ),
        (
            StrategyConfig(name="ddp", chunks=8),
            "--chunks applies to --strategy pipe only (micro-batches), not 'ddp'; drop --chunks 8",
        ),
        (
            StrategyConfig(name="offload", activation_checkpointing=True),
            "strategies ['ddp', 'oss', 'sdp', 'fsdp', 'hsdp', 'pipe'], not 'offload' (offload checkpoints",
        ),
    ],
)
def test_option_errors_come_from_the_specs(config: StrategyConfig, message: str) -> None:
    problem = option_error(config)
    assert problem is not None and message in problem, problem


def _steps(name: str, nan_on_rank1: bool) -> dict[str, Any]:
    """On a pool rank: two ``train_step`` calls of strategy ``name`` on the same GPT and
    batches; with ``nan_on_rank1`` the first step's loss is NaN on rank 1."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    strategy = build_strategy(model, StrategyConfig(name=name), torch.device("cpu"))
    if nan_on_rank1 and dist.get_rank() == 1:
        real = strategy.forward_backward
        strategy.forward_backward = lambda x, y: real(x, y) * float("nan")  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(dist.get_rank())
    before = {k: v.clone() for k, v in strategy.state_dict()["model"].items()}
    x, y = (torch.randint(0, CONFIG.vocab_size, (4, 16), generator=gen) for _ in range(2))
    losses = []
    for _ in range(2):  # the same batch twice: the step must lower its loss
        losses.append(strategy.train_step(x, y))
        if nan_on_rank1:
            break
    after = strategy.state_dict()["model"]
    changed = any(not torch.equal(before[k], after[k]) for k in before)
    return {"losses": losses, "changed": changed}


def _every_strategy() -> dict[str, Any]:
    out = {name: _steps(name, nan_on_rank1=False) for name in STRATEGIES}
    out["ddp nan"] = _steps("ddp", nan_on_rank1=True)
    out["pipe nan"] = _steps("pipe", nan_on_rank1=True)
    return out


def test_train_step_is_one_contract_for_every_strategy(rank_pool: Any, tmp_path: Path) -> None:
    """Same GPT, same batches: the first mean loss is the same under every strategy
    (the pipeline too: it trains on the all-gathered global batch), every strategy
    stepped its parameters, and a NaN loss on one rank makes no rank step."""
    rank0, rank1 = rank_pool(2).run(_every_strategy, timeout_s=180)
    assert rank0.keys() == {*STRATEGIES, "ddp nan", "pipe nan"}
    first = rank0["ddp"]["losses"][0]
    assert 3.5 < first < 4.7  # about ln(64) = 4.16 at initialisation
    for name in STRATEGIES:
        assert rank0[name]["losses"] == rank1[name]["losses"], name  # the mean over ranks
        assert abs(rank0[name]["losses"][0] - first) < 1e-5, (name, rank0[name]["losses"])
        assert rank0[name]["losses"][1] < rank0[name]["losses"][0], name
        assert rank0[name]["changed"] and rank1[name]["changed"], name
    for name in ("ddp nan", "pipe nan"):
        for result in (rank0[name], rank1[name]):
            assert math.isnan(result["losses"][0]) and not result["changed"], (name, result)
