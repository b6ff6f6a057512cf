"""Splitting and gathering one dimension (the sequence) over a process group, with autograd.

The sequence-parallel operators of Megatron-LM (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4.2.2), knowing no
layer: :mod:`shardkit.nn.tensor_parallel` (sequence-parallel regions around its
column- and row-parallel layers) and :mod:`shardkit.nn.moe` (an MoE layer routing the
gathered sequence) both use them. Each rank holds a contiguous chunk of dimension
``dim``, in rank order; ``group`` None is one process (every operator the identity).

| operator | forward | backward |
|---|---|---|
| :func:`split_sequence` | keep own chunk | all-gather |
| :func:`gather_sequence` (``grad="reduce_scatter"``) | all-gather | reduce-scatter (sum) |
| :func:`gather_sequence` (``grad="split"``) | all-gather | keep own chunk |
| :func:`reduce_scatter_sequence` | reduce-scatter (sum) | all-gather |

``grad="reduce_scatter"`` is for a consumer whose gradients are partial sums over the
group (a column-parallel layer); ``grad="split"`` for one whose gradients are the same
on every rank (a replicated computation, e.g. a gate routing every token; Megatron-LM's
``tensor_parallel_output_grad=False``).

[Note: checking the chunks' shapes]
The all-gather concatenates one chunk of the same shape from every rank; a rank whose
chunk differs (3 positions against 5) makes gloo abort the process or the group wait
until its timeout. Chunks made by :func:`split_sequence` or
:func:`reduce_scatter_sequence` are equal by construction (both refuse a length not
divisible by the group's size), so the tensor-parallel regions gather without a check.
A caller whose input comes from the user (a sequence-parallel MoE layer) passes
``check_shapes=True``: one all-gather of each rank's shape (10 integers) first, and
every rank raises the same ValueError, naming each rank's shape, before the gather.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

__all__ = ["gather_sequence", "reduce_scatter_sequence", "split_sequence"]


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _check_divisible(x: torch.Tensor, dim: int, world: int) -> None:
    size = x.shape[dim]
    if size % world != 0:
        raise ValueError(
            f"sequence length {size} (dim {dim} of shape {tuple(x.shape)}) is not divisible "
            f"by the tensor-parallel degree {world} (sequence parallel splits it into {world} "
            f"equal chunks); pad the sequence to a multiple of {world} or turn "
            "sequence_parallel off"
        )


_SHAPE_SLOTS = 8  # dims compared one by one; the number of dims and numel cover the rest


def _check_same_shape(x: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank of ``group`` unless every rank's ``x`` has the same shape
    (``[Note: checking the chunks' shapes]``)."""
    world = _rank_and_size(group)[1]
    if world == 1:
        return
    dims = list(x.shape[:_SHAPE_SLOTS]) + [-1] * (_SHAPE_SLOTS - min(x.dim(), _SHAPE_SLOTS))
    mine = torch.tensor([x.dim(), x.numel(), *dims], dtype=torch.int64, device=x.device)
    every = mine.new_empty(world * mine.numel())
    dist.all_gather_single(every, mine, group=group)
    every = every.view(world, -1)
    if bool((every == every[0]).all()):
        return
    shapes = ", ".join(
        f"rank {r} {tuple(int(d) for d in row[2 : 2 + min(int(row[0]), _SHAPE_SLOTS)])}"
        for r, row in enumerate(every.cpu())
    )
    raise ValueError(
        f"sequence parallel gathers one chunk of the same shape on every rank of the group "
        f"(concatenated along the sequence dimension, in rank order); got {shapes}. Give "
        f"every rank an equal chunk: pad the sequence to a multiple of {world} and split it "
        "with split_sequence"
    )


def _split(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's contiguous chunk of dimension ``dim``."""
    rank, world = _rank_and_size(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world)
    return x.chunk(world, dim=dim)[rank].contiguous()


def _gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The chunks of every rank concatenated along ``dim``, in rank order."""
    world = _rank_and_size(group)[1]
    if world == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((world * front.shape[0], *front.shape[1:]))
    dist.all_gather_single(out, front, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum over ranks of this rank's chunk of ``dim``."""
    world = _rank_and_size(group)[1]
    if world == 1:
        return x
    _check_divisible(x, dim, world)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    dist.reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim)


class _ToChunk(torch.autograd.Function):
    """This rank's chunk (kept, or summed over the group) in forward; all-gather of the
    gradient in backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, dim: int, reduce: bool
    ) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return (_reduce_scatter if reduce else _split)(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        group: dist.ProcessGroup | None,
        dim: int,
        reduce: bool,
        check_shapes: bool,
    ) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.reduce = group, dim, reduce
        if check_shapes:
            _check_same_shape(x, group)
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        back = _reduce_scatter if ctx.reduce else _split
        return back(grad, ctx.dim, ctx.group), None, None, None, None


def split_sequence(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """This rank's contiguous chunk of ``dim`` (forward); all-gather of the gradient.

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by the group's size (both named).
    """
    out: torch.Tensor = _ToChunk.apply(x, group, dim, False)
    return out


def gather_sequence(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    dim: int,
    grad: Literal["reduce_scatter", "split"] = "reduce_scatter",
    check_shapes: bool = False,
) -> torch.Tensor:
    """Every rank's chunk concatenated along ``dim`` (forward, rank order); in backward
    the gradient reduce-scattered (``"reduce_scatter"``, the default: partial sums) or
    split (``"split"``: the same gradient on every rank).

    Every rank's ``x`` must have the same shape: ``(..., s, ...)`` gives ``(..., world
    x s, ...)``.

    Args:
        x: this rank's chunk.
        group: the process group; None: one process (the identity).
        dim: the dimension gathered.
        grad: the backward, ``"reduce_scatter"`` (default) or ``"split"``.
        check_shapes: all-gather every rank's shape first (10 integers per rank) and
            raise on every rank if they differ, instead of a gloo abort or a wait until
            the group's timeout (``[Note: checking the chunks' shapes]``). Default False
            (chunks made by :func:`split_sequence` are equal).

    Raises:
        ValueError: with ``check_shapes``, ranks passed chunks of different shapes (each
            rank's shape named); raised on every rank of ``group``.
    """
    out: torch.Tensor = _Gather.apply(x, group, dim, grad == "reduce_scatter", check_shapes)
    return out


def reduce_scatter_sequence(
    x: torch.Tensor, group: dist.ProcessGroup | None, dim: int
) -> torch.Tensor:
    """The sum over ``group`` of this rank's chunk of ``dim`` (forward); all-gather of
    the gradient.

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by the group's size (both named).
    """
    out: torch.Tensor = _ToChunk.apply(x, group, dim, True)
    return out
