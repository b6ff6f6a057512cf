"""Ulysses: attention over a sequence split across ranks, by two all-to-alls.

DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention``, same constructor, call
and tensor layout, so a DeepSpeed-Ulysses script switches by changing its import
(Jacobs et al. 2023, "DeepSpeed Ulysses", section 3.1)::

    q, k, v on each rank: (s/P, b, h, d)      the rank's contiguous sequence slice
        | all-to-all (scatter heads, gather sequence), one per q, k, v
    (s, b, h/P, d)                            the whole sequence, a slice of the heads
        | local_attention(q, k, v, *args, **kwargs)  (any attention: causal, masks, ...)
    (s, b, h/P, d)
        | all-to-all back (scatter sequence, gather heads)
    (s/P, b, h, d)

Per layer and rank that is four all-to-alls, each sending ``(P - 1)/P`` of its input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.nn.context_parallel.sequence_all_to_all import sequence_all_to_all

__all__ = ["DistributedAttention"]


class DistributedAttention(nn.Module):
    """Attention over a sequence split across the ranks of ``sequence_process_group``.

    Example:
        >>> def sdpa(q, k, v):   # (s, b, h, d) -> SDPA's (b, h, s, d) and back
        ...     f = torch.nn.functional.scaled_dot_product_attention
        ...     return f(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True
        ...              ).permute(2, 0, 1, 3)
        >>> attn = DistributedAttention(sdpa, mesh.group("cp"))   # doctest: +SKIP
        >>> out = attn(q, k, v)        # (s/P, b, h, d) each   # doctest: +SKIP

    Args:
        local_attention: ``(q, k, v, *args, **kwargs) -> out`` on the whole sequence and
            ``h/P`` heads; ``out`` has ``q``'s layout (any last dimension). A module
            or any callable (it is not registered as a submodule unless it is a module).
        sequence_process_group: the context-parallel group (``mesh.group("cp")``) of
            ``P`` ranks; rank ``r`` of it holds the ``r``-th contiguous sequence slice.
        scatter_idx: the heads dimension of ``q``, ``k``, ``v``. Default 2 (DeepSpeed's
            ``(s, b, h, d)``); 1 for SDPA's ``(b, h, s, d)`` with ``gather_idx=2``.
        gather_idx: the sequence dimension. Default 0.

    Raises:
        ValueError: (at the call) heads not divisible by ``P``; ``q``, ``k``, ``v`` not
            split alike; a local attention whose output's sequence length differs from
            its input's.

    DeepSpeed's ``sp_stream`` (an extra CUDA stream) and its newer ``batch_dim_idx``
    argument are not taken: positional and keyword arguments after ``value`` go to
    ``local_attention`` unchanged.
    """

    def __init__(
        self,
        local_attention: Callable[..., torch.Tensor],
        sequence_process_group: dist.ProcessGroup,
        scatter_idx: int = 2,
        gather_idx: int = 0,
    ) -> None:
        super().__init__()
        if scatter_idx == gather_idx:
            raise ValueError(
                f"scatter_idx and gather_idx are both {scatter_idx}: scatter the heads "
                "dimension and gather the sequence dimension (DeepSpeed: 2 and 0)"
            )
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """Attention of this rank's query slice over the whole sequence.

        Args:
            query: this rank's sequence slice, heads on ``scatter_idx``, sequence on
                ``gather_idx`` (default ``(s/P, b, h, d)``).
            key: the same slice's keys, ``query``'s layout.
            value: the same slice's values, ``query``'s layout.
            *args: passed to ``local_attention`` (e.g. a mask over the whole sequence).
            **kwargs: passed to ``local_attention``.

        Returns:
            This rank's slice of the output, ``query``'s layout and sequence length.
        """
        self._check_heads(query, key, value)
        q, k, v = (
            sequence_all_to_all(t, self.spg, self.scatter_idx, self.gather_idx)
            for t in (query, key, value)
        )
        context = self.local_attn(q, k, v, *args, **kwargs)
        if context.shape[self.gather_idx] != q.shape[self.gather_idx]:
            raise ValueError(
                f"local_attention returned sequence length {context.shape[self.gather_idx]} "
                f"(dimension {self.gather_idx}) for an input of {q.shape[self.gather_idx]}; "
                "Ulysses needs an attention that keeps the sequence length (one output "
                "per query)"
            )
        return sequence_all_to_all(context, self.spg, self.gather_idx, self.scatter_idx)

    def _check_heads(self, *qkv: torch.Tensor) -> None:
        world = dist.get_world_size(self.spg)
        for name, t in zip(("query", "key", "value"), qkv, strict=True):
            heads = t.shape[self.scatter_idx]
            if heads % world != 0:
                raise ValueError(
                    f"{name} has {heads} heads (dimension {self.scatter_idx}), not divisible "
                    f"by the {world} ranks of the sequence group; Ulysses gives each rank "
                    f"heads/{world} heads: use a head count that is a multiple of {world}, "
                    "or ring attention (shardkit.nn.context_parallel.RingAttention)"
                )
        if qkv[1].shape[self.gather_idx] != qkv[0].shape[self.gather_idx]:
            raise ValueError(
                f"key has {qkv[1].shape[self.gather_idx]} positions on dimension "
                f"{self.gather_idx} but query {qkv[0].shape[self.gather_idx]}: q, k and v "
                "must hold the same sequence slice"
            )
