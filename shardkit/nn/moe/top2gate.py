"""FairScale's ``Top2Gate``: GShard's top-2 gating with a capacity of ``2S/E`` tokens.

Lepikhin et al. 2020, GShard, section 2.2 and Algorithm 1 (``Top2Gating``). The
semantics (and the random draws) are FairScale 0.4.13's, so a FairScale script gets
the same ``l_aux``, combine weights and dispatch mask from the same weights and the
same random state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.nn.moe.gate import token_mean

__all__ = ["Top2Gate", "top2gating"]


def _one_hot(index: torch.Tensor, num_classes: int) -> torch.Tensor:
    out = torch.zeros((*index.shape, num_classes), dtype=index.dtype, device=index.device)
    return out.scatter_(-1, index.unsqueeze(-1), 1)


def top2gating(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GShard's top-2 gating of ``S`` tokens over ``E`` experts (Algorithm 1).

    - ``gates = softmax(logits)`` in fp32; expert 1 is the arg-max of ``gates``, expert
      2 the arg-max of ``logits + Gumbel(0, 1)`` noise over the others (GShard's
      random second expert, drawn with ``torch.distributions.Gumbel``).
    - Capacity ``C = 2S / E`` per expert. Positions in an expert's buffer are given in
      token order, first choices before second choices; a choice at position ``>= C``
      is dropped.
    - ``l_aux = mean_e(me_e * ce_e)``: ``me`` the mean gate of expert ``e`` over the
      tokens, ``ce`` the share of tokens whose first choice is ``e`` (before dropping).
      This is Switch's loss divided by ``E^2``; 0 for no tokens (``S = 0``).
    - Combine weights of a token: its two gates divided by their sum over the *kept*
      choices (a token whose second choice is dropped gets weight 1 on the first).

    Args:
        logits: ``(S, E)``; ``S`` a multiple of ``E``.

    Returns:
        ``(l_aux, combine_weights, dispatch_mask)``: a scalar, ``(S, E, C)`` in the
        dtype of ``logits``, and its boolean non-zero mask.

    Raises:
        ValueError: ``S`` is not a multiple of ``E``.
    """
    gates = F.softmax(logits, dim=1, dtype=torch.float)
    num_tokens, num_experts = gates.shape
    if num_tokens % num_experts != 0:
        raise ValueError(
            f"Top2Gate needs the token count to be a multiple of the experts: {num_tokens} "
            f"tokens, {num_experts} experts (capacity 2S/E); pad the batch"
        )
    capacity = 2 * num_tokens // num_experts
    first = torch.argmax(gates, dim=1)
    mask1 = _one_hot(first, num_experts)
    noisy = logits + torch.distributions.Gumbel(
        torch.tensor(0.0, device=logits.device), torch.tensor(1.0, device=logits.device)
    ).rsample(logits.shape)
    second = torch.argmax(noisy.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = _one_hot(second, num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = torch.mean(token_mean(gates) * token_mean(mask1.float()))
    mask1 = mask1 * (locations1 < capacity)
    mask2 = mask2 * (locations2 < capacity)
    gates1 = (gates * mask1).sum(dim=1)
    gates2 = (gates * mask2).sum(dim=1)
    denom = torch.clamp(gates1 + gates2, min=torch.finfo(gates.dtype).eps)
    # combine[s, e, c]: written at each token's two (expert, position) slots (a dropped
    # choice writes its zero weight at position 0); the two experts differ, so no slot
    # is written twice: the values are those of GShard's one-hot products, exactly
    place1 = first * capacity + (locations1 * mask1).sum(dim=1)
    place2 = second * capacity + (locations2 * mask2).sum(dim=1)
    weights = torch.stack([gates1 / denom, gates2 / denom], dim=1)
    combine = gates.new_zeros(num_tokens, num_experts * capacity)
    combine = combine.scatter(1, torch.stack([place1, place2], dim=1), weights)
    combine = combine.view(num_tokens, num_experts, capacity)
    return l_aux.to(logits.dtype), combine.to(logits.dtype), combine.bool()


class Top2Gate(nn.Module):
    """GShard's top-2 gate, FairScale's ``fairscale.nn.moe.Top2Gate``.

    Example:
        >>> gate = Top2Gate(model_dim=16, num_experts=4)
        >>> l_aux, combine_weights, dispatch_mask = gate(torch.randn(8, 16))
        >>> combine_weights.shape          # (S, E, C) with C = 2S/E
        torch.Size([8, 4, 4])

    Args:
        model_dim: the token size ``M`` (input features).
        num_experts: the number of experts ``E`` (all ranks together).

    The gate is one bias-free linear layer ``wg: M -> E``; the gating is
    :func:`top2gating` (GShard 2020, section 2.2, Algorithm 1).
    """

    wg: nn.Linear

    def __init__(self, model_dim: int, num_experts: int) -> None:
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``input``: ``(S, M)``. Returns :func:`top2gating` of ``wg(input)``."""
        return top2gating(self.wg(input))
