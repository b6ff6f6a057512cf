"""benchmarks.step_floor: the unit sizes it times and the step models it sums."""

from __future__ import annotations

import pytest

from benchmarks.compare import SIZES, model_config, num_params
from benchmarks.step_floor import floor, main, unit_sizes


@pytest.mark.parametrize("size", sorted(SIZES))
def test_units_cover_every_parameter_once(size: str) -> None:
    config = model_config(size, 128)
    sizes = unit_sizes(config)
    assert len(sizes) == config.n_layer + 1
    assert sum(sizes) == num_params(config)  # the tied LM head counted once
    assert len(set(sizes[1:])) == 1  # one unit per block, all alike


def test_floor_sums_the_pieces_of_each_strategy() -> None:
    pieces = {
        "all-gather forward": 30.0,
        "all-gather backward": 20.0,
        "reduce-scatter": 25.0,
        "all-reduce": 50.0,
        "AdamW psi": 80.0,
        "AdamW psi / N": 40.0,
    }
    got = floor(pieces, 1000.0)
    assert got["ddp"] == 1000.0 + 50.0 + 80.0
    assert got["fsdp"] == 1000.0 + 30.0 + 20.0 + 25.0 + 40.0
    assert got["fsdp / ddp"] == pytest.approx(1115.0 / 1130.0)


def test_refuses_one_rank() -> None:
    with pytest.raises(SystemExit):
        main(["--world-size", "1"])
