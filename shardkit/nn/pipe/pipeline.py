"""The single-process pipeline: run micro-batches through partitions by clock cycles."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.profiler import record_function

from shardkit.nn.pipe.checkpoint import CheckpointMode, run_checkpointed, should_checkpoint
from shardkit.nn.pipe.copy import copy_batch
from shardkit.nn.pipe.microbatch import Batch, check_value
from shardkit.nn.pipe.schedule import clock_cycles
from shardkit.nn.pipe.stream import AbstractStream, current_stream, new_stream, use_stream

__all__ = ["Pipeline"]


class Pipeline:
    """Runs micro-batches through partitions placed on devices, in GPipe clock order.

    Args:
        partitions: the ``nn.Sequential`` partitions, each already on its device.
        devices: one device per partition.
        checkpoint: which micro-batches are checkpointed (in training with grad on).
    """

    def __init__(
        self,
        partitions: Sequence[nn.Module],
        devices: Sequence[torch.device],
        checkpoint: CheckpointMode,
    ) -> None:
        self.partitions = list(partitions)
        self.devices = list(devices)
        self.checkpoint = checkpoint
        self.copy_streams: list[AbstractStream] = [new_stream(d) for d in self.devices]

    def run(self, batches: list[Batch]) -> None:
        """Run every micro-batch through every partition; ``batches`` is updated in place.

        Forward in clock ticks (micro-batch ``i`` on partition ``j`` at tick ``i + j``),
        here with ``m = 4`` micro-batches and ``n = 3`` partitions::

            tick        0    1    2    3    4    5
            partition 0 F0   F1   F2   F3
            partition 1      F0   F1   F2   F3
            partition 2           F0   F1   F2   F3

        Within a tick the tasks are issued by increasing partition (FairScale's order of
        layer calls; a failure in a later partition stops the tick before the earlier
        partitions take another micro-batch). Each task copies
        its micro-batch to the partition's device on a side stream, then runs the
        partition (checkpointed per :func:`should_checkpoint`). On CUDA the issuing
        thread does not wait for kernels, so partitions on different devices overlap;
        on CPU the tasks run one after the other (same order, same results). Backward
        is autograd's: it follows the recorded graph in reverse, recomputing each
        checkpointed (micro-batch, partition) just before its backward (GPipe, Huang
        et al. 2019, section 2.2, figure 2c).
        """
        chunks = len(batches)
        checkpointing = torch.is_grad_enabled() and self.partitions[0].training
        for tick in clock_cycles(chunks, len(self.partitions)):
            for i, j in tick:
                batches[i] = self._task(
                    batches[i],
                    i,
                    j,
                    checkpointing and should_checkpoint(self.checkpoint, i, chunks),
                )

    def _task(self, batch: Batch, i: int, j: int, checkpointed: bool) -> Batch:
        """Micro-batch ``i`` through partition ``j``: copy in, compute."""
        device, partition = self.devices[j], self.partitions[j]
        compute = current_stream(device)
        with record_function(f"Pipe::copy micro_batch={i} partition={j}"):
            batch = copy_batch(
                batch, device, copy_stream=self.copy_streams[j], compute_stream=compute
            )
        label = f"Pipe::forward micro_batch={i} partition={j}"
        with (
            record_function(label + (" checkpointed" if checkpointed else "")),
            use_stream(compute),
        ):
            out = (
                run_checkpointed(partition, batch.value) if checkpointed else partition(batch.value)
            )
        return Batch(check_value(out, f"output of partition {j} (micro-batch {i})"))
