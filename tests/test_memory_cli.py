"""``python -m shardkit.memory``: the printed numbers against hand-computed values."""

from __future__ import annotations

import pytest

from shardkit.memory import main


def _rows(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> dict[tuple[int, str], list[float]]:
    main(argv)
    rows = {}
    for line in capsys.readouterr().out.splitlines()[2:]:
        parts = line.split()
        rows[(int(parts[0]), parts[1])] = [float(v) for v in parts[-4:]]
    return rows


def test_paper_example_7_5b_on_64_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _rows(capsys, ["--params", "7.5e9", "--world-size", "64"])
    # ZeRO paper figure 1 (mixed precision, K = 12): 120, 31.4, 16.6, 1.88 GB
    assert rows[(0, "mixed")] == [15.0, 15.0, 90.0, 120.0]
    assert rows[(1, "mixed")] == [15.0, 15.0, 1.406, 31.406]  # 12 * 7.5 / 64 = 1.40625
    assert rows[(2, "mixed")] == [15.0, 0.234, 1.406, 16.641]  # 2 * 7.5 / 64 = 0.234375
    assert rows[(3, "mixed")] == [0.234, 0.234, 1.406, 1.875]
    # fp32 AdamW: 4 + 4 + 8 bytes per parameter
    assert rows[(0, "fp32")] == [30.0, 30.0, 60.0, 120.0]
    assert rows[(1, "fp32")] == [30.0, 30.0, 0.938, 60.938]  # 8 * 7.5 / 64 = 0.9375
    assert rows[(2, "fp32")] == [30.0, 0.469, 0.938, 31.406]
    assert rows[(3, "fp32")] == [0.469, 0.469, 0.938, 1.875]


def test_custom_optimizer_bytes_and_one_rank(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _rows(capsys, ["--params", "1e9", "--world-size", "1", "--optimizer-bytes", "4"])
    assert rows[(3, "fp32")] == [4.0, 4.0, 4.0, 12.0]  # N = 1: nothing is divided
    assert rows[(3, "mixed")] == [2.0, 2.0, 4.0, 8.0]


def test_bad_world_size_is_an_argument_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--params", "1e9", "--world-size", "0"])
    assert "--world-size >= 1" in capsys.readouterr().err
