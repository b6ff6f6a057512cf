"""Module wrappers: gradient and parameter sharding, wrapping policies, pipeline, offload.

Each wrapper is imported here as it lands; ``__all__`` lists the public names.
"""

from shardkit.nn.checkpoint import checkpoint_wrapper
from shardkit.nn.data_parallel import ShardedDataParallel, ShardedDDP
from shardkit.nn.offload import OffloadModel
from shardkit.nn.pipe import Pipe, PipelineStage, Schedule1F1B, ScheduleGPipe

__all__ = [
    "OffloadModel",
    "Pipe",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ShardedDDP",
    "ShardedDataParallel",
    "checkpoint_wrapper",
]
