"""Shared mechanics for the wrappers: fixed-size buckets and collective helpers.

- :mod:`shardkit.distributed.buckets`: :func:`plan_buckets` (split tensors into
  buckets of a fixed byte size), :func:`pack` / :func:`unpack` (flat buffers) and
  :class:`BufferPool` (reuse flat buffers across steps).
- :mod:`shardkit.distributed.collectives`: :func:`global_rank` (a group rank to the
  global rank collectives take), :func:`group_rank` / :func:`group_size` (also of a
  one-rank stand-in group, checked by :func:`check_group`), :func:`group_ranks` and :func:`broadcast_from_owners` (bucketed,
  asynchronous broadcasts of each owner's tensors, planned by
  :func:`plan_owner_broadcast`).

- :mod:`shardkit.distributed.all_to_all`: the differentiable all-to-all of expert
  parallelism and Ulysses.
- :mod:`shardkit.distributed.mesh`: :class:`ParallelDims` (pp x dp_replicate x dp_shard
  x tp) and :class:`ProcessMesh` (rank coordinates, groups created on demand).
- :mod:`shardkit.distributed.mpu`: :class:`ModelParallelUnit` (Megatron-LM / DeepSpeed's
  ``mpu``) and FairScale's ``initialize_model_parallel`` family.
- :mod:`shardkit.distributed.shard_descriptor`: ``TensorView``, the one shard
  descriptor (full shape, the piece a rank holds, its split and replica groups) and who
  writes a replicated piece; :mod:`shardkit.distributed.shard_elements`: its element
  arithmetic.

Nothing here knows about optimizers or modules; it moves lists of tensors.
"""

from shardkit.distributed.buckets import (
    DEFAULT_BUCKET_BYTES,
    BufferPool,
    copy_scaled,
    pack,
    plan_buckets,
    unpack,
)
from shardkit.distributed.collectives import (
    BroadcastBucket,
    broadcast_from_owners,
    check_group,
    global_rank,
    group_rank,
    group_ranks,
    group_size,
    plan_owner_broadcast,
)
from shardkit.distributed.mesh import ParallelDims, ProcessMesh
from shardkit.distributed.mpu import ModelParallelUnit

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "BroadcastBucket",
    "BufferPool",
    "ModelParallelUnit",
    "ParallelDims",
    "ProcessMesh",
    "broadcast_from_owners",
    "check_group",
    "copy_scaled",
    "global_rank",
    "group_rank",
    "group_ranks",
    "group_size",
    "pack",
    "plan_buckets",
    "plan_owner_broadcast",
    "unpack",
]
