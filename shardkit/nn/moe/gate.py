"""Top-k gating with a capacity factor, the load-balancing loss and the router z-loss.

The router of :class:`~shardkit.nn.moe.MoE` (DeepSpeed's ``TopKGate`` shape, any k).
It decides, for ``T`` tokens and ``E`` experts, which ``k`` experts each token goes to,
which of those choices are kept under the capacity, and the weight each kept choice
gets when the experts' outputs are combined.

[Note: capacity and the order of positions]
With ``drop_tokens`` the capacity of each expert is (Switch 2021, section 2.2, generalised
to k choices as in GShard 2020, section 2.2)::

    C = max(min_capacity, ceil(k * T * capacity_factor / E))

Positions in an expert's buffer are handed out choice by choice, then token by token:
every token's first choice before any second choice (GShard's order, so a token loses its
second expert before another loses its first). A choice at position ``>= C`` is dropped:
the token gets nothing from that expert (the residual connection around the layer carries
it). Dropless (``drop_tokens=False``) keeps every choice; the experts then see variable
token counts.

[Note: the auxiliary-loss-free expert bias]
DeepSeek-V3 (2024, section 2.1.2) balances the experts without a loss term: a bias
``b_e`` per expert is added to the scores for the *choice* of experts only (the
combine weights still come from the unbiased probabilities, so ``b`` gets no gradient
and does not bend the output), and after each training step ``b_e`` moves by ``gamma``
against expert ``e``'s load::

    b_e <- b_e + gamma * sign(mean_e'(load_e') - load_e)

``load_e`` the choices routed to ``e`` (before dropping) since the last update, summed
over the ranks given. The update is a call, not a side effect of the forward: an
activation-checkpointing recompute must route exactly as the first forward did, so the
bias only changes between steps (:meth:`TopKGate.update_expert_bias`, after
``optimizer.step()``). Every rank holding a copy of the gate must pass the same group
(the data-parallel one) so that their biases stay equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["Routing", "TopKGate"]

#: The noise policies (DeepSpeed's names): Switch's multiplicative jitter of the router
#: input, GShard's Gumbel noise on the logits for the choice of experts.
NOISE_POLICIES = (None, "Jitter", "RSample")


@dataclass
class Routing:
    """The gate's decision for ``T`` tokens (``k`` choices each, ``E`` experts).

    Attributes:
        experts: ``(T, k)`` int64, the chosen experts, best first.
        weights: ``(T, k)`` float32, the combine weight of each choice (0 where dropped).
        kept: ``(T, k)`` bool, whether the choice got a place under the capacity.
        aux_loss: scalar, the load-balancing loss (see :class:`TopKGate`).
        z_loss: scalar, the router z-loss.
        counts: ``(E,)`` int64, the kept choices per expert.
        capacity: the capacity per expert, or None (dropless).
    """

    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    counts: torch.Tensor
    capacity: int | None


def token_mean(values: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` ``(T, ...)`` over its tokens (dim 0), 0 for no tokens.

    A rank whose batch routes no token (an empty micro-batch, a sequence chunk of
    length 0) then adds nothing to the auxiliary losses, as its tokens add nothing to
    the task loss, instead of a NaN (torch's mean over zero elements) that would spoil
    the summed loss and the logs; the graph stays connected (the zeros' gradient is
    0). Shapes: ``(T, ...)`` -> ``(...)``.
    """
    return values.mean(dim=0) if values.shape[0] else values.sum(dim=0)


def capacity(tokens: int, num_experts: int, k: int, factor: float, min_capacity: int) -> int:
    """``max(min_capacity, ceil(k * tokens * factor / num_experts))`` (see ``[Note:
    capacity and the order of positions]``)."""
    return max(min_capacity, math.ceil(k * tokens * factor / num_experts))


class TopKGate(nn.Module):
    """Top-k router: a bias-free linear layer ``wg: M -> E`` and the routing rule.

    For token ``t`` with logits ``h_t = wg(x_t)`` and probabilities ``p_t =
    softmax(h_t)`` (fp32):

    - choices: the ``k`` largest ``p_t`` (with ``noisy_gate_policy="RSample"``, the ``k``
      largest ``h_t + Gumbel(0, 1)`` in training; the weights still come from ``p_t``);
    - weights: ``p_t[e]`` of each choice, divided by the sum over the ``k`` choices when
      ``normalize_weights`` (so a token's kept weights sum to 1, or to the share of its
      choices that were kept); dropped choices weigh 0;
    - load-balancing loss (Switch 2021, section 2.2, eq. 4-6; GShard 2020, section 2.2,
      for k = 2): ``aux = E * sum_e f_e * P_e``, ``f_e`` the share of the ``T * k``
      choices that went to expert ``e`` (before dropping), ``P_e`` the mean of ``p[:, e]``
      over the tokens. It is 1 for a perfectly balanced router;
    - router z-loss (Zoph et al. 2022, ST-MoE, section 3, eq. 5):
      ``z = mean_t (logsumexp(h_t))^2``; both losses are 0 for ``T = 0`` (a rank
      routing no token: see :func:`token_mean`);
    - with ``bias_update_speed > 0``: the choices are the ``k`` largest of the scores
      above plus ``expert_bias`` (DeepSeek-V3's auxiliary-loss-free balancing; see
      ``[Note: the auxiliary-loss-free expert bias]``); weights and losses unchanged.

    Args:
        model_dim: the token size ``M``.
        num_experts: the number of experts ``E`` (all ranks together).
        k: choices per token, ``1 <= k <= E``. Default 1 (Switch).
        capacity_factor: the capacity factor in training. Default 1.0.
        eval_capacity_factor: the capacity factor in eval mode. Default 1.0.
        min_capacity: the least capacity per expert, in tokens. Default 4.
        drop_tokens: default True: drop choices beyond the capacity. False: dropless.
        noisy_gate_policy: None (default), ``"Jitter"`` (training input multiplied by
            ``U(1 - 1e-2, 1 + 1e-2)``, Switch 2021, section 2.4) or ``"RSample"``.
        normalize_weights: divide the weights by their sum over the k choices. Default
            None: True for k > 1, False for k = 1 (Switch keeps ``p_t[e]``, which is
            what trains the router).
        bias_update_speed: ``gamma`` of DeepSeek-V3's expert bias, in units of the
            scores (probabilities; logits with ``"RSample"``) per update. Default 0.0:
            no bias (no ``expert_bias`` buffer; DeepSeek-V3 used 1e-3).

    Attributes:
        expert_bias: ``(E,)`` float32 buffer (in the state dict), the selection bias;
            None when ``bias_update_speed`` is 0.
        expert_load: ``(E,)`` float64 buffer (not in the state dict), the choices per
            expert routed in training since the last :meth:`update_expert_bias`.

    Raises:
        ValueError: ``k`` outside ``[1, E]``, a capacity factor ``<= 0``, a negative
            ``min_capacity``, an unknown noise policy or a negative
            ``bias_update_speed``.
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        drop_tokens: bool = True,
        noisy_gate_policy: str | None = None,
        normalize_weights: bool | None = None,
        bias_update_speed: float = 0.0,
    ) -> None:
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"k must be in [1, num_experts={num_experts}]; got k={k}")
        for name, value in (
            ("capacity_factor", capacity_factor),
            ("eval_capacity_factor", eval_capacity_factor),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0; got {value} (use drop_tokens=False)")
        if min_capacity < 0:
            raise ValueError(f"min_capacity must be >= 0; got {min_capacity}")
        if not bias_update_speed >= 0:
            raise ValueError(
                f"bias_update_speed must be >= 0 (0: no expert bias); got {bias_update_speed}"
            )
        if noisy_gate_policy not in NOISE_POLICIES:
            raise ValueError(
                f"noisy_gate_policy must be one of {NOISE_POLICIES}; got {noisy_gate_policy!r}"
            )
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.drop_tokens = drop_tokens
        self.noisy_gate_policy = noisy_gate_policy
        self.normalize_weights = k > 1 if normalize_weights is None else normalize_weights
        self.bias_update_speed = bias_update_speed
        self.expert_bias: torch.Tensor | None
        self.expert_load: torch.Tensor | None
        biased = bias_update_speed > 0
        self.register_buffer("expert_bias", torch.zeros(num_experts) if biased else None)
        load = torch.zeros(num_experts, dtype=torch.float64) if biased else None
        self.register_buffer("expert_load", load, persistent=False)

    def forward(self, tokens: torch.Tensor) -> Routing:
        """Route ``tokens`` ``(T, M)``; see the class docstring for the rules."""
        if self.training and self.noisy_gate_policy == "Jitter":
            tokens = tokens * torch.empty_like(tokens).uniform_(1.0 - 1e-2, 1.0 + 1e-2)
        logits = self.wg(tokens)
        return self.route(logits)

    def route(self, logits: torch.Tensor) -> Routing:
        """The routing of ``logits`` ``(T, E)``: choices, kept mask, weights, losses."""
        num_tokens = logits.shape[0]
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        scores = probs
        if self.training and self.noisy_gate_policy == "RSample":
            gumbel = -torch.log(-torch.log(torch.rand_like(probs).clamp_min(1e-20)))
            scores = logits.float() + gumbel
        if self.expert_bias is not None:  # selection only: see [Note: the auxiliary-loss-free ...]
            scores = scores + self.expert_bias
        experts = scores.topk(self.k, dim=-1).indices
        chosen = probs.gather(1, experts)
        if self.normalize_weights:
            chosen = chosen / chosen.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        # positions: choice-major, then token order (see [Note: capacity ...])
        one_hot = F.one_hot(experts.t().reshape(-1), self.num_experts)
        position = ((one_hot.cumsum(dim=0) - 1) * one_hot).sum(dim=1).reshape(self.k, -1).t()
        cap: int | None = None
        kept = torch.ones_like(experts, dtype=torch.bool)
        if self.drop_tokens:
            factor = self.capacity_factor if self.training else self.eval_capacity_factor
            cap = capacity(num_tokens, self.num_experts, self.k, factor, self.min_capacity)
            kept = position < cap
        weights = chosen * kept
        share = one_hot.sum(dim=0).float() / max(1, num_tokens * self.k)
        aux = self.num_experts * (share * token_mean(probs)).sum()
        z = token_mean(torch.logsumexp(logits.float(), dim=-1).square())
        counts = torch.bincount(experts[kept], minlength=self.num_experts)
        if self.expert_load is not None and self.training:
            self.expert_load += one_hot.sum(dim=0).to(self.expert_load.dtype)
        return Routing(experts, weights, kept, aux, z, counts, cap)

    @torch.no_grad()
    def update_expert_bias(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """DeepSeek-V3's bias update (2024, section 2.1.2): ``expert_bias += gamma *
        sign(mean(load) - load)``, ``load`` the choices routed in training since the last
        update (``expert_load``) summed over ``group``; then ``expert_load`` restarts at
        0. Call after each ``optimizer.step()`` (see ``[Note: the auxiliary-loss-free
        expert bias]``).

        Args:
            group: the ranks holding copies of this gate (``mesh.group("dp")``); their
                loads are summed (an all-reduce) so every copy takes the same step.
                Default None: this rank's load alone, no collective.

        Returns:
            ``(E,)`` the load used (float64).

        Raises:
            RuntimeError: the gate was built with ``bias_update_speed=0`` (no bias).
        """
        if self.expert_bias is None or self.expert_load is None:
            raise RuntimeError(
                "update_expert_bias: this gate has no expert bias (bias_update_speed=0); "
                "build it with bias_update_speed > 0 (DeepSeek-V3 used 1e-3)"
            )
        load = self.expert_load.clone()
        if group is not None:
            dist.all_reduce(load, group=group)
        step = torch.sign(load.mean() - load) * self.bias_update_speed
        self.expert_bias += step.to(self.expert_bias.dtype)
        self.expert_load.zero_()
        return load
