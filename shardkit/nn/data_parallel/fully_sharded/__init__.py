"""FullyShardedDataParallel (ZeRO-3), one concept per module.

``config`` (options; ``precision``: the mixed-precision policy; ``placement``: devices
and dtypes, CPU offload) -> ``flat_param`` (one unit's flat parameter, padding, views) ->
``sharing`` (which parameters a unit takes; tied weights) -> ``collectives`` ->
``state`` (runtime enums) -> ``hooks`` (phases of a step) -> ``api`` (the wrapper);
``state_dict`` and ``optim_state`` gather and shard checkpoints.
"""

from shardkit.nn.data_parallel.fully_sharded.api import FSDP, FullyShardedDataParallel
from shardkit.nn.data_parallel.fully_sharded.config import FSDPConfig
from shardkit.nn.data_parallel.fully_sharded.flat_param import FlatLayout
from shardkit.nn.data_parallel.fully_sharded.precision import MixedPrecision
from shardkit.nn.data_parallel.fully_sharded.sharing import SharedParameterError
from shardkit.nn.data_parallel.fully_sharded.state import ShardedState, TrainingState

__all__ = [
    "FSDP",
    "FSDPConfig",
    "FlatLayout",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "ShardedState",
    "SharedParameterError",
    "TrainingState",
]
