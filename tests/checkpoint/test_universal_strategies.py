"""Universal checkpoints across strategies (issue 21): save in one layout, load in another.

Each case trains two AdamW steps in layout A (a wrapper over the first ranks of a
4-rank pool) beside a plain twin, saves, loads into layout B (another wrapper, world
size, mesh) built from another initialisation, and steps once more. Checked (see
``universal_workers``): every element is written by exactly one rank; B's parameters
and optimizer state (consolidated per original key) equal A's exactly; A matches the
twin and B's next step matches the twin's next step to fp32 rounding.

``SHARDKIT_HYPOTHESIS_EXAMPLES`` bounds the examples of the property test over
(save layout, load layout) pairs (default 5, 4 pairs each); all run in the one 4-rank pool.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.checkpoint.universal_workers import KINDS_SEQ, run_pairs

EXAMPLES = int(os.environ.get("SHARDKIT_HYPOTHESIS_EXAMPLES", "5"))
TOL = {"atol": 1e-5, "rtol": 1e-4}

Pair = tuple[tuple[str, str, int], tuple[str, int]]

REQUIRED: dict[str, Pair] = {
    "fsdp4-nested->oss2": (("gpt", "fsdp_nested", 4), ("oss", 2)),
    "tp2xfsdp2->fsdp4": (("gpt", "tp_fsdp", 4), ("fsdp", 4)),
    "pipe2->fsdp3": (("seq", "pipe", 2), ("fsdp", 3)),
    "offload->plain2": (("seq", "offload", 1), ("plain", 2)),
    "hsdp2x2->fsdp2": (("gpt", "hsdp", 4), ("fsdp", 2)),
    "fsdp2->ddp3": (("gpt", "fsdp", 2), ("ddp", 3)),
    "sdp3->pipe2": (("seq", "sdp", 3), ("pipe", 2)),
    "oss4->offload": (("seq", "oss", 4), ("offload", 1)),
    "pipe-local->fsdp2": (("seq", "pipe_local", 1), ("fsdp", 2)),
}


def check(result: dict[str, Any], label: str) -> None:
    """The checks of the module docstring on rank 0's result."""
    saved, loaded, stepped = result["saved"], result["loaded"], result["stepped"]
    for what, got in (("saved", saved), ("loaded", loaded)):
        for key, count in got["count"].items():
            assert torch.all(count == 1), f"{label} {what} {key}: elements written {count.tolist()}"
    want = result["want_saved"]
    assert set(saved["params"]) == set(want["params"]), f"{label}: keys differ"
    for key in want["params"]:
        torch.testing.assert_close(
            saved["params"][key], want["params"][key], **TOL, msg=f"{label} {key}"
        )
        assert torch.equal(loaded["params"][key], saved["params"][key]), f"{label}: {key} not exact"
    assert set(saved["state"]) == set(want["state"]) == set(loaded["state"]), f"{label}: state keys"
    for key, state in saved["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(
                value, want["state"][key][name], **TOL, msg=f"{label} {key} {name}"
            )
            assert torch.equal(loaded["state"][key][name], value), (
                f"{label}: {key}.{name} not exact"
            )
    assert loaded["scalars"] == saved["scalars"] == want["scalars"], f"{label}: scalar state"
    after = result["want_stepped"]
    for key in after["params"]:
        torch.testing.assert_close(
            stepped["params"][key], after["params"][key], **TOL, msg=f"{label} step {key}"
        )


@pytest.mark.timeout(300)
def test_required_pairs(rank_pool: Any, tmp_path: Path) -> None:
    results = rank_pool(4).run(run_pairs, list(REQUIRED.values()), str(tmp_path))
    for label, result in zip(REQUIRED, results[0]):
        check(result, label)


LAYOUTS = {  # kind -> world sizes it runs at (seq family)
    "plain": (1, 2, 3, 4),
    "ddp": (1, 2, 3, 4),
    "oss": (1, 2, 3, 4),
    "sdp": (1, 2, 3, 4),
    "fsdp": (1, 2, 3, 4),
    "hsdp": (2, 4),
    "pipe": (1, 2, 3),
    "pipe_local": (1,),
    "offload": (1,),
}
assert set(LAYOUTS) == set(KINDS_SEQ)
LAYOUT = st.sampled_from(sorted(LAYOUTS)).flatmap(
    lambda kind: st.tuples(st.just(kind), st.sampled_from(LAYOUTS[kind]))
)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)
@given(pairs=st.lists(st.tuples(LAYOUT, LAYOUT), min_size=4, max_size=4))
def test_any_pair_round_trips(rank_pool: Any, tmp_path_factory: Any, pairs: list[Any]) -> None:
    specs = [(("seq", a[0], a[1]), b) for a, b in pairs]
    root = tmp_path_factory.mktemp("pairs")
    results = rank_pool(4).run(run_pairs, specs, str(root))
    for (a, b), result in zip(specs, results[0]):
        check(result, f"{a[1]}{a[2]}->{b[0]}{b[1]}")
