"""Plain references written from the papers, one token at a time (no vectorised routing).

- :func:`gshard_top2`: GShard 2020, Algorithm 1 (``Top2Gating``), FairScale's variant:
  capacity ``2S/E``, first choices placed before second choices, the second expert
  drawn with Gumbel noise on the logits.
- :func:`topk_route` and :func:`moe_reference`: the general rule of
  ``shardkit.nn.moe.gate`` (k choices, capacity ``max(min_capacity, ceil(k T cf / E))``,
  positions choice-major then token order), and the layer output
  ``y_t = sum over kept choices of w_tj * expert_e(x_t)`` (+ shared experts).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shardkit.nn.moe import MoE


def gshard_top2(
    logits: torch.Tensor, noise: torch.Tensor
) -> tuple[float, dict[tuple[int, int], tuple[int, float]]]:
    """``(l_aux, {(token, expert): (slot, weight)})`` for ``(S, E)`` logits."""
    probs = F.softmax(logits.double(), dim=1)
    s, e = probs.shape
    cap = 2 * s // e
    first = [int(probs[t].argmax()) for t in range(s)]
    second = []
    for t in range(s):
        noisy = (logits[t].double() + noise[t].double()).tolist()
        noisy[first[t]] = -math.inf
        second.append(max(range(e), key=lambda i: noisy[i]))
    fill = [0] * e
    slots: dict[tuple[int, int], int] = {}
    for choices in (first, second):
        for t in range(s):
            ex = choices[t]
            if fill[ex] < cap:
                slots[(t, ex)] = fill[ex]
            fill[ex] += 1
    out = {}
    for t in range(s):
        kept = [ex for ex in (first[t], second[t]) if (t, ex) in slots]
        total = sum(float(probs[t, ex]) for ex in kept)
        for ex in kept:
            out[(t, ex)] = (slots[(t, ex)], float(probs[t, ex]) / total)
    me = probs.mean(dim=0)
    ce = torch.tensor([first.count(i) / s for i in range(e)], dtype=torch.float64)
    return float((me * ce).mean()), out


def topk_route(
    probs: torch.Tensor, k: int, cap: int | None, normalize: bool
) -> list[list[tuple[int, float, bool]]]:
    """Per token, per choice: ``(expert, weight, kept)``."""
    t_count, e = probs.shape
    chosen = [sorted(range(e), key=lambda i: -float(probs[t, i]))[:k] for t in range(t_count)]
    fill = [0] * e
    kept = [[False] * k for _ in range(t_count)]
    for j in range(k):
        for t in range(t_count):
            ex = chosen[t][j]
            kept[t][j] = cap is None or fill[ex] < cap
            fill[ex] += 1
    out = []
    for t in range(t_count):
        total = sum(float(probs[t, ex]) for ex in chosen[t]) if normalize else 1.0
        out.append(
            [
                (ex, float(probs[t, ex]) / total if kept[t][j] else 0.0, kept[t][j])
                for j, ex in enumerate(chosen[t])
            ]
        )
    return out


def moe_reference(moe: MoE, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The output of ``moe`` (its gate, its shared experts) with the *global* expert
    weights ``w1`` ``(E, M, F)`` and ``w2`` ``(E, F, M)``, token by token."""
    gate = moe.gate
    tokens = x.reshape(-1, x.shape[-1])
    probs = F.softmax(gate.wg(tokens).float(), dim=-1)
    cap = None
    if gate.drop_tokens:
        factor = gate.capacity_factor if gate.training else gate.eval_capacity_factor
        cap = max(gate.min_capacity, math.ceil(gate.k * len(tokens) * factor / gate.num_experts))
    rows = []
    for t, choices in enumerate(topk_route(probs.detach(), gate.k, cap, gate.normalize_weights)):
        total = probs[t, [ex for ex, _, _ in choices]].sum() if gate.normalize_weights else 1.0
        y = torch.zeros_like(tokens[t])
        for ex, _, kept in choices:
            if kept:
                h = moe.experts.activation(tokens[t] @ w1[ex]) @ w2[ex]
                y = y + probs[t, ex] / total * h
        rows.append(y)
    out = torch.stack(rows)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(tokens)
    return out.reshape(x.shape)
