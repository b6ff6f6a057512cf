"""FairScale's ``MOELayer``: GShard's mixture of experts over a capacity buffer.

Lepikhin et al. 2020, GShard, Algorithm 2: the gate gives each token's combine weights
over ``(expert, slot)``; tokens are scattered into an ``(E, C, M)`` buffer, the buffer
is exchanged by one all-to-all (expert ``e`` lives on rank ``e // local_experts``), each
rank runs its experts on the slots of every rank, a second all-to-all returns the
outputs and the combine weights sum them per token. The arguments, return values and
``l_aux`` are FairScale 0.4.13's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.all_to_all import all_to_all

__all__ = ["MOELayer"]


class MOELayer(nn.Module):
    """GShard's mixture-of-experts layer, FairScale's ``fairscale.nn.MOELayer``.

    Example:
        >>> gate = Top2Gate(model_dim, num_experts)          # doctest: +SKIP
        >>> moe = MOELayer(gate, experts)
        >>> output = moe(input)                              # (S, T, M) -> (S, T, M)
        >>> loss = task_loss(output) + 0.01 * moe.l_aux

    Args:
        gate: a module mapping ``(S*T, M)`` tokens to ``(l_aux, combine_weights,
            dispatch_mask)`` as :class:`~shardkit.nn.moe.Top2Gate` does.
        experts: this rank's experts: one module, or an ``nn.ModuleList`` of them (each
            maps ``(..., M)`` to ``(..., M)``). Every rank of ``group`` holds the same
            number; global expert ``e`` is local expert ``e % n`` of rank ``e // n``.
        group: the expert-parallel process group the all-to-all runs over. Default
            None: the world group, or this process alone when ``torch.distributed`` is
            not initialised (FairScale requires it initialised).

    Attributes:
        l_aux: the gate's auxiliary loss of the last forward (a scalar tensor): this
            rank's, over its own tokens (0 for none), whatever the other ranks pass.

    Every expert parameter gets the attribute ``expert = True`` (FairScale's marker).
    The all-to-all moves ``E x C x M`` elements each way per forward, whatever the
    routing, ``C`` the largest capacity of the group's ranks (``C = 2S/E`` for
    :class:`~shardkit.nn.moe.Top2Gate`, ``S`` a rank's tokens); before it, one
    all-reduce of one int64 agrees on ``C`` (see ``[Note: unequal token counts]``).

    [Note: dispatch by index]
    FairScale (and GShard's Algorithm 2) dispatch with ``einsum("sec,sm->ecm")`` and
    combine with ``einsum("sec,ecm->sm")``: two products over the whole ``(S, E, C)``
    one-hot tensor, ``2 x S x E x C x M`` multiply-adds each (``4 S^2 M`` with
    ``C = 2S/E``), as many again in backward, almost all of them with zeros. This layer
    reads the ``(token, slot)`` pairs off ``dispatch_mask`` (``nonzero``) and copies the
    rows (``index_add``; a slot given several tokens sums them, as the einsum does), then
    sums each token's kept outputs times its combine weight: ``S x k x M`` each. The
    result equals the einsums' for a gate whose combine weights are zero outside
    ``dispatch_mask`` (FairScale's and GShard's: ``dispatch_mask = combine.bool()``),
    to the order of summing each token's ``k`` terms.

    [Note: unequal token counts]
    The ranks of ``group`` may pass different numbers of tokens (a smaller last batch,
    variable sequence lengths, an empty batch). The gate then gives each rank its own
    capacity (``2S/E`` from its own ``S``), but the equal-split all-to-all needs the same
    buffer size on every rank (gloo aborts on a size mismatch). As in GShard, Tutel and
    DeepSpeed-MoE (whose dropless path all-reduces the largest capacity), the ranks agree
    on ``C_max``, the largest capacity, by one all-reduce (MAX) of one int64 per forward,
    and each pads its buffer to ``(E, C_max, M)``: token ``s`` at ``(e, c)`` goes to row
    ``e x C_max + c``, empty rows stay zero. Routing, dropping and the combine weights
    stay each rank's own (its gate's), so a rank's output, ``l_aux`` and gradients are
    those of the layer run in one process on its tokens alone; the padded rows get no
    combine weight, so they add nothing to the output or to any gradient. With equal
    token counts ``C_max = C`` and the buffer, the exchange and the result are those of
    the unpadded layer, bit for bit. The backward reuses the forward's sizes (no second
    all-reduce). In one process (no group) there is nothing to agree on and no
    collective.
    """

    def __init__(
        self, gate: nn.Module, experts: nn.Module | nn.ModuleList, group: Any | None = None
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts if isinstance(experts, nn.ModuleList) else nn.ModuleList([experts])
        for p in self.experts.parameters():
            p.expert = True  # type: ignore[attr-defined]
        distributed = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None or not distributed else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group) if distributed else 1
        self.num_local_experts = len(self.experts)
        self.l_aux: torch.Tensor | None = None

    def forward(self, *input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``input``: one tensor ``(S, T, M)`` (sequences, tokens, model dim), ``S*T``
        a multiple of the experts; ``S*T`` may differ between the ranks of the group,
        and be 0 (see ``[Note: unequal token counts]``). Returns ``(S, T, M)``; sets
        ``self.l_aux``.

        Raises:
            ValueError: not exactly one input, not 3-dimensional, ``S`` not a
                multiple of the local experts, or the gate's experts not the group's
                size times the local experts.
        """
        if len(input) != 1 or input[0].dim() != 3:
            shapes = [tuple(t.shape) for t in input]
            raise ValueError(
                f"MOELayer takes one (sequence, token, model) tensor; got shapes {shapes}"
            )
        x = input[0]
        if x.shape[0] % self.num_local_experts != 0:
            raise ValueError(
                f"the first dimension ({x.shape[0]}) must be a multiple of the local "
                f"experts ({self.num_local_experts})"
            )
        d_model = x.shape[2]
        tokens = x.reshape(-1, d_model)
        self.l_aux, combine_weights, dispatch_mask = self.gate(tokens)
        num_experts, capacity = dispatch_mask.shape[1], dispatch_mask.shape[2]
        if num_experts != self.world_size * self.num_local_experts:
            raise ValueError(
                f"the gate routes to {num_experts} experts, but the group holds "
                f"{self.world_size} rank(s) x {self.num_local_experts} local expert(s): each "
                "expert would run the tokens of others; give the gate ranks x local experts"
            )
        token, expert, position = dispatch_mask.nonzero(as_tuple=True)
        buffer_capacity = self._agreed_capacity(capacity, tokens.device)
        slot = expert * buffer_capacity + position  # row of the (E x C_max, M) buffer
        rows = tokens.index_select(0, token)
        dispatched = tokens.new_zeros(num_experts * buffer_capacity, d_model)
        dispatched = dispatched.index_add(0, slot, rows)
        if self.world_size > 1:
            dispatched = all_to_all(dispatched, self.group)
        dispatched = dispatched.reshape(self.world_size, self.num_local_experts, -1, d_model)
        chunks = dispatched.chunk(self.num_local_experts, dim=1)
        expert_output = torch.cat(
            [expert(c) for c, expert in zip(chunks, self.experts, strict=True)], dim=1
        )
        if self.world_size > 1:
            expert_output = all_to_all(expert_output, self.group)
        expert_output = expert_output.reshape(num_experts * buffer_capacity, d_model)
        slots = combine_weights.reshape(len(tokens), num_experts * capacity)  # 0 tokens too
        weights = slots[token, expert * capacity + position].to(expert_output.dtype)
        outputs = expert_output.index_select(0, slot) * weights.unsqueeze(1)
        combined = expert_output.new_zeros(len(tokens), d_model).index_add(0, token, outputs)
        return combined.reshape(x.shape)

    def _agreed_capacity(self, capacity: int, device: torch.device) -> int:
        """The capacity buffer's slots per expert: the largest ``capacity`` of the group
        (one all-reduce of one integer), or ``capacity`` itself in one process (see
        ``[Note: unequal token counts]``)."""
        if self.world_size == 1:
            return capacity
        agreed = torch.tensor([capacity], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        return int(agreed.item())
