"""A small GPT-2-style decoder: the model of the main job, its benchmarks and many tests.

Token + position embeddings, pre-LayerNorm blocks (causal self-attention through
``torch.nn.functional.scaled_dot_product_attention``, then a GELU MLP), a final
LayerNorm and an LM head tied to the token embedding (Radford et al. 2019, GPT-2).
The blocks live in ``GPT.blocks`` (an ``nn.ModuleList`` of :class:`Block`), which is
what wrapping policies key on. :func:`gpt_stages` expresses the same model as an
``nn.Sequential`` (embedding, blocks, head) for the wrappers that need a sequence
(``Pipe``, ``OffloadModel``).

Shapes: input ``idx`` is ``(batch, seq_len)`` int64 token ids; logits are
``(batch, seq_len, vocab_size)``; the loss is the mean next-token cross entropy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "MODEL_SIZES",
    "AttentionCore",
    "Block",
    "GPTConfig",
    "GPTEmbedding",
    "GPTHead",
    "gpt_config",
    "gpt_init_fn",
    "gpt_stages",
    "gpt_unit_init_fn",
]


@dataclass(frozen=True)
class GPTConfig:
    """GPT hyperparameters.

    Attributes:
        vocab_size: number of token ids (256 for a byte-level model).
        block_size: longest sequence the position embedding covers, in tokens.
        n_layer: transformer blocks.
        n_head: attention heads (must divide ``n_embd``).
        n_embd: model width.
        dropout: dropout probability (0.0 keeps runs deterministic).
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


# Byte-level sizes used by the main job (parameter counts at vocab 256, block 256):
# tiny 0.86M, small 10.8M, medium 99.3M.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 4, "n_head": 4, "n_embd": 128},
    "small": {"n_layer": 6, "n_head": 6, "n_embd": 384},
    "medium": {"n_layer": 12, "n_head": 12, "n_embd": 828},
}


def gpt_config(size: str, *, vocab_size: int = 256, block_size: int = 256) -> GPTConfig:
    """The :class:`GPTConfig` of a named size (``tiny``, ``small`` or ``medium``).

    Raises:
        ValueError: for an unknown size, listing the known ones.
    """
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(MODEL_SIZES)}")
    return GPTConfig(vocab_size=vocab_size, block_size=block_size, **MODEL_SIZES[size])


#: A replacement for the causal softmax attention of :class:`CausalSelfAttention`:
#: ``(q, k, v) -> y``, each ``(B, n_head, T, head_dim)``, causal over the sequence the
#: callable knows (e.g. context parallelism's, ``shardkit.nn.context_parallel``).
AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``(B, T, C) -> (B, T, C)``.

    ``core`` (default None: ``scaled_dot_product_attention``, causal, with the config's
    dropout) replaces the attention between the projections; it is not a submodule
    and holds no state (the state dict is the same either way). A core applies no
    attention dropout.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout
        self.core: AttentionCore | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Sizes come from the projection's output, not from x: under tensor parallelism
        # qkv holds this rank's n_head heads only, and under sequence parallelism x is
        # this rank's chunk of the sequence, qkv all of it (tensor_parallel.gpt_plan).
        qkv = self.qkv(x)
        b, t, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=2)
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
        if self.core is not None:
            y = self.core(q, k, v)
        else:
            drop = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, -1))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-style decoder with the LM head tied to the token embedding.

    Example:
        >>> model = GPT(GPTConfig())
        >>> idx = torch.randint(0, 256, (2, 16))
        >>> logits, loss = model(idx, targets=idx)
        >>> logits.shape
        torch.Size([2, 16, 256])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied (Press & Wolf 2017)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        """Number of unique parameter elements (the tied weight counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(B, T, vocab)`` and, with ``targets`` ``(B, T)``, the mean loss.

        ``position_ids`` ``(T,)`` int64: the positions of the ``T`` tokens (a part of a
        longer sequence, as context parallelism gives each rank); default None:
        ``0 .. T-1``.

        Raises:
            ValueError: if ``T`` exceeds ``config.block_size``, or ``position_ids`` is
                not ``(T,)``.
        """
        _, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        if position_ids is None:
            pos = torch.arange(t, device=idx.device)
        elif position_ids.shape != (t,):
            raise ValueError(
                f"position_ids has shape {tuple(position_ids.shape)}; the {t} tokens need ({t},)"
            )
        else:
            pos = position_ids
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


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
    ``shardkit.nn.OffloadModel`` keeps it resident in its ``shared`` group (stepped once) instead of
    splitting it across slices. The GPT has ``n_layer + 2`` stages.
    """
    return nn.Sequential(GPTEmbedding(model), *model.blocks, GPTHead(model))


def gpt_unit_init_fn(module: nn.Module) -> None:
    """FSDP ``param_init_fn`` for a GPT built on ``meta``: materialise ``module``'s own
    tensors on the CPU (``recurse=False``) and give them the GPT's initialisation.

    Not recursive on purpose: FSDP calls it once per module, and nested units' modules
    hold sharded parameters by then (a recursive init would overwrite their shards).
    """
    module.to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        GPT._init_weights(module)


def gpt_init_fn(module: nn.Module) -> None:
    """``param_init_fn`` for GPT stages built on ``meta``: the GPT's own initialisation."""
    for m in module.modules():
        if isinstance(m, nn.LayerNorm):
            m.reset_parameters()
    module.apply(GPT._init_weights)
