"""The main job with ``--tp``: the GPT split over tensor-parallel ranks under ddp (2
ranks) and fsdp / sdp (4 ranks) follows the plain GPT's loss on the same global batch,
and ``model.pt`` is the plain GPT's state dict."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import train_gpt

from shardkit.models import GPT, gpt_config

STEPS = 6
COMMON = [
    *("--model-size", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1"),
    *("--steps", str(STEPS), "--eval-every", "3", "--save-every", "0"),
]


def _metrics(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / "metrics.json").read_text())


def _losses(out_dir: Path) -> list[float]:
    return [loss for _, loss in _metrics(out_dir)["train_loss"]]


def _run_main(argvs: list[list[str]]) -> list[int]:
    """On each pool rank: run the job once per command line; the exit codes."""
    return [train_gpt.main(argv) for argv in argvs]


def _assert_follows(tp_dir: Path, plain_dir: Path) -> None:
    """The tensor-parallel run's losses against the plain run's on the same global batch."""
    tp_losses, plain = _losses(tp_dir), _losses(plain_dir)
    assert len(tp_losses) == len(plain) == STEPS
    assert abs(tp_losses[0] - plain[0]) < 1e-5, (tp_losses, plain)  # the same GPT and rows
    assert all(abs(a - b) < 1e-4 for a, b in zip(tp_losses, plain, strict=True)), (
        tp_losses,
        plain,
    )
    assert tp_losses[-1] < tp_losses[0] - 0.3, tp_losses  # it learns
    tp_val = [v for _, v in _metrics(tp_dir)["val_loss"]]
    plain_val = [v for _, v in _metrics(plain_dir)["val_loss"]]
    assert abs(tp_val[0] - plain_val[0]) < 1e-5, (tp_val, plain_val)  # the same windows
    # model.pt is the plain GPT's state dict: it loads, and equals the plain run's (AdamW
    # amplifies float rounding where a gradient is near 0: one weight of 0.8M off by 1.2e-4)
    full, ref = torch.load(tp_dir / "model.pt"), torch.load(plain_dir / "model.pt")
    GPT(gpt_config("tiny", vocab_size=256, block_size=32)).load_state_dict(full)
    assert full.keys() == ref.keys()
    for key in full:
        torch.testing.assert_close(full[key], ref[key], atol=5e-4, rtol=0, msg=key)
    assert (tp_dir / "sample.txt").read_text()


def test_tp2_ddp_on_two_ranks_follows_the_plain_gpt(rank_pool: Any, tmp_path: Path) -> None:
    """``--tp 2`` on 2 ranks (data parallel 1) against the plain GPT on 1 rank: the same
    4 rows per step (sampler of data-parallel rank 0)."""
    plain, split, seq = tmp_path / "plain", tmp_path / "tp2", tmp_path / "tp2-sp"
    assert train_gpt.main([*COMMON, "--out-dir", str(plain)]) == 0  # 1 rank, in process
    argvs = [
        [*COMMON, "--tp", "2", "--out-dir", str(split)],
        [*COMMON, "--tp", "2", "--sequence-parallel", "--out-dir", str(seq)],
    ]
    codes = rank_pool(2).run(_run_main, argvs, timeout_s=180)
    assert codes == [[0, 0], [0, 0]]
    _assert_follows(split, plain)
    _assert_follows(seq, plain)  # sequence parallelism: the same training
    assert abs(_losses(seq)[0] - _losses(split)[0]) < 1e-5
    assert _metrics(seq)["args"]["sequence_parallel"] is True
    m = _metrics(split)
    assert (m["world_size"], m["args"]["tp"]) == (2, 2)
    n = GPT(gpt_config("tiny", vocab_size=256, block_size=32)).num_parameters()
    assert m["param_count"] == n
    # each tensor-parallel rank holds about half of the split weights: less than the whole
    assert all(b["parameters"] < 4 * n * 0.6 for b in m["model_state_bytes"])


def test_tp2_fsdp_and_sdp_on_four_ranks(rank_pool: Any, tmp_path: Path) -> None:
    """``--tp 2`` on 4 ranks (data parallel 2) under fsdp and sdp against the same
    strategy on the plain GPT on 2 ranks: the same 2 x 4 rows per step (samplers of
    data-parallel ranks 0 and 1)."""
    names = ("fsdp", "sdp")
    plain = [
        [*COMMON, "--strategy", name, "--out-dir", str(tmp_path / f"plain-{name}")]
        for name in names
    ]
    assert rank_pool(2).run(_run_main, plain, timeout_s=120) == [[0, 0]] * 2
    split = [
        [*COMMON, "--tp", "2", "--strategy", name, "--out-dir", str(tmp_path / name)]
        for name in names
    ]
    seq = tmp_path / "fsdp-sp"  # sequence parallelism in checkpointed FSDP units
    split.append([*COMMON, "--tp", "2", "--sequence-parallel", "--out-dir", str(seq)])
    split[-1] += ["--strategy", "fsdp", "--activation-checkpointing"]
    assert rank_pool(4).run(_run_main, split, timeout_s=200) == [[0, 0, 0]] * 4
    for name in names:
        _assert_follows(tmp_path / name, tmp_path / f"plain-{name}")
        m = _metrics(tmp_path / name)
        assert (m["world_size"], m["strategy"], m["args"]["tp"]) == (4, name, 2)
    _assert_follows(seq, tmp_path / "plain-fsdp")
    assert abs(_losses(seq)[0] - _losses(tmp_path / "fsdp")[0]) < 1e-5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--tp", "2", "--strategy", "offload"],
            "--tp applies to --strategy ddp / oss / sdp / fsdp / hsdp / pipe only (tensor "
            "parallelism), not 'offload'; drop --tp 2 or use --strategy ddp",
        ),
        (
            ["--dp-shard", "2", "--strategy", "sdp"],
            "--dp-shard applies to --strategy fsdp / hsdp / pipe only",
        ),
        (
            ["--pp", "2"],
            "cannot infer dp_shard: world size 1 is not divisible by pp (2) x dp_replicate "
            "(1) x tp (1) = 2 (the mesh of --strategy pipe)",
        ),
        (["--tp", "0"], "--tp: must be >= 1, got 0"),
        (
            ["--sequence-parallel"],
            "--sequence-parallel splits each sequence over the tensor-parallel ranks; it "
            "needs --tp > 1 (got --tp 1)",
        ),
        (
            ["--sequence-parallel", "--tp", "2", "--seq-len", "31"],
            "--seq-len 31 is not divisible by --tp 2 (--sequence-parallel splits each "
            "sequence into 2 equal chunks); choose a --seq-len that is a multiple of 2",
        ),
        (
            ["--sequence-parallel", "--tp", "2", "--strategy", "pipe"],
            "--sequence-parallel applies to --strategy ddp / oss / sdp / fsdp / hsdp, not "
            "'pipe' (sequence chunks through pipeline stages are not tested)",
        ),
        (["--tp", "2"], "--tp 2 does not divide the world size 1; launch a multiple of 2"),
        (  # not a launch error: checked before training, like --tp's
            ["--strategy", "pipe", "--chunks", "100"],
            "--chunks 100 is more micro-batches than the 8 rows of a step's batch",
        ),
    ],
)
def test_tp_refusals_one_line_exit_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = train_gpt.main([*argv, "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, argv
    assert err.startswith("train_gpt.py: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not (tmp_path / "out").exists()


def test_heads_not_divisible() -> None:
    config = train_gpt.parse_args(["--tp", "3"])
    problem = train_gpt.tp_error(config, world_size=3)
    assert problem is not None and "4 attention heads and 256-token vocabulary" in problem
    assert train_gpt.tp_error(train_gpt.parse_args(["--tp", "2"]), world_size=4) is None


def test_mesh_flags_resolve_to_the_strategy_and_degrees() -> None:
    """Mesh flags alone pick the strategy; the omitted degrees are inferred."""
    dims = train_gpt.parallel_dims
    cases = [
        (["--pp", "2", "--tp", "2"], 8, "pipe", (2, 1, 2, 1, 2)),
        (["--dp-replicate", "2", "--tp", "2"], 8, "hsdp", (1, 2, 2, 1, 2)),
        (["--dp-shard", "4", "--tp", "2"], 8, "fsdp", (1, 1, 4, 1, 2)),
        (["--strategy", "pipe", "--tp", "2"], 8, "pipe", (4, 1, 1, 1, 2)),
        (["--strategy", "hsdp", "--shard-size", "2"], 8, "hsdp", (1, 4, 2, 1, 1)),
        (["--strategy", "fsdp"], 8, "fsdp", (1, 1, 8, 1, 1)),
        ([], 8, "ddp", (1, 1, 8, 1, 1)),
    ]
    for argv, world, name, degrees in cases:
        config = train_gpt.parse_args(argv)
        assert config.strategy.name == name, argv
        assert dims(config.strategy, world).degrees == degrees, argv
    too_deep = train_gpt.mesh_error(train_gpt.parse_args(["--pp", "8"]), world_size=8)
    assert (
        too_deep is not None and "--pp 8 is more pipeline stages than the tiny GPT's 6" in too_deep
    )
