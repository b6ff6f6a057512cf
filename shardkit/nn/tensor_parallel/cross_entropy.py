"""Cross-entropy over vocabulary-parallel logits, without gathering the full logits.

Each rank holds logits ``(..., V / T)`` for its slice of the vocabulary (the output of
a :class:`~shardkit.nn.tensor_parallel.ColumnParallelLinear` LM head with
``gather_output=False``). The loss ``log sum_v exp(z_v) - z_target`` needs three
all-reduces of ``(...)``-shaped tensors, never of ``(..., V)``:

1. the maximum logit (MAX), subtracted for stability;
2. the target's logit, held by one rank (the others contribute 0) (SUM);
3. the sum of ``exp`` over the vocabulary (SUM).

The gradient with respect to the local logits is ``softmax - onehot(target)`` restricted
to the local slice, computed from what forward kept; backward needs no collective.
Source: Shoeybi et al. 2019 (Megatron-LM), section 3, "output embedding".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardkit.nn.tensor_parallel.groups import TPGroup, rank_and_size, resolve_group

__all__ = ["vocab_parallel_cross_entropy"]


def _all_reduce(t: torch.Tensor, op: Any, group: dist.ProcessGroup | None) -> None:
    if rank_and_size(group)[1] > 1:
        dist.all_reduce(t, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: dist.ProcessGroup | None,
        ignore_index: int,
    ) -> torch.Tensor:
        rank, _ = rank_and_size(group)
        z = logits.float()
        z_max = z.max(dim=-1).values
        _all_reduce(z_max, dist.ReduceOp.MAX, group)
        z = z - z_max.unsqueeze(-1)
        part = z.shape[-1]
        start = rank * part
        ignored = target == ignore_index
        outside = (target < start) | (target >= start + part) | ignored
        local_target = (target - start).masked_fill(outside, 0)
        z_target = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        z_target = z_target.masked_fill(outside, 0.0)
        _all_reduce(z_target, dist.ReduceOp.SUM, group)
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        loss = (sum_exp.log() - z_target).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target, ignored)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, outside, local_target, ignored = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        scale = grad_loss.float().masked_fill(ignored, 0.0).unsqueeze(-1)
        return (grad * scale).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    process_group: TPGroup = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token cross-entropy from vocabulary-parallel logits (FairScale's name).

    ``vocab_parallel_cross_entropy(z_i, t)`` on every rank equals
    ``F.cross_entropy(z.flatten(0, -2), t.flatten(), reduction="none").view_as(t)`` for
    the full logits ``z = [z_1 .. z_T]``; take ``.mean()`` (or, with ignored tokens,
    ``.sum() / (t != ignore_index).sum()``) for ``F.cross_entropy``'s default. Computed
    in fp32 whatever the logits' dtype; the gradient has the logits' dtype.

    Args:
        vocab_parallel_logits: this rank's logits ``(..., V / tp)`` (rank i holds token
            ids ``[i V/tp, (i+1) V/tp)``).
        target: token ids ``(...)``, int64, the same on every rank.
        process_group: the tensor-parallel group; default None (the mesh's).
        ignore_index: a target id whose loss and gradient are 0. Default -100 (torch's).

    Returns:
        The loss per token, ``(...)`` fp32, the same on every rank.
    """
    group = resolve_group(process_group)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, group, ignore_index)
