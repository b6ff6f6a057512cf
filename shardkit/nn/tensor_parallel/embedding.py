"""Embeddings split across tensor-parallel ranks: by vocabulary, or by embedding dimension.

- :class:`VocabParallelEmbedding` (Shoeybi et al. 2019, section 3, "input embedding"):
  rank i holds the rows of token ids ``[i V/T, (i+1) V/T)``; each rank looks up the ids
  in its range (zeros elsewhere) and one all-reduce sums the T partial lookups. Its
  weight has the same split as a column-parallel output projection over the vocabulary,
  so a tied LM head shares it.
- :class:`ParallelEmbedding` (FairScale): rank i holds columns ``[i C/T, (i+1) C/T)`` of
  every row; the lookups are all-gathered along the last dimension.

Both initialise the full master weight with ``init_method`` and keep their shard (see
``[Note: init_method semantics]`` in :mod:`shardkit.nn.tensor_parallel.linear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.nn.tensor_parallel.groups import TPGroup, rank_and_size, resolve_group
from shardkit.nn.tensor_parallel.linear import InitMethod, _master_shard
from shardkit.nn.tensor_parallel.mappings import (
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
)
from shardkit.nn.tensor_parallel.partition import divide

__all__ = ["ParallelEmbedding", "VocabParallelEmbedding"]


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split across tensor-parallel ranks.

    Args:
        num_embeddings: vocabulary size V (all ranks together); divisible by ``tp``.
        embedding_dim: width C.
        padding_idx: as ``torch.nn.Embedding``, a global token id: its row is
            zero-initialised on the rank that holds it and gets no gradient. Default None.
        max_norm: as ``torch.nn.Embedding``. Default None.
        norm_type: as ``torch.nn.Embedding``. Default 2.0.
        scale_grad_by_freq: as ``torch.nn.Embedding``. Default False.
        sparse: as ``torch.nn.Embedding``. Default False.
        init_method: initialises the full master weight ``(V, C)`` in place. Default
            ``torch.nn.init.xavier_normal_`` (as FairScale).
        process_group: the tensor-parallel group; default None (the mesh's).
        dtype: of the local shard; default None (torch's default dtype).
        device: of the local shard; default None (CPU).

    Shapes: ids ``(*)`` int64 -> ``(*, C)``, the same on every rank. ``weight``
    ``(V / tp, C)``, marked tensor-parallel along dim 0.

    Attributes:
        vocab_start_index, vocab_end_index: this rank's ids ``[start, end)``.

    Raises:
        ValueError: V not divisible by ``tp`` (sizes named).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        init_method: InitMethod = nn.init.xavier_normal_,
        *,
        process_group: TPGroup = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.process_group = resolve_group(process_group)
        rank, world = rank_and_size(self.process_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_rank = divide(num_embeddings, world, f"vocabulary size {num_embeddings}")
        self.vocab_start_index, self.vocab_end_index = rank * per_rank, (rank + 1) * per_rank
        self.padding_idx = padding_idx
        self.max_norm, self.norm_type = max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse

        def init(w: torch.Tensor) -> None:
            init_method(w)
            if padding_idx is not None:
                w[padding_idx].zero_()

        self.weight, _ = _master_shard(
            (num_embeddings, embedding_dim), init, 0, self.process_group, 1, dtype, device
        )

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, *, process_group: TPGroup = None
    ) -> VocabParallelEmbedding:
        """The vocabulary-parallel version of ``embedding`` (the same on every rank)."""
        return cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            padding_idx=embedding.padding_idx,
            max_norm=embedding.max_norm,
            norm_type=embedding.norm_type,
            scale_grad_by_freq=embedding.scale_grad_by_freq,
            sparse=embedding.sparse,
            init_method=lambda w: w.copy_(embedding.weight.detach()),
            process_group=process_group,
            dtype=embedding.weight.dtype,
            device=embedding.weight.device,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local = (ids - self.vocab_start_index).masked_fill(outside, 0)
        pad = self.padding_idx
        local_pad = (
            pad - self.vocab_start_index
            if pad is not None and self.vocab_start_index <= pad < self.vocab_end_index
            else None
        )
        out = F.embedding(
            local,
            self.weight,
            local_pad,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(out, self.process_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, "
            f"vocab=[{self.vocab_start_index}, {self.vocab_end_index})"
        )


class ParallelEmbedding(nn.Module):
    """An embedding whose columns (the embedding dimension) are split across ranks.

    Args:
        num_embeddings: vocabulary size V.
        embedding_dim: width C (all ranks together); divisible by ``tp``.
        padding_idx: as ``torch.nn.Embedding``. Default None.
        max_norm: as ``torch.nn.Embedding`` (of each row's shard). Default None.
        norm_type: as ``torch.nn.Embedding``. Default 2.0.
        scale_grad_by_freq: as ``torch.nn.Embedding``. Default False.
        sparse: as ``torch.nn.Embedding``. Default False.
        init_method: initialises the full master weight ``(V, C)`` in place. Default
            ``torch.nn.init.xavier_normal_`` (as FairScale).
        keep_master_weight_for_test: keep the master weight as ``self.master_weight``.
        process_group: the tensor-parallel group; default None (the mesh's).
        dtype: of the local shard; default None (torch's default dtype).
        device: of the local shard; default None (CPU).

    Shapes: ids ``(*)`` -> ``(*, C)`` (all-gathered). ``weight`` ``(V, C / tp)``, marked
    tensor-parallel along dim 1.

    Raises:
        ValueError: C not divisible by ``tp`` (sizes named).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        init_method: InitMethod = nn.init.xavier_normal_,
        keep_master_weight_for_test: bool = False,
        *,
        process_group: TPGroup = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.process_group = resolve_group(process_group)
        world = rank_and_size(self.process_group)[1]
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.embedding_dim_per_partition = divide(
            embedding_dim, world, f"ParallelEmbedding embedding_dim {embedding_dim}"
        )
        self.padding_idx = padding_idx
        self.max_norm, self.norm_type = max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        self.weight, master = _master_shard(
            (num_embeddings, embedding_dim), init_method, 1, self.process_group, 1, dtype, device
        )
        if keep_master_weight_for_test:
            self.master_weight = master

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(
            ids,
            self.weight,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )
        return gather_from_tensor_parallel_region(out, self.process_group)
