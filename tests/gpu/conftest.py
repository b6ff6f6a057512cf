"""Fixtures of the CUDA tests: NCCL rank pools, one per world size, shared by the session.

Every test here carries the ``cuda`` marker and is skipped (and reported as skipped)
where CUDA is absent; ``make test-gpu`` runs them on a GPU machine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from shardkit.testing import RankPool


@pytest.fixture(scope="session")
def nccl_pool() -> Iterator[Callable[[int], RankPool]]:
    """``nccl_pool(n)``: a pool of ``n`` NCCL ranks, rank r on ``cuda:r``; skips the test
    when the machine has fewer than ``n`` GPUs (NCCL needs one GPU per rank)."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        found = torch.cuda.device_count()
        if found < world_size:
            pytest.skip(f"{world_size} NCCL ranks need {world_size} GPUs; this machine has {found}")
        if world_size not in pools:
            pools[world_size] = RankPool(world_size, backend="nccl", timeout_s=120.0)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
