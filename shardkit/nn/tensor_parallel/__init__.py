"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, section 3), FairScale's names.

- :mod:`~shardkit.nn.tensor_parallel.mappings`: the four region operators (copy / reduce /
  scatter / gather) and the three of sequence parallelism;
- :mod:`~shardkit.nn.tensor_parallel.linear`: :class:`ColumnParallelLinear`,
  :class:`RowParallelLinear`;
- :mod:`~shardkit.nn.tensor_parallel.embedding`: :class:`VocabParallelEmbedding`,
  :class:`ParallelEmbedding`;
- :mod:`~shardkit.nn.tensor_parallel.cross_entropy`: :func:`vocab_parallel_cross_entropy`;
- :mod:`~shardkit.nn.tensor_parallel.sequence_parallel`: :class:`SequenceParallelLayerNorm`;
- :mod:`~shardkit.nn.tensor_parallel.random`: the model-parallel RNG tracker;
- :mod:`~shardkit.nn.tensor_parallel.plan`: :func:`parallelize` an existing model by a
  plan (:func:`gpt_plan` for the GPT);
- :mod:`~shardkit.nn.tensor_parallel.partition`: :func:`shard` / :func:`full_tensor` and
  the tensor-parallel parameter attributes;
- :mod:`~shardkit.nn.tensor_parallel.grad_norm`: :func:`clip_grad_norm_` (global norm);
- :mod:`~shardkit.nn.tensor_parallel.state_dict`: consolidated and sharded state dicts
  that load at any tensor-parallel degree.

Process groups come from :mod:`shardkit.distributed.mesh` / :mod:`shardkit.distributed.mpu`.
"""

from shardkit.nn.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from shardkit.nn.tensor_parallel.embedding import ParallelEmbedding, VocabParallelEmbedding
from shardkit.nn.tensor_parallel.grad_norm import clip_grad_norm_
from shardkit.nn.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from shardkit.nn.tensor_parallel.mappings import (
    copy_to_model_parallel_region,
    copy_to_tensor_parallel_region,
    gather_from_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_model_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_model_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from shardkit.nn.tensor_parallel.partition import full_tensor, is_tensor_parallel, shard
from shardkit.nn.tensor_parallel.plan import (
    ColumnParallel,
    HeadParallel,
    RowParallel,
    SequenceParallel,
    VocabParallel,
    gpt_plan,
    hf_gpt2_plan,
    parallelize,
)
from shardkit.nn.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
)
from shardkit.nn.tensor_parallel.sequence_parallel import SequenceParallelLayerNorm
from shardkit.nn.tensor_parallel.state_dict import (
    consolidated_state_dict,
    load_consolidated_state_dict,
    load_sharded,
    save_sharded,
)

__all__ = [
    "ColumnParallel",
    "ColumnParallelLinear",
    "HeadParallel",
    "ParallelEmbedding",
    "RowParallel",
    "RowParallelLinear",
    "SequenceParallel",
    "SequenceParallelLayerNorm",
    "VocabParallel",
    "VocabParallelEmbedding",
    "clip_grad_norm_",
    "consolidated_state_dict",
    "copy_to_model_parallel_region",
    "copy_to_tensor_parallel_region",
    "full_tensor",
    "gather_from_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "gpt_plan",
    "hf_gpt2_plan",
    "is_tensor_parallel",
    "load_consolidated_state_dict",
    "load_sharded",
    "model_parallel_cuda_manual_seed",
    "model_parallel_manual_seed",
    "parallelize",
    "reduce_from_model_parallel_region",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "save_sharded",
    "scatter_to_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
    "shard",
    "vocab_parallel_cross_entropy",
]
