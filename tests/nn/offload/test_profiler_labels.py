"""torch.profiler labels of OffloadModel: each slice's load and eviction, and its forward
and backward per micro-batch, named in the trace."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.profiler import ProfilerActivity, profile

from tests.nn.offload.common import X, target, tiny, wrap


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_loads_evictions_and_slice_phases_are_labelled(tier: str, tmp_path: Path) -> None:
    om, _ = wrap(tiny(), offload_device=target(tier, tmp_path), num_slices=3, num_microbatches=2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        om(X).sum().backward()
    names = [e.name for e in prof.events() if e.name.startswith("OffloadModel::")]
    kind = {"memory": "memory", "disk": "disk"}[tier]
    for k in range(3):
        # each slice: loaded for its forward and again for its backward, evicted after each
        assert names.count(f"OffloadModel::load slice{k} from {kind}") == 2, names
        assert names.count(f"OffloadModel::evict slice{k} to {kind}") == 2, names
        for i in range(2):
            assert names.count(f"OffloadModel::forward slice{k} micro_batch={i}") == 1, names
        assert f"OffloadModel::backward slice{k} micro_batch=0" in names, names
