"""--fault-tolerant: flag combinations that cannot run, and a replica the quorum refuses,
stop in one line (exit 2)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import train_gpt

from shardkit.distributed.fault_tolerance import Quorum, host_store
from shardkit.distributed.fault_tolerance.quorum import Arrival, join_round, vote

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


def test_a_replica_of_another_global_batch_exits_2_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Replica 1 launched with --global-batch 16 against a member at 8: the quorum
    refuses it, and the main job stops it in one line (exit 2) naming both."""
    store = host_store(0)
    prefix = f"gpt-ft-{train_gpt.JobConfig().seed}"
    member = "global_batch=8 max_replicas=2 seq_len=32"

    def arrive(round_: int, step: int) -> Quorum:
        me = Arrival(0, step, False, "Lmember", member)
        wait = {"join_timeout_s": 5.0, "quorum_timeout_s": 30.0}
        return join_round(store, prefix, round_, me, min_replicas=1, initial_replicas=1, **wait)

    assert vote(store, prefix, arrive(0, 0), 0, True, 1.0).commit  # step 1, alone

    def arrive_after_the_joiner() -> None:
        key = f"{prefix}/round/1/arrivals"
        while not store.check([key]) or b"1," not in store.get(key):
            time.sleep(0.01)
        assert arrive(1, 1).refused == (1,)

    thread = threading.Thread(target=arrive_after_the_joiner)
    thread.start()
    flags = [*_FT[2:], "--fault-tolerant", f"127.0.0.1:{store.port}", "--replica-id", "1"]
    flags += ["--global-batch", "16", "--batch-size", "8", "--seq-len", "32", "--steps", "2"]
    code = train_gpt.main([*flags, "--eval-batches", "1", "--out-dir", str(tmp_path / "r1")])
    thread.join()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "its batch schedule is 'global_batch=16 max_replicas=2 seq_len=32'" in err, err
    assert f"the members train with '{member}'" in err, err
