"""NCCL process groups from the test harness: one GPU per rank, the wrappers' collectives."""

from __future__ import annotations

import pytest

from tests.gpu import workers
from tests.gpu.common import CUDA, WORLD_SIZES

pytestmark = CUDA


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_collectives_on_nccl_in_every_dtype(nccl_pool, world_size: int) -> None:
    results = nccl_pool(world_size).run(workers.nccl_collectives)
    for rank, result in enumerate(results):
        assert result["backend"] == "nccl"
        assert result["device_index"] == rank  # RankPool bound rank r to cuda:r
        assert result["failures"] == [], f"rank {rank}: {result['failures']}"
