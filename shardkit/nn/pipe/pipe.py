"""``Pipe``: a micro-batched pipeline over devices in one process (GPipe, torchgpipe)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from shardkit.distributed.validation import check_not_wrapped, check_parameters
from shardkit.nn.pipe.batchnorm import DeferredBatchNorm
from shardkit.nn.pipe.checkpoint import CheckpointMode
from shardkit.nn.pipe.microbatch import TensorOrTensors, check_value, gather, scatter
from shardkit.nn.pipe.partition import BalanceError, split_module, verify_balance, verify_module
from shardkit.nn.pipe.pipeline import Pipeline

__all__ = ["DeviceCountError", "Pipe"]

Device = torch.device | str | int

_BALANCE_HELPERS = (
    "compute one with shardkit.nn.pipe.balance_by_size(partitions, module) (bytes of "
    "parameters and buffers) or shardkit.nn.pipe.balance_by_time(partitions, module, "
    "sample) (measured forward time), e.g. "
    "Pipe(module, balance_by_size(2, module), devices=[...])"
)


class DeviceCountError(BalanceError, IndexError):
    """Fewer devices than partitions: a :class:`BalanceError`, and an ``IndexError`` as
    FairScale's ``Pipe`` raises for it."""


def _int_chunks(chunks: object) -> int:
    """``chunks`` as an int: FairScale takes ``int(chunks)`` (``42.0`` is 42).

    Raises:
        ValueError: a value that is not a whole number, or < 1.
    """
    try:
        value = int(chunks)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        value = None
    if value is None or value != chunks:
        raise ValueError(f"chunks must be a whole number of micro-batches >= 1; got {chunks!r}")
    if value < 1:
        raise ValueError(f"chunks must be >= 1 (micro-batches per mini-batch); got {chunks}")
    return value


def _moving_denied(call: str, devices: Sequence[torch.device]) -> TypeError:
    return TypeError(
        f"Pipe.{call} is refused: a Pipe places each partition on its own device "
        f"({[str(d) for d in devices]}), and moving the whole Pipe would put every "
        "partition on one device. Choose the devices when building it: "
        "Pipe(module, balance, devices=[...]); send the inputs to pipe.devices[0] and the "
        "targets to pipe.devices[-1]. Casting the dtype is allowed (pipe.to(torch.float64), "
        "pipe.half())"
    )


def resolve_devices(devices: Sequence[Device] | None, partitions: int) -> list[torch.device]:
    """One ``torch.device`` per partition: the given ones, or ``cuda:0..`` / all ``cpu``.

    More devices than partitions are allowed: the first ``partitions`` are used (the
    ``devices=range(torch.cuda.device_count())`` pattern), as in FairScale.

    Raises:
        DeviceCountError: fewer devices than partitions (a :class:`BalanceError` and an
            ``IndexError``).
    """
    if devices is None:
        if torch.cuda.is_available() and torch.cuda.device_count() >= partitions:
            return [torch.device("cuda", i) for i in range(partitions)]
        return [torch.device("cpu")] * partitions
    resolved = [torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices]
    if len(resolved) < partitions:
        raise DeviceCountError(
            f"balance has {partitions} partitions but {len(resolved)} devices were given "
            f"({[str(d) for d in resolved]}); give one device per partition"
        )
    return resolved[:partitions]


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
            to the next, and a layer is given a tuple as one argument. An empty
            ``nn.Sequential()`` with ``balance=[]`` is allowed: its forward returns the
            input.
        balance: layers per partition, summing to ``len(module)``;
            :func:`balance_by_size` / :func:`balance_by_time` compute one. Required (the
            error for a missing one recommends them).
        devices: one device per partition (``"cpu"`` allowed); extra devices are
            ignored (the first ``len(balance)`` are used); default ``cuda:0..`` when
            there are enough GPUs, else all ``cpu``. The layers are moved there.
        chunks: micro-batches per mini-batch (>= 1, a whole number: ``4.0`` is taken
            as ``4``, as in FairScale); default 1 (no pipelining).
        checkpoint: ``"always"``, ``"except_last"`` (default) or ``"never"``: which
            micro-batches are re-materialized in backward instead of keeping their
            activations (only in training mode with grad enabled). Any object whose
            ``str()`` is one of these is accepted; ``pipe.checkpoint`` is the ``str``.
        deferred_batch_norm: replace every BatchNorm with
            :class:`DeferredBatchNorm`, whose running statistics cover the whole
            mini-batch; default False.

    Input: a tensor or tuple of tensors ``(B, ...)`` with ``B >= chunks``, on any device
    (copied to ``devices[0]``). Output: the module's output on ``devices[-1]``.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``; a parameter has an integer,
            bool or complex dtype.
        BalanceError: ``balance`` does not sum to ``len(module)`` (the message
            recommends the balancing helpers); :class:`DeviceCountError` (also an
            ``IndexError``): fewer devices than partitions.
        ValueError: ``balance`` is missing (the message recommends the balancing
            helpers); ``module`` is (or contains) a Pipe already, a parameter is on the
            meta device, ``chunks`` < 1 or not a whole number, an unknown
            ``checkpoint``, a parameter shared by partitions on different devices; in
            forward, a batch smaller than ``chunks``.

    Moving a Pipe (``.cuda()``, ``.cpu()``, ``.to(device)``, ``.to(tensor)``) raises
    ``TypeError``, as in FairScale: it would put every partition on one device.
    Casting (``.to(torch.float64)``, ``.half()``) is allowed.

    Memory: a partition keeps, per micro-batch, its input when checkpointed, else every
    activation autograd saves; with ``except_last`` that is about
    ``inputs * (chunks - 1) + activations / chunks`` per partition.
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | None = None,
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
        if balance is None:
            raise ValueError(
                f"Pipe needs balance= (layers per partition, summing to the module's "
                f"{len(module)} layers); {_BALANCE_HELPERS}"
            )
        balance = list(balance)
        if not balance and len(module) == 0:  # an empty pipeline: forward is the identity
            self.balance: list[int] = []
        else:
            self.balance = verify_balance(balance, len(module))  # its errors name the helpers
        self.chunks = _int_chunks(chunks)
        self.checkpoint = CheckpointMode.parse(str(checkpoint)).value
        self.devices = resolve_devices(devices, len(self.balance))
        if deferred_batch_norm:
            DeferredBatchNorm.convert_deferred_batch_norm(module, chunks)
        parts = split_module(module, self.balance)
        verify_no_shared_parameters(parts, self.devices)
        self.partitions = nn.ModuleList(p.to(d) for p, d in zip(parts, self.devices))
        self._pipeline = Pipeline(
            list(self.partitions), self.devices, CheckpointMode(self.checkpoint)
        )

    # Pipe places each partition; moving it whole is refused (as in FairScale).
    def cuda(self, device: Device | None = None) -> Pipe:
        """Refused (``TypeError``): see the class notes."""
        raise _moving_denied("cuda()", self.devices)

    def cpu(self) -> Pipe:
        """Refused (``TypeError``): see the class notes."""
        raise _moving_denied("cpu()", self.devices)

    def to(self, *args: Any, **kwargs: Any) -> Pipe:  # type: ignore[override]
        """Cast the dtype (``pipe.to(torch.float64)``, ``pipe.to(dtype=...)``); a device
        or a tensor (``to(device)``, ``to(tensor)``) is refused with ``TypeError``."""
        first = args[0] if args else None
        if (
            "device" in kwargs
            or "tensor" in kwargs
            or isinstance(first, (torch.device, str, int, torch.Tensor))
        ):
            raise _moving_denied("to(...) with a device", self.devices)
        return super().to(*args, **kwargs)  # type: ignore[no-any-return]

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
        if not self.balance:  # an empty module (Pipe(nn.Sequential(), []))
            return check_value(input)
        batches = scatter(input, self.chunks)
        self._pipeline.run(batches)
        return gather(batches)
