"""Manipulation of micro-batches: split a mini-batch on dim 0, gather the outputs back.

A pipeline's input is a tensor or a tuple of tensors whose dim 0 is the batch. It is
split into ``chunks`` micro-batches (GPipe, Huang et al. 2019, section 2.2) that flow
through the partitions one after the other; the outputs of the last partition are
concatenated back on dim 0.

[Note: split sizes]
``torch.tensor_split`` semantics: exactly ``chunks`` micro-batches whose sizes differ by
at most one row (a batch of 10 in 4 chunks gives 3, 3, 2, 2). FairScale and torchgpipe
use ``torch.chunk``, which can yield fewer micro-batches than asked (10 in 4 gives 3, 3,
3, 1; 5 in 4 gives only 3 chunks); a fixed count keeps schedules and deferred
BatchNorm exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Batch", "TensorOrTensors", "gather", "scatter", "split_sizes"]

Tensors = tuple[torch.Tensor, ...]
TensorOrTensors = torch.Tensor | Tensors


class Batch:
    """One micro-batch: a tensor or a tuple of tensors, kept in the form it came in.

    Layers of an ``nn.Sequential`` receive exactly what the previous layer returned, so
    a tuple stays a tuple (one argument) and a tensor stays a tensor.
    """

    __slots__ = ("value",)

    def __init__(self, value: TensorOrTensors) -> None:
        self.value = value

    @property
    def atomic(self) -> bool:
        """True when the micro-batch is a single tensor (not a tuple)."""
        return isinstance(self.value, torch.Tensor)

    @property
    def tensors(self) -> Tensors:
        """The tensors of the micro-batch, as a tuple (a single tensor gives a 1-tuple)."""
        return (self.value,) if isinstance(self.value, torch.Tensor) else self.value

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> Batch:
        """A batch of the same form (tensor or tuple) holding ``tensors``."""
        return Batch(tensors[0] if self.atomic else tuple(tensors))

    def __len__(self) -> int:
        """Rows (dim 0) of the micro-batch."""
        return int(self.tensors[0].shape[0])


def check_value(value: object, what: str = "input") -> TensorOrTensors:
    """Return ``value`` if it is a tensor or a non-empty tuple of tensors.

    Raises:
        TypeError: naming the offending type (lists must be passed as tuples).
    """
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple) and value and all(isinstance(t, torch.Tensor) for t in value):
        return value
    kinds = [type(t).__name__ for t in value] if isinstance(value, (tuple, list)) else type(value)
    raise TypeError(
        f"pipeline {what} must be a tensor or a non-empty tuple of tensors; got {kinds}"
    )


def split_sizes(rows: int, chunks: int) -> list[int]:
    """Rows of each of ``chunks`` micro-batches: sizes differ by at most 1, larger first.

    Raises:
        ValueError: if ``chunks`` < 1 or ``rows`` < ``chunks``.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1; got {chunks}")
    if rows < chunks:
        raise ValueError(
            f"a batch of {rows} rows cannot be split into {chunks} micro-batches; "
            f"use chunks <= {rows} or a larger batch"
        )
    base, extra = divmod(rows, chunks)
    return [base + 1 if i < extra else base for i in range(chunks)]


def scatter(value: TensorOrTensors, chunks: int) -> list[Batch]:
    """Split a tensor or tuple of tensors on dim 0 into ``chunks`` micro-batches.

    Args:
        value: a tensor ``(B, ...)`` or a tuple of tensors sharing ``B`` on dim 0.
        chunks: number of micro-batches (>= 1, <= ``B``).

    Returns:
        ``chunks`` batches of ``B // chunks`` or ``B // chunks + 1`` rows, larger first.

    Raises:
        TypeError: ``value`` is not a tensor or tuple of tensors.
        ValueError: ``chunks`` < 1, ``B`` < ``chunks``, a 0-d tensor, or tuple members
            with different batch sizes (all named).
    """
    batch = Batch(check_value(value))
    if any(t.dim() == 0 for t in batch.tensors):
        raise ValueError("pipeline inputs need a batch dimension (dim 0); got a 0-d tensor")
    rows = [int(t.shape[0]) for t in batch.tensors]
    if len(set(rows)) != 1:
        raise ValueError(f"tensors of a tuple input must share dim 0 (the batch); got {rows}")
    sizes = split_sizes(rows[0], chunks)
    pieces = [t.split(sizes, dim=0) for t in batch.tensors]
    return [batch.with_tensors([p[i] for p in pieces]) for i in range(chunks)]


def gather(batches: Sequence[Batch]) -> TensorOrTensors:
    """Concatenate micro-batch outputs on dim 0 (elementwise for tuples).

    Raises:
        TypeError: micro-batches of different forms (tensor vs tuple, tuple lengths).
    """
    first = batches[0]
    forms = {(b.atomic, len(b.tensors)) for b in batches}
    if len(forms) != 1:
        raise TypeError(f"micro-batch outputs differ in form (is_tensor, length): {sorted(forms)}")
    columns = zip(*(b.tensors for b in batches))
    return first.with_tensors([torch.cat(col, dim=0) for col in columns]).value
