"""Copy of a micro-batch to the next partition's device, on a side stream.

On CUDA the copy is issued to the destination's copy stream after it has waited for
the source's compute stream, and the destination's compute stream then waits for the
copy, so a copy overlaps the compute of other micro-batches (torchgpipe, Kim et al.
2020, section 3.2.1). Autograd runs the backward of each copy on the stream its
forward used and synchronises with the consumers itself ("stream semantics of
backward passes"), so gradients need no extra handling. On CPU (or when both
partitions share a device) this is a plain, synchronous ``Tensor.to``.
"""

from __future__ import annotations

import torch

from shardkit.nn.pipe.microbatch import Batch
from shardkit.nn.pipe.stream import (
    AbstractStream,
    current_stream,
    record_stream,
    use_stream,
    wait_stream,
)

__all__ = ["copy_batch"]


def copy_batch(
    batch: Batch,
    device: torch.device,
    *,
    copy_stream: AbstractStream,
    compute_stream: AbstractStream,
) -> Batch:
    """``batch`` on ``device``, keeping autograd history.

    Args:
        batch: the micro-batch on the source device.
        device: the destination device.
        copy_stream: a side stream on ``device`` used for the copy.
        compute_stream: the stream on ``device`` that will consume the copy.

    Returns:
        The micro-batch on ``device`` (the same objects when already there).
    """
    if all(t.device == device for t in batch.tensors):
        return batch
    source = current_stream(batch.tensors[0].device)
    wait_stream(copy_stream, source)
    with use_stream(copy_stream):
        moved = [t.to(device, non_blocking=True) for t in batch.tensors]
    for src, dst in zip(batch.tensors, moved):
        record_stream(src, copy_stream)
        record_stream(dst, compute_stream)
    wait_stream(compute_stream, copy_stream)
    return batch.with_tensors(moved)
