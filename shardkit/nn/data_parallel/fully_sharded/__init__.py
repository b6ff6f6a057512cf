"""FullyShardedDataParallel (ZeRO-3), one concept per module.

``config`` (options; ``precision``: the mixed-precision policy; ``placement``: devices
and dtypes, CPU offload) -> ``flat_param`` (one unit's flat parameter, padding, views) ->
``sharing`` (which parameters a unit takes; tied weights) -> ``collectives`` ->
``state`` (runtime enums) -> ``root`` (what the units under one root share) -> ``unit``
(one unit's runtime: owns its state, runs its phase hooks) -> ``state_dict``,
``optim_state``, ``sharded_checkpoint`` (checkpoints, through the unit runtime);
``disk_tier`` (shards and optimizer state in files, stepped unit by unit) ->
``api`` (the ``nn.Module`` front). Nothing below ``api`` imports it.
"""

from shardkit.nn.data_parallel.fully_sharded.api import FSDP, FullyShardedDataParallel
from shardkit.nn.data_parallel.fully_sharded.config import FSDPConfig
from shardkit.nn.data_parallel.fully_sharded.disk_tier import DiskOffload, DiskOptimizer, DiskStats
from shardkit.nn.data_parallel.fully_sharded.flat_param import FlatLayout
from shardkit.nn.data_parallel.fully_sharded.precision import MixedPrecision
from shardkit.nn.data_parallel.fully_sharded.root import TrainableMismatchError
from shardkit.nn.data_parallel.fully_sharded.sharded_checkpoint import (
    load_fsdp_sharded,
    save_fsdp_sharded,
)
from shardkit.nn.data_parallel.fully_sharded.sharing import SharedParameterError
from shardkit.nn.data_parallel.fully_sharded.state import ShardedState, TrainingState
from shardkit.nn.data_parallel.fully_sharded.unit import ParametersChangedError

__all__ = [
    "FSDP",
    "DiskOffload",
    "DiskOptimizer",
    "DiskStats",
    "FSDPConfig",
    "FlatLayout",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "ParametersChangedError",
    "ShardedState",
    "SharedParameterError",
    "TrainableMismatchError",
    "TrainingState",
    "load_fsdp_sharded",
    "save_fsdp_sharded",
]
