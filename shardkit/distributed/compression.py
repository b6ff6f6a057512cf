"""Gradient compression: one interface for every reduce path shardkit owns.

A :class:`GradCompressor` reduces a flat gradient tensor over a process group, for
each collective kind the wrappers use:

- :meth:`GradCompressor.all_reduce` (torch DDP through :func:`register_ddp_comm_hook`,
  the hybrid cross-replica all-reduce, parameters OSS owns on no rank),
- :meth:`GradCompressor.reduce` (reduce to the owner: OSS's ``reduce_to_owner_hook``,
  ShardedDataParallel's buckets),
- :meth:`GradCompressor.reduce_scatter` (FSDP's gradient reduce-scatter).

It knows no wrapper: a caller passes the flat tensor, its process group, a ``key``
naming the reduction (the state of error feedback and of PowerSGD's warm start is
kept per key) and, optionally, the ``shapes`` of the consecutive pieces of the flat
tensor (the parameters whose gradients lie one after another in it).

[Note: the contract]
- Every method returns the **sum** over the ranks of the group of their input tensors
  (no division): callers that want DDP's mean divide their input by the group size
  first, as every shardkit path does (that also keeps fp16 sums from overflowing).
- The methods are **synchronous**: the result is complete when the call returns (a
  lossy method issues two collectives, the second depending on the first). A caller
  that overlaps communication with compute calls it where it would wait.
- ``all_reduce(tensor)`` writes the sum into ``tensor`` (in place) and returns it.
- ``reduce(tensor, dst)`` writes the sum into ``tensor`` on the rank ``dst`` (a
  *global* rank, as ``torch.distributed.reduce`` takes); on the other ranks
  ``tensor`` is scratch afterwards (exact and half-precision: as torch's reduce
  leaves it; lossy ones: it holds the same sum, as they all-reduce).
- ``reduce_scatter(output, input)``: ``input`` is ``(N * S,)`` elements, ``output``
  ``(S,)``; group rank r receives the sum of elements ``[r S, (r + 1) S)``. ``input``
  is left as it was (lossy ones) or as the backend leaves it (exact, half).
- Every rank of the group calls the same method with the same ``key``, the same
  number of elements and the same ``shapes``, in the same order (the collectives
  must match). Float tensors only (fp32, fp16, bf16); lossy compressors compute in
  fp32 and write back in the tensor's dtype.

[Note: error feedback]
A lossy compressor sends C(g + e) instead of g and keeps the part it did not send,
``e <- (g + e) - C(g + e)``, for the next call with the same key (Seide et al. 2014,
"1-bit SGD"; Karimireddy et al. 2019, "Error Feedback Fixes SignSGD"; Vogels et al.
2019, "PowerSGD", section 3 / Algorithm 2). Nothing is lost, only delayed: that is
what lets rank-1 PowerSGD or 8-bit reductions train to the same loss. State is one
fp32 tensor of the input's size per key (an extra psi of fp32 per rank for a whole
model), dropped when a key comes back with another number of elements or shapes
(a re-bucketing), and by :meth:`GradCompressor.reset`. ``error_feedback=False``
turns it off (each call compresses its input alone).

[Note: bytes sent]
Payload bytes as ``benchmarks.comm`` counts them, for a tensor of n elements in
dtype of ``b`` bytes (fp32: 4), group size N:

==================  ==========================================================
compressor          collectives of one ``all_reduce`` (payload bytes)
==================  ==========================================================
identity            one all-reduce, ``b n`` (exact)
fp16 / bf16         one all-reduce, ``2 n`` (half of fp32's)
PowerSGD rank r     all-reduce of ``4 (sum_vectors v + sum_matrices r m)``, then
                    all-reduce of ``4 sum_matrices r n`` (``4 r (m + n)`` per
                    m x n matrix instead of ``4 m n``; vectors as they are)
int8 (block B)      all-to-all of ``N R`` and all-gather of ``N R`` bytes, with
                    ``R = c (1 + 4 / B)``, ``c = ceil(n / N)`` rounded up to a
                    multiple of B: ring volume ``2 (N - 1) R`` bytes against
                    fp32's ``8 (N - 1) n / N``: ``(1 + 4 / B) / 4`` of it
==================  ==========================================================

``reduce`` and ``reduce_scatter`` of identity and fp16 / bf16 are one reduce / one
reduce-scatter of the same bytes per element; PowerSGD runs its all-reduce for both
(so its reduce costs ``2 (N - 1) / N`` ring volume of the compressed size, against
``(N - 1) / N`` of the full size for an exact reduce); int8's reduce-scatter is the
all-to-all alone (``(1 + 4 / B) / 4`` of fp32's reduce-scatter volume), its reduce is
its all-reduce.

Sources: Vogels, Karimireddy, Jaggi 2019, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization" (NeurIPS), Algorithm 1 (rank-r power
iteration with warm start, sections 3-4) and Algorithm 2 (error feedback); torch's
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` (vectors uncompressed,
``min_compression_rate``); Tang et al. 2021, "1-bit Adam: Communication Efficient
Large-Scale Training with Adam's Convergence Speed", section 4 (compressed
all-reduce in two phases, all-to-all then all-gather, with worker and server error
feedback); Wang et al. 2023, "ZeRO++", section 3.3 (qgZ: block-quantized int8
gradients exchanged by all-to-all, reduced in full precision after dequantization).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # torch.distributed.GradBucket
from torch.nn.parallel import DistributedDataParallel

from shardkit.distributed.collectives import group_ranks

__all__ = [
    "BF16Compressor",
    "DDPCompressionState",
    "FP16Compressor",
    "GradCompressor",
    "HalfPrecisionCompressor",
    "IdentityCompressor",
    "Int8Compressor",
    "OnlyOnGroups",
    "PowerSGDCompressor",
    "ddp_compression_hook",
    "get_compressor",
    "powersgd_elements",
    "register_ddp_comm_hook",
]

Shapes = Sequence[Sequence[int]] | None


def _check_flat(tensor: torch.Tensor, what: str) -> None:
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(
            f"{what} must be a contiguous 1-D (flat) tensor; got shape {tuple(tensor.shape)}"
            f"{'' if tensor.is_contiguous() else ' (not contiguous)'}"
        )
    if not tensor.is_floating_point():
        raise TypeError(f"{what} must be a float tensor (fp32, fp16, bf16); got {tensor.dtype}")


def _check_shapes(shapes: Shapes, numel: int) -> None:
    if shapes is None:
        return
    total = sum(math.prod(s) for s in shapes)
    if total != numel:
        raise ValueError(
            f"shapes {[tuple(s) for s in shapes][:6]} hold {total} elements but the flat "
            f"tensor has {numel}: shapes must describe its consecutive pieces exactly"
        )


def _scatter_sizes(input: torch.Tensor, output: torch.Tensor, n: int) -> int:
    _check_flat(input, "reduce_scatter input")
    _check_flat(output, "reduce_scatter output")
    if input.numel() != n * output.numel():
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements, which is not the group "
            f"size ({n}) times output's {output.numel()}"
        )
    return output.numel()


class GradCompressor:
    """Reduce (sum) a flat gradient over a process group, possibly compressed.

    The base class is exact (:class:`IdentityCompressor` is it under its own name):
    the methods are ``torch.distributed``'s own collectives, so a path with the
    identity compressor gives bitwise the values of the same path without one. See
    the module's [Note: the contract] for what every compressor guarantees.

    Attributes:
        name: short name (``"identity"``, ``"bf16"``, ``"powersgd"``, ``"int8"``).
        exact: True when the result equals the uncompressed sum (up to the
            backend's order of additions).
        error_feedback: whether a lossy compressor keeps what it did not send (see
            [Note: error feedback]); False for exact ones.
    """

    name = "identity"
    exact = True

    def __init__(self, error_feedback: bool = False) -> None:
        self.error_feedback = error_feedback
        self._errors: dict[Hashable, torch.Tensor] = {}
        self._signatures: dict[Hashable, tuple[Any, ...]] = {}

    # public interface -------------------------------------------------------------
    def all_reduce(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup | None = None,
        *,
        key: Hashable = None,
        shapes: Shapes = None,
    ) -> torch.Tensor:
        """Sum ``tensor`` (flat, n elements) over ``group``, in place; return it.

        Args:
            tensor: the flat gradient ``(n,)``, float.
            group: the process group; default None (the world group).
            key: names this reduction (e.g. ``("sdp", bucket_index)``): the state of
                error feedback and warm start is kept per key. Needed by a lossy
                compressor with error feedback; ignored by exact ones.
            shapes: shapes of the consecutive pieces of ``tensor`` (each parameter's
                gradient); their elements must add up to n. Used by PowerSGD (a piece
                of 2 or more dimensions is a matrix); default None (one piece).

        Returns:
            ``tensor``, holding the sum over the group's ranks.

        Raises:
            ValueError: ``tensor`` not 1-D and contiguous; ``shapes`` not adding up to
                n; a lossy compressor with error feedback and no ``key``.
            TypeError: ``tensor`` not a float tensor.
        """
        _check_flat(tensor, "all_reduce tensor")
        _check_shapes(shapes, tensor.numel())
        if tensor.numel() == 0 or dist.get_world_size(group) == 1:
            return tensor
        self._all_reduce(tensor, group, key, shapes)
        return tensor

    def reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        group: dist.ProcessGroup | None = None,
        *,
        key: Hashable = None,
        shapes: Shapes = None,
    ) -> torch.Tensor:
        """Sum ``tensor`` over ``group`` into ``tensor`` on global rank ``dst``; return it.

        On the other ranks ``tensor`` is scratch afterwards. Arguments and errors as
        :meth:`all_reduce`; ``dst`` is a *global* rank (as ``torch.distributed.reduce``).
        """
        _check_flat(tensor, "reduce tensor")
        _check_shapes(shapes, tensor.numel())
        if tensor.numel() == 0 or dist.get_world_size(group) == 1:
            return tensor
        self._reduce(tensor, dst, group, key, shapes)
        return tensor

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup | None = None,
        *,
        key: Hashable = None,
        shapes: Shapes = None,
    ) -> torch.Tensor:
        """Sum ``input`` ``(N * S,)`` over ``group``; group rank r gets elements
        ``[r S, (r + 1) S)`` of the sum in ``output`` ``(S,)``; return ``output``.

        ``shapes`` describe ``input`` (the full flat gradient, padding included as a
        last vector piece if any). Other arguments and errors as :meth:`all_reduce`;
        also raises ValueError when ``input`` is not N times ``output``'s size.
        """
        n = dist.get_world_size(group)
        _scatter_sizes(input, output, n)
        _check_shapes(shapes, input.numel())
        if output.numel() == 0:
            return output
        if n == 1:
            output.copy_(input)
            return output
        self._reduce_scatter(output, input, group, key, shapes)
        return output

    def reset(self, key: Hashable = None) -> None:
        """Forget the state (error feedback, warm start) of ``key``, or of every key."""
        if key is None:
            self._errors.clear()
            self._signatures.clear()
        else:
            self._errors.pop(key, None)
            self._signatures.pop(key, None)

    def state_bytes(self) -> int:
        """Bytes of state this compressor holds on this rank (error feedback, warm start)."""
        return sum(e.numel() * e.element_size() for e in self._errors.values())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(error_feedback={self.error_feedback})"

    # implementations (exact) ----------------------------------------------------------
    def _all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None, key: Hashable, shapes: Shapes
    ) -> None:
        dist.all_reduce(tensor, group=group)

    def _reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        group: dist.ProcessGroup | None,
        key: Hashable,
        shapes: Shapes,
    ) -> None:
        dist.reduce(tensor, dst=dst, group=group)

    def _reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup | None,
        key: Hashable,
        shapes: Shapes,
    ) -> None:
        dist.reduce_scatter_single(output, input, group=group)

    # error feedback helpers -----------------------------------------------------------
    def _state_for(self, key: Hashable, signature: tuple[Any, ...]) -> bool:
        """Check ``key``'s state matches ``signature``; drop it otherwise. True if kept."""
        if self._signatures.get(key) == signature:
            return True
        self.reset(key)
        self._signatures[key] = signature
        return False

    def _need_key(self, key: Hashable) -> None:
        if key is None and self.error_feedback:
            raise ValueError(
                f"{type(self).__name__} with error feedback needs a key naming the reduction "
                "(e.g. key=('sdp', bucket_index)): its residual is kept per key"
            )

    def _with_error(self, key: Hashable, x: torch.Tensor) -> torch.Tensor:
        """``x`` (fp32) plus the residual kept for ``key`` (error feedback on)."""
        if self.error_feedback and key in self._errors:
            x.add_(self._errors[key])
        return x

    def _keep_error(self, key: Hashable, residual: torch.Tensor) -> None:
        if self.error_feedback:
            self._errors[key] = residual


class IdentityCompressor(GradCompressor):
    """Exact: ``torch.distributed``'s all-reduce, reduce and reduce-scatter, unchanged."""

    name = "identity"

    def __init__(self) -> None:
        super().__init__(error_feedback=False)


class HalfPrecisionCompressor(GradCompressor):
    """Cast to ``dtype`` (fp16 or bf16), reduce, cast back: half of fp32's bytes.

    Like torch's ``fp16_compress_hook`` / ``bf16_compress_hook``: the sum is taken in
    ``dtype`` by the backend. With ``error_feedback=True`` the local rounding of the
    cast, ``(g + e) - cast(g + e)``, is kept per key and added to the next call (the
    rounding of the sum itself is not: the backend does it).

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``; default bf16.
        error_feedback: keep the cast's rounding (see above); default False (torch's
            hooks have none).

    Raises:
        ValueError: ``dtype`` is not fp16 or bf16.
    """

    exact = False

    def __init__(self, dtype: torch.dtype = torch.bfloat16, error_feedback: bool = False) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"HalfPrecisionCompressor takes fp16 or bf16; got {dtype}")
        super().__init__(error_feedback=error_feedback)
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dtype={self.dtype}, error_feedback={self.error_feedback})"

    def _cast(self, tensor: torch.Tensor, key: Hashable) -> torch.Tensor:
        """``tensor`` (+ residual) in the wire dtype, a new tensor; keeps the residual."""
        if not self.error_feedback:
            return tensor.to(self.dtype, copy=True)
        self._need_key(key)
        self._state_for(key, (tensor.numel(),))
        x = self._with_error(key, tensor.to(torch.float32, copy=True))
        half = x.to(self.dtype)
        self._keep_error(key, x.sub_(half.to(torch.float32)))
        return half

    def _all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None, key: Hashable, shapes: Shapes
    ) -> None:
        half = self._cast(tensor, key)
        dist.all_reduce(half, group=group)
        tensor.copy_(half)

    def _reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        group: dist.ProcessGroup | None,
        key: Hashable,
        shapes: Shapes,
    ) -> None:
        half = self._cast(tensor, key)
        dist.reduce(half, dst=dst, group=group)
        tensor.copy_(half)

    def _reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup | None,
        key: Hashable,
        shapes: Shapes,
    ) -> None:
        half = self._cast(input, key)
        out = torch.empty(output.numel(), dtype=self.dtype, device=output.device)
        dist.reduce_scatter_single(out, half, group=group)
        output.copy_(out)


class FP16Compressor(HalfPrecisionCompressor):
    """:class:`HalfPrecisionCompressor` in fp16 (sums above 65504 overflow: divide first)."""

    def __init__(self, error_feedback: bool = False) -> None:
        super().__init__(torch.float16, error_feedback)


class BF16Compressor(HalfPrecisionCompressor):
    """:class:`HalfPrecisionCompressor` in bf16 (fp32's range, 8 bits of mantissa)."""

    def __init__(self, error_feedback: bool = False) -> None:
        super().__init__(torch.bfloat16, error_feedback)


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


class _ReduceByAllReduce(GradCompressor):
    """A lossy compressor whose reduce to one rank is its compressed all-reduce (the
    contract lets the other ranks hold the sum too): two phases whose second depends
    on every rank's first cannot end on one rank only."""

    exact = False

    def _reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        group: dist.ProcessGroup | None,
        key: Hashable,
        shapes: Shapes,
    ) -> None:
        self._all_reduce(tensor, group, key, shapes)


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


def _quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per block: ``x`` (k,) with k a multiple of ``block``; (q, scales)."""
    blocks = x.view(-1, block)
    scales = blocks.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(-1), scales


def _dequantize(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    return (q.view(-1, block).to(torch.float32) * scales[:, None]).view(-1)


class Int8Compressor(_ReduceByAllReduce):
    """8-bit block-quantized all-reduce with error feedback (1-bit Adam's compressed
    all-reduce, Tang et al. 2021 section 4, at 8 bits; ZeRO++'s qgZ, section 3.3).

    The flat tensor is cut into N equal chunks (the reduce-scatter's chunks; padded
    to a multiple of ``block_size``), each quantized per block of ``block_size``
    elements to int8 with one fp32 scale (absolute maximum / 127), the scales
    appended to the chunk's bytes. Then:

    1. all-to-all of the int8 chunks: rank r receives every rank's chunk r,
       dequantizes and sums them in fp32 (this is the reduce-scatter);
    2. (all-reduce, reduce) rank r quantizes its summed chunk again and the chunks
       are all-gathered as int8, dequantized on every rank.

    Error feedback (default on): the worker residual ``(g + e) - dequant(quant(g + e))``
    (n elements, per key) and the server residual of step 2 (n / N elements, per
    key) are added to the next call's input, as 1-bit Adam does. gloo moves int8
    tensors in all-to-all and all-gather (checked on torch 2.13); nothing is summed
    in int8.

    Bytes (ring volume, see the module's [Note: bytes sent]): ``(1 + 4 / B) / 4`` of
    the fp32 collective's for all-reduce and reduce-scatter when the chunk is a
    multiple of B (0.2539 at B = 256). ``reduce`` is the all-reduce (every rank gets
    the sum).

    Args:
        block_size: elements per scale (B); default 256.
        error_feedback: keep worker and server residuals per key; default True.

    Raises:
        ValueError: ``block_size`` < 1.
    """

    name = "int8"
    exact = False

    def __init__(self, block_size: int = 256, error_feedback: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {block_size}")
        super().__init__(error_feedback=error_feedback)
        self.block_size = block_size
        self._server: dict[Hashable, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"Int8Compressor(block_size={self.block_size}, error_feedback={self.error_feedback})"

    def reset(self, key: Hashable = None) -> None:
        super().reset(key)
        if key is None:
            self._server.clear()
        else:
            self._server.pop(key, None)

    def state_bytes(self) -> int:
        server = sum(e.numel() * e.element_size() for e in self._server.values())
        return super().state_bytes() + server

    def chunk_elements(self, numel: int, world_size: int) -> int:
        """Elements per (padded) chunk: ``ceil(numel / N)`` up to a multiple of B."""
        chunk = math.ceil(numel / world_size)
        return math.ceil(chunk / self.block_size) * self.block_size

    def _pack(self, q: torch.Tensor, scales: torch.Tensor, rows: int) -> torch.Tensor:
        """int8 ``(rows, chunk + 4 chunk / B)``: each row its quantized chunk + scales' bytes."""
        return torch.cat([q.view(rows, -1), scales.view(rows, -1).view(torch.int8)], dim=1)

    def _unpack(self, packed: torch.Tensor, chunk: int) -> torch.Tensor:
        """fp32 ``(rows, chunk)``: each row of :meth:`_pack`'s output dequantized."""
        rows = packed.shape[0]
        q = packed[:, :chunk].contiguous()
        scales = packed[:, chunk:].contiguous().view(torch.float32)
        return _dequantize(q.view(-1), scales.reshape(-1), self.block_size).view(rows, chunk)

    def _scatter_phase(
        self, x: torch.Tensor, n: int, group: dist.ProcessGroup | None, key: Hashable
    ) -> tuple[torch.Tensor, int]:
        """Phase 1 on ``x`` (fp32, ``(n, c)``, c = the caller's chunk): this rank's summed
        chunk (padded, fp32) and the padded chunk size."""
        c = x.shape[1]
        chunk = math.ceil(c / self.block_size) * self.block_size
        padded = torch.zeros(n, chunk, dtype=torch.float32, device=x.device)
        padded[:, :c] = x
        flat = self._with_error(key, padded.view(-1))
        q, scales = _quantize(flat, self.block_size)
        self._keep_error(key, flat - _dequantize(q, scales, self.block_size))
        send = self._pack(q, scales, n)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return self._unpack(recv, chunk).sum(dim=0), chunk

    def _all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None, key: Hashable, shapes: Shapes
    ) -> None:
        self._need_key(key)
        n, numel = dist.get_world_size(group), tensor.numel()
        self._state_for(key, ("all_reduce", numel, n))
        c = math.ceil(numel / n)
        x = torch.zeros(n * c, dtype=torch.float32, device=tensor.device)
        x[:numel] = tensor
        mine, chunk = self._scatter_phase(x.view(n, c), n, group, key)
        if self.error_feedback and key in self._server:
            mine.add_(self._server[key])
        q, scales = _quantize(mine, self.block_size)
        if self.error_feedback:
            self._server[key] = mine - _dequantize(q, scales, self.block_size)
        row = self._pack(q, scales, 1)
        gathered = torch.empty(n * row.shape[1], dtype=torch.int8, device=row.device)
        dist.all_gather_single(gathered, row.view(-1), group=group)
        full = self._unpack(gathered.view(n, -1), chunk)[:, :c].reshape(-1)
        tensor.copy_(full[:numel])

    def _reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup | None,
        key: Hashable,
        shapes: Shapes,
    ) -> None:
        self._need_key(key)
        n, s = dist.get_world_size(group), output.numel()
        self._state_for(key, ("reduce_scatter", input.numel(), n))
        x = input.to(torch.float32).view(n, s)
        mine, _ = self._scatter_phase(x, n, group, key)
        output.copy_(mine[:s])


class OnlyOnGroups(GradCompressor):
    """Compress only the reductions over some process groups; exact elsewhere.

    For hybrid sharding: the cross-replica (cross-node) all-reduce goes through
    ``compressor``, the reduce-scatter inside a node through ``otherwise`` (exact).
    A group matches when it holds the same global ranks as one of ``groups`` (so a
    rank's own replica group matches whichever replica group it is in).

    Args:
        compressor: used for reductions over ``groups``.
        groups: the process groups to compress on (None stands for the world group).
        otherwise: used elsewhere; default :class:`IdentityCompressor` (exact).
    """

    def __init__(
        self,
        compressor: GradCompressor,
        groups: Iterable[dist.ProcessGroup | None],
        otherwise: GradCompressor | None = None,
    ) -> None:
        super().__init__(error_feedback=compressor.error_feedback)
        self.compressor = compressor
        self.otherwise = otherwise if otherwise is not None else IdentityCompressor()
        self._ranks = {
            tuple(group_ranks(g))
            for g in groups
            if g is None or isinstance(g, dist.ProcessGroup)  # not NON_GROUP_MEMBER (an int)
        }
        self.name = f"{compressor.name}-on-groups"
        self.exact = compressor.exact and self.otherwise.exact

    def __repr__(self) -> str:
        return f"OnlyOnGroups({self.compressor!r}, ranks={sorted(self._ranks)}, otherwise={self.otherwise!r})"

    def pick(self, group: dist.ProcessGroup | None) -> GradCompressor:
        """The compressor used for reductions over ``group``."""
        return self.compressor if tuple(group_ranks(group)) in self._ranks else self.otherwise

    def reset(self, key: Hashable = None) -> None:
        self.compressor.reset(key)
        self.otherwise.reset(key)

    def state_bytes(self) -> int:
        return self.compressor.state_bytes() + self.otherwise.state_bytes()

    def _all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None, key: Hashable, shapes: Shapes
    ) -> None:
        self.pick(group)._all_reduce(tensor, group, key, shapes)

    def _reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        group: dist.ProcessGroup | None,
        key: Hashable,
        shapes: Shapes,
    ) -> None:
        self.pick(group)._reduce(tensor, dst, group, key, shapes)

    def _reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup | None,
        key: Hashable,
        shapes: Shapes,
    ) -> None:
        self.pick(group)._reduce_scatter(output, input, group, key, shapes)


_BY_NAME = {
    "identity": IdentityCompressor,
    "fp16": FP16Compressor,
    "bf16": BF16Compressor,
    "powersgd": PowerSGDCompressor,
    "int8": Int8Compressor,
}


def get_compressor(spec: str | GradCompressor | None, **kwargs: Any) -> GradCompressor | None:
    """A compressor from a name (``"identity"``, ``"fp16"``, ``"bf16"``, ``"powersgd"``,
    ``"int8"``; ``kwargs`` go to its constructor), an instance (returned as it is) or
    None (None: no compression, the caller's own exact path).

    Raises:
        ValueError: an unknown name.
    """
    if spec is None or isinstance(spec, GradCompressor):
        return spec
    if spec not in _BY_NAME:
        raise ValueError(f"unknown gradient compression {spec!r}; choose from {sorted(_BY_NAME)}")
    compressor: GradCompressor = _BY_NAME[spec](**kwargs)
    return compressor


# torch DDP ----------------------------------------------------------------------------


@dataclass
class DDPCompressionState:
    """The state of :func:`ddp_compression_hook`.

    Attributes:
        compressor: the compressor every bucket goes through.
        group: the DDP model's process group (None: the world group).
        prefix: first element of each bucket's key, ``(prefix, bucket index)``.
    """

    compressor: GradCompressor
    group: dist.ProcessGroup | None = None
    prefix: str = "ddp"


def _bucket_shapes(bucket: GradBucket, buffer: torch.Tensor) -> list[torch.Size] | None:
    """Shapes of the bucket's gradients when they lie one after another in the buffer."""
    expected = buffer.storage_offset()
    base = buffer.untyped_storage().data_ptr()
    shapes = []
    for g in bucket.gradients():
        if g.is_sparse or g.untyped_storage().data_ptr() != base:
            return None
        if g.storage_offset() != expected or not g.is_contiguous():
            return None
        expected += g.numel()
        shapes.append(g.shape)
    return shapes if expected - buffer.storage_offset() == buffer.numel() else None


def ddp_compression_hook(
    state: DDPCompressionState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch DDP communication hook: each bucket divided by the group size (DDP's mean)
    and all-reduced through ``state.compressor`` (key ``(state.prefix, bucket index)``;
    the gradients' shapes passed when they lie in order in the buffer).

    Register it with :func:`register_ddp_comm_hook`, or
    ``ddp.register_comm_hook(DDPCompressionState(compressor, ddp.process_group),
    ddp_compression_hook)``. DDP rebuilds its buckets after the first iteration; a key
    whose size changed starts with fresh state.

    Returns:
        A completed Future of the bucket's buffer (the mean over the ranks).
    """
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(state.group))
    state.compressor.all_reduce(
        buffer,
        state.group,
        key=(state.prefix, bucket.index()),
        shapes=_bucket_shapes(bucket, buffer),
    )
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


# DDP checks the hook's annotations as objects; postponed (string) annotations fail it.
ddp_compression_hook.__annotations__ = {
    "state": DDPCompressionState,
    "bucket": GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def register_ddp_comm_hook(
    module: DistributedDataParallel, compressor: GradCompressor | str
) -> DDPCompressionState:
    """Register :func:`ddp_compression_hook` with ``compressor`` on a torch DDP model
    (once, before its first backward); returns the hook's state.

    Raises:
        TypeError: ``module`` is not a torch ``DistributedDataParallel``.
        ValueError: an unknown compressor name.
    """
    if not isinstance(module, DistributedDataParallel):
        raise TypeError(
            "register_ddp_comm_hook needs a torch.nn.parallel.DistributedDataParallel; got "
            f"{type(module).__module__}.{type(module).__name__}"
        )
    resolved = get_compressor(compressor)
    assert resolved is not None
    state = DDPCompressionState(resolved, module.process_group)
    module.register_comm_hook(state, ddp_compression_hook)
    return state
