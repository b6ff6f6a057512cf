"""PowerSGD: rank-r low-rank compression with warm start and error feedback."""

from __future__ import annotations

import math
import zlib
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardkit.distributed.compression.interface import Shapes, _ReduceByAllReduce

__all__ = ["PowerSGDCompressor", "powersgd_elements"]


@dataclass
class _Piece:
    """One piece of the flat tensor: a matrix (compressed) or a vector (as it is)."""

    start: int
    numel: int
    rows: int = 0  # > 0: a matrix rows x cols compressed at rank `rank`
    cols: int = 0
    rank: int = 0


def _pieces(numel: int, shapes: Shapes, rank: int, min_rate: float) -> list[_Piece]:
    """Split the flat tensor into matrices and vectors (see :class:`PowerSGDCompressor`)."""

    def piece(start: int, size: int, rows: int, cols: int) -> _Piece:
        r = min(rank, rows, cols)
        if rows > 0 and cols > 0 and r * (rows + cols) * min_rate < rows * cols:
            return _Piece(start, size, rows, cols, r)
        return _Piece(start, size)

    if shapes is None:  # the flat tensor as one near-square matrix, zero padded
        rows = math.isqrt(numel)
        rows = rows if rows * rows == numel else rows + 1
        return [piece(0, numel, rows, math.ceil(numel / rows) if rows else 0)]
    out: list[_Piece] = []
    start = 0
    for shape in shapes:
        size = math.prod(shape)
        if len(shape) >= 2:
            out.append(piece(start, size, int(shape[0]), math.prod(shape[1:])))
        else:
            out.append(_Piece(start, size))
        start += size
    return out


def powersgd_elements(shapes: Iterable[Sequence[int]], rank: int, min_rate: float = 1.0) -> int:
    """Elements PowerSGD all-reduces for a flat tensor made of pieces of ``shapes``.

    ``r (m + n)`` per compressed m x n matrix (``r = min(rank, m, n)``; a piece of
    shape ``(m, d2, d3, ...)`` is the matrix ``m x (d2 d3 ...)``; it is compressed when
    ``r (m + n) min_rate < m n``), the number of elements of every other piece.
    Multiply by 4 for fp32 bytes.
    """
    shapes = list(shapes)
    numel = sum(math.prod(s) for s in shapes)
    total = 0
    for piece in _pieces(numel, shapes, rank, min_rate):
        total += piece.rank * (piece.rows + piece.cols) if piece.rows else piece.numel
    return total


@dataclass
class _PowerState:
    qs: list[torch.Tensor] = field(default_factory=list)


class PowerSGDCompressor(_ReduceByAllReduce):
    """Rank-r PowerSGD with error feedback (Vogels et al. 2019, Algorithms 1 and 2).

    Each piece of 2 or more dimensions of the flat tensor (given by ``shapes``) is a
    matrix M, ``m x n`` (``n`` = the product of the other dimensions); with
    ``r = min(rank, m, n)``, if ``r (m + n) min_compression_rate < m n`` it is sent as
    two factors, else as it is. With error feedback, M = gradient + residual. One
    step (the same on every rank):

    1. ``P = M Q`` (m x r); all-reduce every P together with the vectors (summed,
       exact) in one flat fp32 all-reduce;
    2. orthonormalise P's columns (reduced QR: the same on every rank, as P is);
    3. ``Q = M^T P`` (n x r); residual ``M - P Q^T`` (this rank's part that P's span
       misses); all-reduce every Q in one flat fp32 all-reduce;
    4. the sum is ``P Q^T``, written back into the tensor; the summed Q is kept for
       the next call with this key (warm start: one power-iteration step per call).

    ``r (m + n)`` fp32 elements per compressed matrix instead of ``m n``; 1-D pieces
    (biases, norms) are sent uncompressed (exact). Without ``shapes`` the whole tensor
    is one matrix, ``ceil(sqrt(n))`` rows, zero padded (torch's batched PowerSGD).
    Q starts as a standard normal matrix drawn from a generator seeded by ``seed``,
    the key and the piece's index, so every rank draws the same one.

    The sum of the ranks' approximations equals the approximation of the summed
    gradients (``P P^T sum M``), so the result is the same on every rank.

    ``reduce`` and ``reduce_scatter`` run this all-reduce too (on a copy of the
    input for ``reduce_scatter``; every rank then holds the full result and keeps its
    part): there is no compressed reduce in the paper, and the compressed all-reduce
    sends ``2 r (m + n) (N - 1) / N`` against an exact reduce-scatter's
    ``m n (N - 1) / N``.

    Args:
        rank: the rank r of the approximation; default 1.
        error_feedback: keep the residual per key; default True.
        min_compression_rate: compress a matrix only when it shrinks by more than
            this factor; default 1.0 (torch's hook uses 2).
        seed: seeds Q's first value; default 0.

    Raises:
        ValueError: ``rank`` < 1 or ``min_compression_rate`` < 1.
    """

    name = "powersgd"
    exact = False

    def __init__(
        self,
        rank: int = 1,
        error_feedback: bool = True,
        min_compression_rate: float = 1.0,
        seed: int = 0,
    ) -> None:
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1; got {rank}")
        if min_compression_rate < 1.0:
            raise ValueError(f"min_compression_rate must be >= 1; got {min_compression_rate}")
        super().__init__(error_feedback=error_feedback)
        self.rank = rank
        self.min_compression_rate = min_compression_rate
        self.seed = seed
        self._power: dict[Hashable, _PowerState] = {}

    def __repr__(self) -> str:
        return (
            f"PowerSGDCompressor(rank={self.rank}, error_feedback={self.error_feedback}, "
            f"min_compression_rate={self.min_compression_rate})"
        )

    def reset(self, key: Hashable = None) -> None:
        super().reset(key)
        if key is None:
            self._power.clear()
        else:
            self._power.pop(key, None)

    def state_bytes(self) -> int:
        qs = sum(q.numel() * q.element_size() for s in self._power.values() for q in s.qs)
        return super().state_bytes() + qs

    def _initial_q(self, key: Hashable, index: int, cols: int, r: int) -> torch.Tensor:
        seed = zlib.crc32(repr((self.seed, key, index)).encode())
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(cols, r, generator=gen)

    def _all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None, key: Hashable, shapes: Shapes
    ) -> None:
        self._need_key(key)
        numel = tensor.numel()
        pieces = _pieces(numel, shapes, self.rank, self.min_compression_rate)
        signature = (numel, tuple(tuple(s) for s in shapes) if shapes is not None else None)
        if key is not None and not self._state_for(key, signature):
            self._power.pop(key, None)
        x = self._with_error(key, tensor.to(torch.float32, copy=True))
        state = self._power.get(key) if key is not None else None
        matrices = [p for p in pieces if p.rows]
        vectors = [p for p in pieces if not p.rows]
        if state is None:
            state = _PowerState(
                [
                    self._initial_q(key, i, p.cols, p.rank).to(tensor.device)
                    for i, p in enumerate(matrices)
                ]
            )
            if key is not None:
                self._power[key] = state

        def as_matrix(p: _Piece) -> torch.Tensor:
            flat = x[p.start : p.start + p.numel]
            if p.numel < p.rows * p.cols:  # the padded single-matrix case
                flat = torch.cat([flat, flat.new_zeros(p.rows * p.cols - p.numel)])
            return flat.view(p.rows, p.cols)

        ms = [as_matrix(p) for p in matrices]
        # 1. vectors and P = M Q, one all-reduce
        first = [x[p.start : p.start + p.numel] for p in vectors]
        ps = [m @ q for m, q in zip(ms, state.qs)]
        flat1 = torch.cat([t.reshape(-1) for t in first + ps]) if first or ps else x[:0]
        dist.all_reduce(flat1, group=group)
        offset = 0
        for p in vectors:
            tensor[p.start : p.start + p.numel].copy_(flat1[offset : offset + p.numel])
            offset += p.numel
        if not matrices:
            self._keep_error(key, torch.zeros_like(x))
            return
        summed_ps = []
        for p in matrices:
            size = p.rows * p.rank
            summed_ps.append(flat1[offset : offset + size].view(p.rows, p.rank))
            offset += size
        # 2. orthonormal P; 3. Q = M^T P, residual, one all-reduce of the Qs
        ortho = [torch.linalg.qr(p_sum, mode="reduced").Q for p_sum in summed_ps]
        qs = [m.t() @ p_o for m, p_o in zip(ms, ortho)]
        if self.error_feedback:
            residual = torch.zeros_like(x)
            for p, m, p_o, q in zip(matrices, ms, ortho, qs):
                miss = (m - p_o @ q.t()).reshape(-1)[: p.numel]
                residual[p.start : p.start + p.numel] = miss
            self._keep_error(key, residual)
        flat2 = torch.cat([q.reshape(-1) for q in qs])
        dist.all_reduce(flat2, group=group)
        # 4. the sum P Q^T; warm start with the summed Q
        offset = 0
        new_qs = []
        for p, p_o in zip(matrices, ortho):
            q_sum = flat2[offset : offset + p.cols * p.rank].view(p.cols, p.rank)
            offset += p.cols * p.rank
            approx = (p_o @ q_sum.t()).reshape(-1)[: p.numel]
            tensor[p.start : p.start + p.numel].copy_(approx)
            new_qs.append(q_sum.clone())
        state.qs = new_qs

    def _reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup | None,
        key: Hashable,
        shapes: Shapes,
    ) -> None:
        full = input.clone()
        self._all_reduce(full, group, key, shapes)
        r, s = dist.get_rank(group), output.numel()
        output.copy_(full[r * s : (r + 1) * s])
