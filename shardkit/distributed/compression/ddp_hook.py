"""The torch DDP communication hook that reduces each bucket through a compressor."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # torch.distributed.GradBucket
from torch.nn.parallel import DistributedDataParallel

from shardkit.distributed.compression.interface import GradCompressor
from shardkit.distributed.compression.router import get_compressor

__all__ = ["DDPCompressionState", "ddp_compression_hook", "register_ddp_comm_hook"]


@dataclass
class DDPCompressionState:
    """The state of :func:`ddp_compression_hook`.

    Attributes:
        compressor: the compressor every bucket goes through.
        group: the DDP model's process group (None: the world group).
        prefix: first element of each bucket's key, ``(prefix, bucket index)``.
    """

    compressor: GradCompressor
    group: dist.ProcessGroup | None = None
    prefix: str = "ddp"


def _bucket_shapes(bucket: GradBucket, buffer: torch.Tensor) -> list[torch.Size] | None:
    """Shapes of the bucket's gradients when they lie one after another in the buffer."""
    expected = buffer.storage_offset()
    base = buffer.untyped_storage().data_ptr()
    shapes = []
    for g in bucket.gradients():
        if g.is_sparse or g.untyped_storage().data_ptr() != base:
            return None
        if g.storage_offset() != expected or not g.is_contiguous():
            return None
        expected += g.numel()
        shapes.append(g.shape)
    return shapes if expected - buffer.storage_offset() == buffer.numel() else None


def ddp_compression_hook(
    state: DDPCompressionState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch DDP communication hook: each bucket divided by the group size (DDP's mean)
    and all-reduced through ``state.compressor`` (key ``(state.prefix, bucket index)``;
    the gradients' shapes passed when they lie in order in the buffer).

    Register it with :func:`register_ddp_comm_hook`, or
    ``ddp.register_comm_hook(DDPCompressionState(compressor, ddp.process_group),
    ddp_compression_hook)``. DDP rebuilds its buckets after the first iteration; a key
    whose size changed starts with fresh state.

    Returns:
        A completed Future of the bucket's buffer (the mean over the ranks).
    """
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(state.group))
    state.compressor.all_reduce(
        buffer,
        state.group,
        key=(state.prefix, bucket.index()),
        shapes=_bucket_shapes(bucket, buffer),
    )
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


# DDP checks the hook's annotations as objects; postponed (string) annotations fail it.
ddp_compression_hook.__annotations__ = {
    "state": DDPCompressionState,
    "bucket": GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def register_ddp_comm_hook(
    module: DistributedDataParallel, compressor: GradCompressor | str
) -> DDPCompressionState:
    """Register :func:`ddp_compression_hook` with ``compressor`` on a torch DDP model
    (once, before its first backward); returns the hook's state.

    Raises:
        TypeError: ``module`` is not a torch ``DistributedDataParallel``.
        ValueError: an unknown compressor name.
    """
    if not isinstance(module, DistributedDataParallel):
        raise TypeError(
            "register_ddp_comm_hook needs a torch.nn.parallel.DistributedDataParallel; got "
            f"{type(module).__module__}.{type(module).__name__}"
        )
    resolved = get_compressor(compressor)
    assert resolved is not None
    state = DDPCompressionState(resolved, module.process_group)
    module.register_comm_hook(state, ddp_compression_hook)
    return state
