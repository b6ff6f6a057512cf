"""Experts stored stacked: one ``(E, d_in, d_out)`` weight per projection.

torchtitan's ``GroupedExperts`` layout: expert ``e``'s feed-forward network is
``act(x @ w1[e]) @ w2[e]``. A rank of an expert-parallel group of ``ep`` ranks holds
experts ``[r * E/ep, (r+1) * E/ep)``: a dim-0 slice of the global tensors, recorded on
each weight with the shard descriptor (``TensorView(split_dim=0, part=r, parts=ep,
mesh_dim="ep")``: a split over ``ep``, which tensor-parallel readers leave alone),
so the universal checkpoint saves and loads the experts at any ``ep`` with nothing
expert-specific in :mod:`shardkit.checkpoint`.

[Note: tensor parallel inside each expert]
Given a tensor-parallel group of ``tp`` ranks as well, each expert is split the way
Megatron-LM splits its MLP (Shoeybi et al. 2019, section 3): ``w1`` column-parallel
(rank ``t`` keeps hidden columns ``[t F/tp, (t+1) F/tp)``, a ``(E/ep, M, F/tp)``
tensor), ``w2`` row-parallel (the same rows, ``(E/ep, F/tp, M)``). The ``tp`` ranks
receive the same tokens (the dense layers before them leave the activations
replicated over ``tp``, the gate is replicated, so the dispatch all-to-all over ``ep``
is the same on each of them); each computes ``act(x @ w1_t) @ w2_t``, a partial sum
of the expert's output, and one all-reduce over ``tp``
(:func:`~shardkit.distributed.all_reduce.reduce_from_region`) completes it before the
combine; in backward the partial gradients of the tokens are summed
(:func:`~shardkit.distributed.all_reduce.copy_to_region`). Each weight records both
splits in one shard descriptor (``TensorView.of_splits``: dim 0 over ``ep``, the hidden
dimension over ``tp``), so the universal checkpoint loads it at any ``(ep, tp)``.
Bytes per MoE layer and forward added by ``tp``: one all-reduce of the rank's received
tokens' outputs, ``N_recv x M x dtype bytes`` (and the same in backward, for the
tokens' gradient).

[Note: expert gradients are means over the ep group]
Expert ``e`` on a rank processes the tokens of every rank of its expert-parallel group,
so its backward accumulates the gradients of ``ep`` ranks' losses. The forward scales
the gradient reaching ``w1`` and ``w2`` by ``1 / ep`` (the values are untouched), so a
rank's expert gradient is the *mean* over the ep group's losses, on the same footing as
a dense gradient (one rank's loss). Averaging it over the expert-data-parallel group
(``edp``: ``dp / ep`` ranks) then gives exactly DDP's mean over all ``dp`` ranks, with
any averaging reducer: :func:`~shardkit.nn.moe.all_reduce_expert_gradients`, or an
FSDP unit over the ``edp`` group.

[Note: initialisation]
As the tensor-parallel layers do: every rank draws the *global* ``(E, d_in, d_out)``
weights from the same generator state and keeps its slice, so with one seed the experts
of all ranks together are exactly the single-process layer's (the master weight is
transient: one global weight of memory during construction).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardkit.distributed.all_reduce import copy_to_region, reduce_from_region
from shardkit.distributed.shard_descriptor import Split, TensorView, ranks_of, set_view

__all__ = ["GroupedExperts", "expert_parallel_rank_and_size"]


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; the gradient times ``scale`` in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def expert_parallel_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This rank's index in the expert-parallel ``group`` and its size; ``(0, 1)`` when
    ``group`` is None (no expert parallelism)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class GroupedExperts(nn.Module):
    """``num_experts`` two-layer feed-forward networks, this rank's slice of them held.

    Args:
        num_experts: the experts ``E`` of all ranks together.
        dim: the token size ``M`` (input and output features).
        hidden_dim: each expert's hidden size ``F``.
        activation: the nonlinearity between the projections. Default
            ``torch.nn.functional.gelu``.
        group: the expert-parallel process group; None (default): every expert here.
        tp_group: the tensor-parallel process group each expert is split over (see
            ``[Note: tensor parallel inside each expert]``); None (default): whole
            experts.

    Attributes:
        w1: ``(E / ep, M, F / tp)``, this rank's part of the global ``(E, M, F)``.
        w2: ``(E / ep, F / tp, M)``, this rank's part of the global ``(E, F, M)``.
        first_expert: the global index of local expert 0, ``ep_rank * E / ep``.
        grad_scale: ``1 / ep``, applied to the experts' gradients in backward (see
            ``[Note: expert gradients are means over the ep group]``).
        last_all_reduce_bytes: the bytes the last forward handed to the all-reduce over
            ``tp`` (``N x M x dtype bytes`` for ``N`` tokens; 0 without ``tp``).

    Raises:
        ValueError: ``num_experts`` is not a multiple of the ep group's size, or
            ``hidden_dim`` not a multiple of the tp group's size.
    """

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden_dim: int,
        activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu,
        group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        ep_rank, ep = expert_parallel_rank_and_size(group)
        tp_rank, tp = expert_parallel_rank_and_size(tp_group)
        if num_experts % ep != 0:
            raise ValueError(
                f"num_experts ({num_experts}) must be a multiple of the expert-parallel "
                f"size ({ep}); choose ep among the divisors of {num_experts}"
            )
        if hidden_dim % tp != 0:
            raise ValueError(
                f"hidden_dim ({hidden_dim}) must be a multiple of the tensor-parallel size "
                f"({tp}) to split each expert over tp; choose tp among the divisors of "
                f"{hidden_dim}"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep
        self.first_expert = ep_rank * self.num_local_experts
        self.grad_scale = 1.0 / ep
        self.activation = activation
        self.tp_group = tp_group if tp > 1 else None
        self.tp_size = tp
        self.last_all_reduce_bytes = 0
        ep_split = Split(0, ep_rank, ep, group=_ranks(group), mesh_dim="ep")
        tp_splits = [Split(d, tp_rank, tp, group=_ranks(tp_group), mesh_dim="tp") for d in (2, 1)]
        self.w1 = self._slice_of((num_experts, dim, hidden_dim), dim, (ep_split, tp_splits[0]))
        self.w2 = self._slice_of(
            (num_experts, hidden_dim, dim), hidden_dim, (ep_split, tp_splits[1])
        )
        for p in (self.w1, self.w2):
            p.expert = True  # type: ignore[attr-defined]

    @staticmethod
    def _slice_of(
        shape: tuple[int, int, int], fan_in: int, splits: tuple[Split, Split]
    ) -> nn.Parameter:
        """This rank's part of a global weight drawn whole (see ``[Note: initialisation]``)."""
        bound = fan_in**-0.5
        local = torch.empty(shape).uniform_(-bound, bound)
        for s in splits:
            local = local.chunk(s.parts, dim=s.dim)[s.part]
        param = nn.Parameter(local.clone())
        kept = tuple(s for s in splits if s.parts > 1)
        if kept:
            set_view(param, TensorView.of_splits(shape, kept))
        return param

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Tokens ``(N, M)`` sorted by local expert, ``counts[j]`` of them for local
        expert ``j`` (``sum(counts) = N``). Returns ``(N, M)`` in the same order."""
        w1, w2 = self.w1, self.w2
        if self.grad_scale != 1.0:  # see [Note: expert gradients are means over the ep group]
            w1, w2 = _ScaleGrad.apply(w1, self.grad_scale), _ScaleGrad.apply(w2, self.grad_scale)
        if self.tp_group is not None:  # see [Note: tensor parallel inside each expert]
            tokens = copy_to_region(tokens, self.tp_group)
        outputs = []
        for j, part in enumerate(tokens.split(counts)):
            outputs.append(self.activation(part @ w1[j]) @ w2[j])
        if not outputs:
            return tokens.new_zeros(tokens.shape)
        out = torch.cat(outputs)
        if self.tp_group is None:
            return out
        self.last_all_reduce_bytes = out.numel() * out.element_size()
        return reduce_from_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1} "
            f"of {self.num_experts}, w1 {tuple(self.w1.shape)}, w2 {tuple(self.w2.shape)}"
            + (f", tp {self.tp_size}" if self.tp_size > 1 else "")
        )


def _ranks(group: dist.ProcessGroup | None) -> tuple[int, ...] | None:
    return ranks_of(group) if group is not None else None
