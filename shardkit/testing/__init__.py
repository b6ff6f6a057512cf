"""A multi-rank test harness: run functions on spawned ranks, compare their results.

Public so that users can test their own wrapping the way shardkit tests its own::

    from shardkit.testing import RankPool, assert_state_dicts_close

    def train(steps):                      # top level: it is pickled to each rank
        ...
        return model.state_dict()

    with RankPool(world_size=2) as pool:    # spawned once, reused by every config
        for steps in (1, 4):
            states = pool.run(train, steps)
"""

from shardkit.testing.compare import (
    assert_same_across_ranks,
    assert_state_dicts_close,
    assert_tensors_close,
    max_abs_diff,
)
from shardkit.testing.launcher import RankError, RankPool, RankTimeoutError, run_distributed

__all__ = [
    "RankError",
    "RankPool",
    "RankTimeoutError",
    "assert_same_across_ranks",
    "assert_state_dicts_close",
    "assert_tensors_close",
    "max_abs_diff",
    "run_distributed",
]
