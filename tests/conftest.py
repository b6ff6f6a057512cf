"""Shared fixtures: one spawned rank group per world size, reused across the session.

Start-up (spawn, ``import torch``, process-group init) costs seconds per group on the
2-core CI machine, so tests ask ``rank_pool(n)`` for a shared :class:`RankPool`
instead of spawning their own. A pool whose ranks hung or died is restarted
automatically on its next use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from shardkit.testing import RankPool


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[Callable[[int], RankPool]]:
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size, timeout_s=120.0)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
