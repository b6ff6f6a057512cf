"""benchmarks.live_recovery: how it reads the jobs' logs and summarises rounds (no job runs)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.live_recovery import _RESUMED, _logged_steps, medians


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
    rounds = [
        {"ft": {"steps_lost": 0, "wall_s_lost": 3.0, "rejoin_s": None, "lockstep_equal": True}},
        {"ft": {"steps_lost": 0, "wall_s_lost": 1.0, "rejoin_s": 7.0, "lockstep_equal": True}},
        {"ft": {"steps_lost": 2, "wall_s_lost": 2.0, "rejoin_s": 9.0, "lockstep_equal": False}},
    ]
    got = medians(rounds)["ft"]
    assert got == {"steps_lost": 0.0, "wall_s_lost": 2.0, "rejoin_s": 8.0, "lockstep_equal": 0.0}
