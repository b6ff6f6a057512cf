"""--fault-tolerant: flag combinations that cannot run are refused in one line (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import train_gpt

_FT = ["--fault-tolerant", "127.0.0.1:29600", "--max-replicas", "2", "--save-every", "0"]


def _error(argv: list[str], world_size: int = 1) -> str | None:
    env = train_gpt.Env(rank=0, world_size=world_size, device=torch.device("cpu"), owns_group=False)
    return train_gpt.launch_error(train_gpt.parse_args(argv), env)


def test_flag_combinations_are_checked() -> None:
    assert _error(_FT) is None
    assert _error([*_FT[:-1], "5", "--resume", "--checkpoint-dir", "shared"]) is None
    assert _error([*_FT, "--replica-id", "1"]) is None
    for strategy in ("oss", "sdp", "hsdp"):  # replicas of several ranks
        assert _error([*_FT, "--strategy", strategy], world_size=2) is None, strategy
    cases = [
        (["--replica-id", "1"], "--replica-id / --max-replicas need --fault-tolerant HOST:PORT"),
        ([*_FT, "--strategy", "fsdp"], "runs --strategy ddp/oss/sdp/hsdp, not fsdp"),
        ([*_FT, "--replica-id", "2"], "--replica-id 2 is not in [0, --max-replicas 2)"),
        (["--fault-tolerant", "nohost", "--save-every", "0"], "expected HOST:PORT of the quorum"),
        ([*_FT, "--stop-after", "3"], "drop --stop-after and --async-checkpoint"),
        ([*_FT[:-1], "5", "--async-checkpoint"], "drop --stop-after and --async-checkpoint"),
        ([*_FT, "--ft-quorum-timeout", "0"], "--ft-quorum-timeout 0.0: give seconds > 0"),
    ]
    for argv, message in cases:
        got = _error(argv)
        assert got is not None and message in got, (argv, got)
    tp = _error([*_FT, "--tp", "2"], world_size=2)
    assert tp is not None and "a replica is data parallel only (got --tp 2 --cp 1" in tp, tp
    # the global batch is split over --max-replicas x the replica's ranks: 4 x 1 x 2 x 2
    config = train_gpt.parse_args([*_FT, "--batch-size", "4", "--replica-id", "1"])
    env = train_gpt.Env(rank=1, world_size=2, device=torch.device("cpu"), owns_group=False)
    assert train_gpt.data_parallel(config, env) == (3, 4)
    assert train_gpt.batch_plan(config, 4).global_batch == 16


def test_main_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = train_gpt.main([*_FT, "--strategy", "fsdp", "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(
        "train_gpt.py: error: --fault-tolerant runs --strategy ddp/oss/sdp/hsdp, not fsdp"
    ), err
