"""The differentiable all-to-all: one implementation for every layer that exchanges rows.

One ``torch.distributed.all_to_all_single`` whose backward is the all-to-all with the
splits swapped (the gradient of a row goes back the way the row came). Its users:

- expert parallelism (:mod:`shardkit.nn.moe`): dispatch sends each token to the rank
  holding its expert, combine sends the expert's output back; variable splits serve
  dropless routing, equal splits (None) FairScale's capacity buffer;
- Ulysses (:mod:`shardkit.nn.context_parallel`): a tensor split on the sequence becomes
  split on the heads and back (:func:`shardkit.nn.context_parallel.sequence_all_to_all`
  stacks the parts on a new dim 0 and exchanges them with equal splits).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_to_all"]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        output_splits: list[int] | None,
        input_splits: list[int] | None,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        return _exchange(input, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def _exchange(
    input: torch.Tensor,
    output_splits: list[int] | None,
    input_splits: list[int] | None,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    input = input.contiguous()
    rows = input.shape[0] if output_splits is None else sum(output_splits)
    output = input.new_empty((rows, *input.shape[1:]))
    dist.all_to_all_single(output, input, output_splits, input_splits, group=group)
    return output


def all_to_all(
    input: torch.Tensor,
    group: dist.ProcessGroup | None,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
) -> torch.Tensor:
    """Rows ``input_splits[r]`` of ``input`` (dim 0, in rank order) go to rank ``r`` of
    ``group``; the result holds ``output_splits[r]`` rows from each rank ``r``.

    Differentiable (the backward is the same exchange with the splits swapped).

    Args:
        input: ``(rows, ...)``, any dtype ``all_to_all_single`` takes.
        group: the process group (expert- or context-parallel; None: the world).
        output_splits: rows received from each rank; None: equal parts of ``rows``.
        input_splits: rows sent to each rank; None: equal parts of ``rows``.

    Returns:
        ``(sum(output_splits), ...)`` (``(rows, ...)`` for equal splits).
    """
    out: torch.Tensor = _AllToAll.apply(input, output_splits, input_splits, group)
    return out
