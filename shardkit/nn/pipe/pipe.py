"""``Pipe``: a micro-batched pipeline over devices in one process (GPipe, torchgpipe)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from shardkit.distributed.validation import check_not_wrapped, check_parameters
from shardkit.nn.pipe.batchnorm import DeferredBatchNorm
from shardkit.nn.pipe.checkpoint import CheckpointMode
from shardkit.nn.pipe.microbatch import TensorOrTensors, gather, scatter
from shardkit.nn.pipe.partition import BalanceError, split_module, verify_balance, verify_module
from shardkit.nn.pipe.pipeline import Pipeline

__all__ = ["Pipe"]

Device = torch.device | str | int


def resolve_devices(devices: Sequence[Device] | None, partitions: int) -> list[torch.device]:
    """One ``torch.device`` per partition: the given ones, or ``cuda:0..`` / all ``cpu``.

    Raises:
        BalanceError: the number of devices differs from the number of partitions.
    """
    if devices is None:
        if torch.cuda.is_available() and torch.cuda.device_count() >= partitions:
            return [torch.device("cuda", i) for i in range(partitions)]
        return [torch.device("cpu")] * partitions
    resolved = [torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices]
    if len(resolved) != partitions:
        raise BalanceError(
            f"balance has {partitions} partitions but {len(resolved)} devices were given "
            f"({[str(d) for d in resolved]}); give one device per partition"
        )
    return resolved


def verify_no_shared_parameters(
    partitions: Sequence[nn.Module], devices: Sequence[torch.device]
) -> None:
    """Refuse a parameter shared by partitions on different devices (it cannot be on both).

    Raises:
        ValueError: naming the partitions that share it.
    """
    owner: dict[int, int] = {}
    for j, part in enumerate(partitions):
        for p in part.parameters():
            first = owner.setdefault(id(p), j)
            if first != j and devices[first] != devices[j]:
                raise ValueError(
                    f"partitions {first} and {j} share a parameter of shape {tuple(p.shape)} but "
                    f"sit on {devices[first]} and {devices[j]}; keep the layers that share it in one "
                    "partition, or put those partitions on one device"
                )


class Pipe(nn.Module):
    """Wraps an ``nn.Sequential`` to run it as a micro-batched pipeline over devices.

    Example:
        >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        >>> pipe = Pipe(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=4)
        >>> out = pipe(torch.randn(10, 16))      # micro-batches of 3, 3, 2, 2 rows
        >>> out.shape
        torch.Size([10, 4])

    The mini-batch is split on dim 0 into ``chunks`` micro-batches; partition ``j`` (the
    layers given by ``balance[j]``) runs on ``devices[j]``, and micro-batch ``i`` reaches
    partition ``j`` at clock tick ``i + j`` so that devices work at the same time
    (GPipe, Huang et al. 2019; torchgpipe, Kim et al. 2020). Outputs and gradients
    equal those of the plain module (transparency), up to floating-point rounding,
    except for layers that mix rows of the batch (BatchNorm: see
    ``deferred_batch_norm``).

    Args:
        module: the model; its layers pass one value (a tensor or a tuple of tensors)
            to the next, and a layer is given a tuple as one argument.
        balance: layers per partition, summing to ``len(module)``;
            :func:`balance_by_size` / :func:`balance_by_time` compute one.
        devices: one device per partition (``"cpu"`` allowed); default ``cuda:0..``
            when there are enough GPUs, else all ``cpu``. The layers are moved there.
        chunks: micro-batches per mini-batch (>= 1); default 1 (no pipelining).
        checkpoint: ``"always"``, ``"except_last"`` (default) or ``"never"``: which
            micro-batches are re-materialized in backward instead of keeping their
            activations (only in training mode with grad enabled).
        deferred_batch_norm: replace every BatchNorm with
            :class:`DeferredBatchNorm`, whose running statistics cover the whole
            mini-batch; default False.

    Input: a tensor or tuple of tensors ``(B, ...)`` with ``B >= chunks``, on any device
    (copied to ``devices[0]``). Output: the module's output on ``devices[-1]``.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``; a parameter has an integer,
            bool or complex dtype.
        BalanceError: ``balance`` does not sum to ``len(module)``, or devices and
            partitions differ in number.
        ValueError: ``module`` is (or contains) a Pipe already, a parameter is on the meta
            device, ``chunks`` < 1, an unknown ``checkpoint``, a parameter shared by
            partitions on different devices; in forward, a batch smaller than ``chunks``.

    Memory: a partition keeps, per micro-batch, its input when checkpointed, else every
    activation autograd saves; with ``except_last`` that is about
    ``inputs * (chunks - 1) + activations / chunks`` per partition.
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int],
        *,
        devices: Sequence[Device] | None = None,
        chunks: int = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
    ) -> None:
        super().__init__()
        check_not_wrapped("Pipe", module, Pipe)
        verify_module(module)
        check_parameters("Pipe", module.named_parameters())
        self.balance = verify_balance(balance, len(module))
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1 (micro-batches per mini-batch); got {chunks}")
        self.chunks = chunks
        self.checkpoint = CheckpointMode.parse(checkpoint).value
        self.devices = resolve_devices(devices, len(self.balance))
        if deferred_batch_norm:
            DeferredBatchNorm.convert_deferred_batch_norm(module, chunks)
        parts = split_module(module, self.balance)
        verify_no_shared_parameters(parts, self.devices)
        self.partitions = nn.ModuleList(p.to(d) for p, d in zip(parts, self.devices))
        self._pipeline = Pipeline(
            list(self.partitions), self.devices, CheckpointMode(self.checkpoint)
        )

    def __len__(self) -> int:
        """Number of layers."""
        return sum(self.balance)

    def __iter__(self) -> Iterator[nn.Module]:
        """The layers in order."""
        for part in self.partitions:
            yield from part.children()

    def __getitem__(self, index: int) -> nn.Module:
        """Layer ``index`` of the wrapped module (negative indices allowed)."""
        layers = list(self)
        return layers[index]

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        """Run ``input`` (``(B, ...)`` tensors, ``B >= chunks``) through the pipeline.

        Raises:
            TypeError: ``input`` is not a tensor or tuple of tensors.
            ValueError: ``B < chunks`` (the message gives the fix).
        """
        batches = scatter(input, self.chunks)
        self._pipeline.run(batches)
        return gather(batches)
