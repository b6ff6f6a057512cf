"""What the multi-rank hypothesis state machines share: their settings and their pool."""

from __future__ import annotations

import contextlib
from typing import Any

from hypothesis import HealthCheck, Phase, settings

from shardkit.testing import RankPool


def machine_settings(examples: int, steps: int) -> settings:
    """``examples`` runs of ``steps`` rules, the same draws on every rank (derandomized,
    no example database) and no shrinking phase (a shrink replays rules on one rank
    only, so the ranks would diverge); no deadline (collectives vary in time)."""
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        print_blob=False,
    )


def machine_pool(stack: contextlib.ExitStack, rank_pool: Any, scale: float, world: int = 2) -> Any:
    """The shared pool of ``world`` ranks (its 120 s fits a default run), or, for a run
    ``scale`` times as long (``SHARDKIT_HYPOTHESIS_*``), a pool of its own whose time
    limit scales with it, closed with ``stack``."""
    if scale <= 1:
        return rank_pool(world)
    pool = RankPool(world, timeout_s=120.0 * scale)
    stack.callback(pool.close)
    return pool
