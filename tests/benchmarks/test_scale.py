"""benchmarks.scale: the ladder, the formula-guided start, verdicts and the page."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from benchmarks.common import MIB, RSS_EXIT_CODE
from benchmarks.compare import num_params
from benchmarks.runners import BY_NAME, SLICE_STATE_BYTES, offload_slices
from benchmarks.scale import (
    LADDER,
    between,
    predicted_rung,
    render,
    rung_config,
    shape_config,
    verdict,
)
from shardkit.models import GPT


def test_ladder_grows_in_depth_and_width() -> None:
    psis = [num_params(rung_config(r, 128)) for r in range(len(LADDER))]
    assert all(b > a for a, b in itertools.pairwise(psis))
    for (l0, c0), (l1, c1) in itertools.pairwise(LADDER):
        assert l1 >= l0 and c1 >= c0 and (l1, c1) != (l0, c0)
    assert rung_config(8, 128).n_head == 512 // 64
    for rung in (0, 5):
        with torch.device("meta"):
            assert GPT(rung_config(rung, 128)).num_parameters() == psis[rung]


def test_predicted_rung_follows_the_zero_formula() -> None:
    limit = 1024 * MIB
    ddp, fsdp = (predicted_rung(s, limit, len(LADDER), 128) for s in (0, 3))
    fits = num_params(rung_config(ddp, 128)) * 16 + 400 * MIB
    assert fits <= limit < num_params(rung_config(ddp + 1, 128)) * 16 + 400 * MIB
    assert fsdp > ddp  # 8 psi per rank at N = 2 instead of 16 psi
    assert predicted_rung(None, limit, 5, 128) == 4  # no formula: start at the cap


def _ok(peaks: list[int]) -> dict[str, Any]:
    return {"ranks": [{"rss_peak": p} for p in peaks]}


def test_verdicts() -> None:
    limit = 100
    assert verdict(_ok([90, 100]), limit) == "pass"
    assert verdict(_ok([90, 101]), limit) == "memory"  # a spike the watchdog missed
    exited = f"rank 1: process exited with code {RSS_EXIT_CODE} without reporting"
    assert verdict({"error": exited}, limit) == "memory"
    oom = "rank 0: RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried..."
    assert verdict({"error": oom}, limit) == "memory"
    assert verdict({"error": "rank 0: ValueError: bad shape"}, limit) == "error"


def test_render_names_largest_and_ratio() -> None:
    def rec(rung: int, why: str, peak: int = 500 * MIB) -> dict[str, Any]:
        return {
            "shape": LADDER[rung],
            "psi": num_params(rung_config(rung, 128)),
            "verdict": why,
            "peak_rss_bytes": [peak, peak],
        }

    doc = {
        "started": "now",
        "command": "python -m benchmarks.scale",
        "machine": {"cpu_count": 2, "cpu_model": "x", "torch": "t", "loadavg": [1.0]},
        "loadavg_end": [2.0],
        "limit_bytes": 1024 * MIB,
        "args": {"batch": 2, "seq_len": 128, "max_params": 8e7},
        "results": [
            {
                "strategy": "torch DDP",
                "best": rec(4, "pass"),
                "first_failure": rec(5, "memory"),
                "tries": [1, 2],
            },
            {
                "strategy": "shardkit fsdp",
                "best": rec(6, "pass"),
                "first_failure": None,
                "tries": [1],
            },
        ],
    }
    watchdog = {**rec(6, "memory"), "error": f"rank 1: process exited with code {RSS_EXIT_CODE}"}
    doc["results"].append(
        {"strategy": "torch FSDP2", "best": None, "first_failure": watchdog, "tries": [1]}
    )
    page = render(doc)
    assert "| memory: rank 1 passed the limit (the RSS watchdog ended it) |" in page
    ratio = num_params(rung_config(6, 128)) / num_params(rung_config(4, 128))
    assert f"| {ratio:.2f} (at least: the cap) |" in page
    assert "| torch DDP | 4 x 320" in page and "| memory |" in page


def test_between_bisects_by_psi_in_depth_and_width() -> None:
    assert between((12, 512), (12, 640), 128) == (12, 576)
    assert between((8, 512), (12, 512), 128) == (10, 512)
    low, high = (num_params(shape_config(s, 128)) for s in ((3, 192), (4, 256)))
    mid = between((3, 192), (4, 256), 128)
    assert mid is not None and low < num_params(shape_config(mid, 128)) < high
    assert between((12, 512), (13, 512), 128) is None  # nothing strictly between


def test_offload_disk_slices_bound_the_state_of_one_slice() -> None:
    with torch.device("meta"):
        small = GPT(shape_config((6, 512), 128))  # 19.1M: 4 slices (the floor)
        large = GPT(shape_config((48, 1536), 128))  # 1360.5M
    assert offload_slices(small, 8) == 4
    assert offload_slices(small, 3) == 3  # never more slices than stages
    psi = large.num_parameters()
    assert psi == 1_360_505_856
    # 16 bytes per parameter (fp32 weights, gradients, two AdamW moments) / 512 MiB
    assert offload_slices(large, 50) == 41 == -(-16 * psi // SLICE_STATE_BYTES)
    assert 16 * psi / 41 <= SLICE_STATE_BYTES
    assert BY_NAME["shardkit offload (disk)"].state_on_disk
    assert not BY_NAME["shardkit offload"].state_on_disk  # the CPU tier is resident
