"""ReplicaSampler: with replicas dropped and rejoining, no sample twice in an epoch."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.distributed.fault_tolerance import ReplicaSampler

EXAMPLES = int(os.environ.get("SHARDKIT_HYPOTHESIS_EXAMPLES", "10"))


def test_slots_of_one_epoch_are_disjoint_and_cover_it() -> None:
    sampler = ReplicaSampler(26, batch_size=3, max_replicas=4, seed=5)
    assert sampler.steps_per_epoch == 2  # 26 // 12; 2 samples left out each epoch
    seen = [i for step in range(2) for r in range(4) for i in sampler.indices(step, r)]
    assert len(seen) == len(set(seen)) == 24 and set(seen) <= set(range(26))
    # epoch 1 is another permutation of the same samples; the slots are deterministic
    assert sampler.indices(2, 0) != sampler.indices(0, 0)
    assert ReplicaSampler(26, 3, 4, seed=5).indices(3, 2) == sampler.indices(3, 2)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    data=st.data(),
    replicas=st.integers(1, 4),
    batch=st.integers(1, 3),
    extra=st.integers(0, 5),
)
def test_drops_and_rejoins_never_repeat_a_sample_in_an_epoch(
    data: st.DataObject, replicas: int, batch: int, extra: int
) -> None:
    """A random run: at each step a random non-empty set of replicas contributes (the
    others are dead, dropped or healing). The samples trained on in an epoch are the
    contributors' slots: no sample twice, and the step's global batch is the
    contributors' batches."""
    sampler = ReplicaSampler(replicas * batch * 3 + extra, batch, replicas, seed=1)
    seen: dict[int, list[int]] = {}
    for step in range(3 * sampler.steps_per_epoch):
        members = data.draw(st.sets(st.integers(0, replicas - 1), min_size=1))
        step_batch = [i for r in sorted(members) for i in sampler.indices(step, r)]
        assert len(step_batch) == len(members) * batch
        seen.setdefault(sampler.epoch_of(step), []).extend(step_batch)
    for epoch, samples in seen.items():
        assert len(samples) == len(set(samples)), epoch


def test_bad_arguments_name_the_values() -> None:
    with pytest.raises(ValueError, match="6 samples do not fill one step of 2 replicas x 4"):
        ReplicaSampler(6, batch_size=4, max_replicas=2)
    with pytest.raises(ValueError, match="replica_id=2"):
        ReplicaSampler(8, batch_size=2, max_replicas=2).indices(0, 2)
