"""Express a non-sequential model as the sequence of stages ``OffloadModel`` needs."""

from __future__ import annotations

import torch
from torch import nn

from shardkit.testing.models import GPT

__all__ = ["GPTEmbedding", "GPTHead", "gpt_init_fn", "gpt_stages"]


class GPTEmbedding(nn.Module):
    """Token + position embeddings of a :class:`GPT`: ids ``(B, T)`` -> ``(B, T, C)``."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.block_size = model.config.block_size
        self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class GPTHead(nn.Module):
    """Final LayerNorm and LM head of a :class:`GPT`: ``(B, T, C)`` -> logits ``(B, T, V)``."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def gpt_stages(model: GPT) -> nn.Sequential:
    """The GPT as ``nn.Sequential(embedding, *blocks, head)``, sharing its parameters.

    ``stages(idx)`` equals ``model(idx)[0]`` (the logits). The LM head stays tied to the
    token embedding: the weight is used by the first and the last stage, so
    ``OffloadModel`` keeps it resident in its ``shared`` group (stepped once) instead of
    splitting it across slices. The GPT has ``n_layer + 2`` stages.
    """
    return nn.Sequential(GPTEmbedding(model), *model.blocks, GPTHead(model))


def gpt_init_fn(module: nn.Module) -> None:
    """``param_init_fn`` for GPT stages built on ``meta``: the GPT's own initialisation."""
    for m in module.modules():
        if isinstance(m, nn.LayerNorm):
            m.reset_parameters()
    module.apply(GPT._init_weights)
