"""benchmarks.live_recovery: how it reads the jobs' logs and summarises rounds (no job runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.live_recovery import (
    _RESUMED,
    _ft_events,
    _logged_steps,
    _trained,
    global_batch,
    joiner_layout,
    medians,
    parse_args,
)


def test_step_lines_and_the_resumed_step_are_read_from_the_log(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text(
        "--resume: no checkpoint in runs/x; starting from step 0\n"
        "step     0/60 | train   -    | val 5.4678\n"
        "step     1/60 | train 5.5 | 1,000 tok/s\ntrain: 4%| 1/60 [00:00<00:04]\r"
        "step    12/60 | train 4.1 | 9 tok/s\n"
        "[rank3]: killed\nresumed from runs/x/ckpt-000010 at step 10\n"
        "step    11/60 | train 4.2 | 9 tok/s\n"
    )
    assert _logged_steps(log) == [1, 12, 11]
    assert [int(a or b) for a, b in _RESUMED.findall(log.read_text())] == [0, 10]


def test_medians_over_rounds_per_path() -> None:
    rounds: list[dict[str, Any]] = [
        {"ft": {"steps_lost": 0, "wall_s_lost": 3.0, "rejoin_s": None, "lockstep_equal": True}},
        {"ft": {"steps_lost": 0, "wall_s_lost": 1.0, "rejoin_s": 7.0, "lockstep_equal": True}},
        {"ft": {"steps_lost": 2, "wall_s_lost": 2.0, "rejoin_s": 9.0, "lockstep_equal": False}},
    ]
    got = medians(rounds)["ft"]
    assert got == {"steps_lost": 0.0, "wall_s_lost": 2.0, "rejoin_s": 8.0, "lockstep_equal": 0.0}


def test_a_joiner_of_another_layout_keeps_the_global_batch() -> None:
    args = parse_args(["--joiner-strategy", "ddp", "--joiner-ranks", "1"])
    assert joiner_layout(args) == ("ddp", 1)
    assert global_batch(args) == 16  # --batch-size 4 x 2 replicas x 2 ranks
    assert args.steps == 300 and args.late_delay > 0
    same = parse_args([])
    assert same.joiner_strategy is None  # no joiner_layout run
    assert joiner_layout(parse_args(["--joiner-strategy", "oss"])) == ("oss", 2)


def test_a_joiner_whose_ranks_do_not_split_the_rows_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--joiner-strategy", "ddp", "--joiner-ranks", "3"])  # 8 rows
    assert exit_.value.code == 2
    assert "--joiner-ranks 3 does not split a replica's 8 rows" in capsys.readouterr().err


def _steps(out: Path, lines: list[dict[str, object]]) -> None:
    out.mkdir()
    (out / "ft_steps.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_rejoin_and_lockstep_are_read_from_the_replicas_files(tmp_path: Path) -> None:
    survivor, joiner = tmp_path / "r0", tmp_path / "r1"
    members = [[0, 1], [0, 1], [0], [0], [0, 1], [0, 1], [0, 1]]
    times = [0.0, 1.0, 7.0, 7.5, 20.0, 20.25, 20.75]
    _steps(survivor, [{"step": i + 1, "members": m, "time": t} for i, (m, t) in
                      enumerate(zip(members, times, strict=True))])  # fmt: skip
    _steps(joiner, [{"step": 5 + i, "members": [0, 1], "time": 20.0 + i / 4, "healed_bytes": b}
                    for i, b in enumerate([1000, 0, 0])])  # fmt: skip
    state = {"w": torch.ones(2, 3), "empty": torch.zeros(0)}
    torch.save(state, survivor / "model.pt")
    torch.save({**state, "w": torch.ones(2, 3) + 0.5}, joiner / "model.pt")
    args = parse_args(["--steps", "7"])
    got = _ft_events(args, survivor, joiner, killed_at=2.0, joined_at=12.0)
    assert got["steps_lost"] == 0 and got["steps_alone"] == 2
    assert got["detect_s"] == 5.0  # the first step without replica 1 after the kill
    assert got["rejoin_s"] == 8.0 and got["rejoin_bytes"] == 1000
    assert got["steps_lockstep"] == 3 and got["lockstep_step_s"] == 0.375
    assert got["alone_step_s"] == 0.5
    assert got["lockstep_equal"] is False and got["lockstep_max_diff"] == 0.5
    assert _trained(survivor, 7) is False  # no metrics.json yet
    (survivor / "metrics.json").write_text("{}")
    assert _trained(survivor, 7) and not _trained(survivor, 8)
