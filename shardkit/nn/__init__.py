"""Module wrappers: gradient and parameter sharding, wrapping policies, pipeline, offload.

Each wrapper is imported here as it lands; ``__all__`` lists the public names.
"""

from shardkit.nn.checkpoint import checkpoint_wrapper
from shardkit.nn.data_parallel import (
    FSDP,
    FullyShardedDataParallel,
    ShardedDataParallel,
    ShardedDDP,
)
from shardkit.nn.offload import OffloadModel
from shardkit.nn.pipe import Pipe, PipelineStage, Schedule1F1B, ScheduleGPipe
from shardkit.nn.wrap import (
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

__all__ = [
    "FSDP",
    "FullyShardedDataParallel",
    "OffloadModel",
    "Pipe",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ShardedDDP",
    "ShardedDataParallel",
    "auto_wrap",
    "checkpoint_wrapper",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "enable_wrap",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]
