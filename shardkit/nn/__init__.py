"""Module wrappers: gradient and parameter sharding, wrapping policies, pipeline, offload.

Tensor parallelism (column / row / vocabulary-parallel layers, the plan that applies
them) is the subpackage :mod:`shardkit.nn.tensor_parallel`; its layer classes are
re-exported here. Mixture of experts is :mod:`shardkit.nn.moe`; FairScale's
``MOELayer`` and ``Top2Gate`` are re-exported here (FairScale's ``fairscale.nn`` path).

Each wrapper is imported here as it lands; ``__all__`` lists the public names.
"""

from shardkit.nn.checkpoint import checkpoint_wrapper
from shardkit.nn.data_parallel import (
    FSDP,
    FullyShardedDataParallel,
    ShardedDataParallel,
    ShardedDDP,
)
from shardkit.nn.moe import MOELayer, Top2Gate
from shardkit.nn.offload import OffloadModel
from shardkit.nn.pipe import Pipe, PipelineStage, Schedule1F1B, ScheduleGPipe
from shardkit.nn.tensor_parallel import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
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
    "ColumnParallelLinear",
    "FullyShardedDataParallel",
    "MOELayer",
    "OffloadModel",
    "ParallelEmbedding",
    "Pipe",
    "PipelineStage",
    "RowParallelLinear",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ShardedDDP",
    "ShardedDataParallel",
    "Top2Gate",
    "VocabParallelEmbedding",
    "auto_wrap",
    "checkpoint_wrapper",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "enable_wrap",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]
