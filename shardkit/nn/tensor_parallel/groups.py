"""Which process group a tensor-parallel layer splits over, and this rank's place in it.

[Note: the one read of the registered mesh]
:func:`resolve_group` falls back to the process-wide mesh registered with
:mod:`shardkit.distributed.mpu` (``initialize_model_parallel`` / ``set_mesh``) when a
layer is given no group: FairScale and Megatron-LM scripts build their layers that way.
It is the only place in the library, outside ``mpu`` itself, that reads the registered
mesh; everything else (the checkpoint included) takes groups explicitly or reads the
shard descriptor the layer recorded (with the group resolved here).
"""

from __future__ import annotations

import torch.distributed as dist

from shardkit.distributed import mpu

__all__ = ["TPGroup", "resolve_group"]

#: A tensor-parallel process group; None means "resolve the default" (:func:`resolve_group`).
TPGroup = dist.ProcessGroup | None


def resolve_group(process_group: TPGroup) -> dist.ProcessGroup | None:
    """The group a layer splits over.

    ``process_group`` if given; else the tensor-parallel group of the process-wide mesh
    (``shardkit.distributed.mpu.initialize_model_parallel`` or ``set_mesh``) when one is
    set; else the world group when ``torch.distributed`` is initialised; else None
    (one rank: degree 1, nothing is split).
    """
    if process_group is not None:
        return process_group
    if mpu.model_parallel_is_initialized():
        return mpu.get_model_parallel_group()
    if dist.is_initialized():
        return dist.group.WORLD
    return None


def rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This rank's index in ``group`` and the group's size (``(0, 1)`` for None)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)
