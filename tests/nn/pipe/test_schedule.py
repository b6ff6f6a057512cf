"""Schedule invariants, checked by simulating the per-stage action lists (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.nn.pipe import bubble_fraction, gpipe_actions, one_f_one_b_actions
from shardkit.nn.pipe.schedule import Phase, clock_cycles
from tests.nn.pipe.simulate import Deadlock, simulate

SCHEDULES = {"gpipe": gpipe_actions, "1f1b": one_f_one_b_actions}


@settings(max_examples=120, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 12), name=st.sampled_from(sorted(SCHEDULES)))
def test_every_forward_once_before_its_backward_and_no_deadlock(p: int, m: int, name: str) -> None:
    per_stage = [SCHEDULES[name](s, p, m) for s in range(p)]
    for actions in per_stage:  # each (micro-batch, stage) forward once and backward once
        assert sorted(actions) == sorted(
            [(Phase.FORWARD, i) for i in range(m)] + [(Phase.BACKWARD, i) for i in range(m)]
        )
        # backwards in forward order: preposted gradient receives match by order (p2p note)
        backwards = [i for phase, i in actions if phase is Phase.BACKWARD]
        assert backwards == sorted(backwards)
    trace = simulate(per_stage)  # raises on a deadlock or a backward before its forward
    for s in range(p):
        for i in range(m):
            assert trace.finish[(Phase.FORWARD, i, s)] <= trace.start[(Phase.BACKWARD, i, s)]


@settings(max_examples=120, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 12))
def test_1f1b_holds_at_most_p_activations_and_matches_gpipe_length(p: int, m: int) -> None:
    gpipe = simulate([gpipe_actions(s, p, m) for s in range(p)])
    ofob = simulate([one_f_one_b_actions(s, p, m) for s in range(p)])
    for s in range(p):
        assert ofob.peak_in_flight[s] <= min(p - s, m) <= p
        assert gpipe.peak_in_flight[s] == m
    # equal stages (F = 1, B = 2 units): both take (m + p - 1) * 3, the bubble is (p - 1) / (m + p - 1)
    assert gpipe.makespan == ofob.makespan == (m + p - 1) * 3
    idle = 1 - m * 3 / gpipe.makespan
    assert idle == pytest.approx(bubble_fraction(p, m))


def test_simulator_detects_a_deadlock() -> None:
    bad = [
        gpipe_actions(0, 2, 2),
        [*reversed(gpipe_actions(1, 2, 2)[2:]), *gpipe_actions(1, 2, 2)[:2]],
    ]
    with pytest.raises((Deadlock, AssertionError)):
        simulate(bad)
    swapped = [[a for a in gpipe_actions(0, 2, 2)], gpipe_actions(1, 2, 2)]
    swapped[0][2], swapped[0][3] = swapped[0][3], swapped[0][2]  # B1 before B0 is legal
    simulate(swapped)
    backwards_first = [
        one_f_one_b_actions(0, 2, 3),
        [(Phase.FORWARD, 1), *one_f_one_b_actions(1, 2, 3)],
    ]
    with pytest.raises((Deadlock, AssertionError)):
        simulate(backwards_first)  # type: ignore[arg-type]


def test_clock_cycles() -> None:
    assert list(clock_cycles(3, 2)) == [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]
    assert sum(len(t) for t in clock_cycles(5, 3)) == 15
