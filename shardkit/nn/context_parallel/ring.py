"""Ring attention: blockwise attention whose K/V blocks travel around the ranks.

Each of the ``P`` ranks of a context-parallel group holds a slice of the sequence for
``q``, ``k`` and ``v``. In ``P`` steps every rank attends its queries to every K/V block:
at step ``j`` it holds the block of rank ``r - j`` and, while it computes on it, sends
that block to rank ``r + 1`` and receives the next from rank ``r - 1``
(``torch.distributed.batch_isend_irecv``; the transfer is overlapped with the block's
compute). The partial results are merged by their log-sum-exp (the online softmax of
Milakov & Gimelshein 2018; blockwise attention, Liu et al. 2023, "Ring Attention with
Blockwise Transformers", section 3)::

    out, lse  <-  block 0
    lse'      =   logaddexp(lse, lse_j)
    out       <-  out * exp(lse - lse') + out_j * exp(lse_j - lse')

[Note: zig-zag causal layout]
With a causal mask a contiguous split is unbalanced: the rank holding the end of the
sequence attends to every block, the first rank to one. The sequence is therefore cut
into ``2P`` chunks and rank ``r`` holds chunks ``r`` and ``2P - 1 - r``
(:func:`shardkit.nn.context_parallel.split_sequence` with ``zigzag=True``). A query chunk
``a`` attends a key chunk ``b`` fully when ``b < a``, with the causal triangle when
``b == a``, and not at all when ``b > a``; every rank then computes ``2P + 1`` of the
``(2P)^2`` chunk pairs' triangles' worth, the same on every rank (Brandon et al. 2023,
"Striped Attention", and the zig-zag variant of Zhu's ring-flash-attention).

[Note: the backward ring]
The backward keeps only ``out`` and the final ``lse`` of the forward. It passes K/V
around the ring again, recomputes each block's probabilities from ``lse``
(``p = exp(q k^T scale - lse)``, FlashAttention's backward, Dao et al. 2022, algorithm 4)
and passes the block's accumulating ``dK/dV`` along with it: at step ``j`` a rank adds
its contribution to the accumulator of block ``r - j`` received from rank ``r - 1`` and
sends it on to ``r + 1``; after ``P`` hops each accumulator is back on its owner. Sends
and receives are posted in the same order on both ends of every link (K/V of step ``j``,
then dK/dV of step ``j``), which is what both gloo and NCCL match on.

[Note: query tiles]
A block's scores ``q k^T`` are ``(L/P)^2`` per head: quadratic in the local length, and
at long sequences they, not the activations, set the peak memory. Both passes therefore
walk each block ``query_tile`` query rows at a time (the online softmax is per row, so
tiles merge independently), writing into the one output (forward) and the one ``dQ`` /
``dK/dV`` accumulator (backward) in place; a tile on the causal diagonal reads only the
keys up to its last row. The temporaries are ``query_tile x L/P`` per head, linear in
``L``.

[Note: one copy of the output]
The backward needs the output, so the forward saves it; the caller's output projection
saves its input too, the output with the heads merged, ``y.transpose(1, 2)`` made
contiguous. The output is therefore written in the ``(b, s, h, d)`` memory layout (a
``(b, h, s, d)`` view): that ``contiguous()`` is then no copy, and one tensor serves
both, as CPU SDPA's output does (fp32; a bf16 output is a second, smaller tensor).

Block math runs in fp32 whatever the input dtype (bf16 inputs give bf16 outputs within
bf16 rounding); ``dK/dV`` travel in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["RingAttention", "ring_attention"]

#: How a query chunk attends a key chunk: fully, with the causal triangle, or not.
_FULL, _DIAG = "full", "diag"


def _chunk_ids(rank: int, world: int, causal: bool) -> list[int]:
    """The sequence chunks rank ``rank`` holds: ``[r, 2P-1-r]`` (zig-zag) or ``[r]``."""
    return [rank, 2 * world - 1 - rank] if causal else [rank]


def _pairs(q_ids: list[int], k_ids: list[int], causal: bool) -> list[tuple[int, int, str]]:
    """``(query slot, key slot, kind)`` of the chunk pairs that attend."""
    out = []
    for qi, a in enumerate(q_ids):
        for ki, b in enumerate(k_ids):
            if not causal or b < a:
                out.append((qi, ki, _FULL))
            elif b == a:
                out.append((qi, ki, _DIAG))
    return out


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, kind: str, row0: int) -> torch.Tensor:
    """``q k^T scale`` for query rows ``row0 ..`` of a chunk; ``_DIAG``: key ``j`` masked
    for query row ``i`` when ``j > row0 + i`` (the causal triangle of a chunk on itself)."""
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if kind == _DIAG:
        rows = torch.arange(row0, row0 + s.shape[-2], device=s.device).unsqueeze(-1)
        cols = torch.arange(s.shape[-1], device=s.device)
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def _tiles(rows: int, tile: int, kind: str, keys: int) -> Iterator[tuple[int, int, int]]:
    """``(first row, end row, end key)`` of each query tile of a chunk pair: ``_DIAG``
    tiles see only the keys up to their last row (the rest are masked)."""
    for r0 in range(0, rows, tile):
        r1 = min(r0 + tile, rows)
        yield r0, r1, (r1 if kind == _DIAG else keys)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    kind: str,
    row0: int,
) -> None:
    """Merge one query tile's attention over one key block into ``out`` / ``lse`` (views
    of the running result, updated in place) by log-sum-exp."""
    s = _scores(q, k, scale, kind, row0)
    lse_b = torch.logsumexp(s, dim=-1)
    out_b = torch.matmul(torch.exp(s - lse_b.unsqueeze(-1)), v)
    merged = torch.logaddexp(lse, lse_b)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1))
    out.add_(out_b.mul_(torch.exp(lse_b - merged).unsqueeze(-1)))
    lse.copy_(merged)


def _output_buffer(q: torch.Tensor) -> torch.Tensor:
    """Zeros of ``q``'s shape in fp32; a 4-D ``(b, h, s, d)`` one laid out as
    ``(b, s, h, d)`` in memory (see ``[Note: one copy of the output]``)."""
    if q.dim() != 4:
        return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    b, h, s, d = q.shape
    return torch.zeros(b, s, h, d, dtype=torch.float32, device=q.device).transpose(1, 2)


class _Ring:
    """The neighbours of this rank on the ring of ``group``, and the exchange with them."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def post(self, send: torch.Tensor | None, recv: torch.Tensor | None) -> list[dist.Work]:
        ops = []
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group))
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.group))
        return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


def _split(t: torch.Tensor, parts: int) -> list[torch.Tensor]:
    return list(t.chunk(parts, dim=-2))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: dist.ProcessGroup,
        causal: bool,
        scale: float,
        tile: int,
    ) -> torch.Tensor:
        ring = _Ring(group)
        parts = 2 if causal else 1
        q_ids = _chunk_ids(ring.rank, ring.world, causal)
        qs = _split(q.float(), parts)
        result = _output_buffer(q)
        lse_all = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        out, lse = _split(result, parts), list(lse_all.chunk(parts, dim=-1))
        kv = torch.stack([k, v]).contiguous()
        for step in range(ring.world):
            src = (ring.rank - step) % ring.world
            nxt = torch.empty_like(kv) if step < ring.world - 1 else None
            works = ring.post(kv if nxt is not None else None, nxt)
            ks, vs = _split(kv[0].float(), parts), _split(kv[1].float(), parts)
            for qi, ki, kind in _pairs(q_ids, _chunk_ids(src, ring.world, causal), causal):
                for r0, r1, kend in _tiles(qs[qi].shape[-2], tile, kind, ks[ki].shape[-2]):
                    _attend(
                        qs[qi][..., r0:r1, :],
                        ks[ki][..., :kend, :],
                        vs[ki][..., :kend, :],
                        out[qi][..., r0:r1, :],
                        lse[qi][..., r0:r1],
                        scale,
                        kind,
                        r0,
                    )
            _wait(works)
            if nxt is not None:
                kv = nxt
        ctx.save_for_backward(q, k, v, result, lse_all)
        ctx.group, ctx.causal, ctx.scale, ctx.tile = group, causal, scale, tile
        return result.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale = ctx.causal, ctx.scale
        ring = _Ring(ctx.group)
        parts = 2 if causal else 1
        grad = grad.float()
        delta = torch.empty_like(lse)  # rowsum(dO * O), FlashAttention's D, per tile
        for r0 in range(0, q.shape[-2], ctx.tile):
            r1 = r0 + ctx.tile
            delta[..., r0:r1] = (grad[..., r0:r1, :] * out[..., r0:r1, :]).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        chunks = _Chunks(
            _split(q.float(), parts),
            _split(grad, parts),
            list(lse.chunk(parts, dim=-1)),
            list(delta.chunk(parts, dim=-1)),
            _split(dq, parts),
            _chunk_ids(ring.rank, ring.world, causal),
        )
        kv = torch.stack([k, v]).contiguous()
        dkv_in: torch.Tensor | None = None
        send_works: list[dist.Work] = []
        for step in range(ring.world):
            src = (ring.rank - step) % ring.world
            # receive order on every link: dK/dV of step - 1, then K/V of step
            dkv_in = torch.empty_like(kv, dtype=torch.float32) if step > 0 else None
            works = ring.post(None, dkv_in) if dkv_in is not None else []
            nxt = torch.empty_like(kv) if step < ring.world - 1 else None
            works += ring.post(kv if nxt is not None else None, nxt)
            dkv = _block_grads(kv, chunks, src, ring.world, causal, scale, ctx.tile)
            _wait(works)
            _wait(send_works)
            if dkv_in is not None:
                dkv += dkv_in
            send_works = ring.post(dkv, None)
            if nxt is not None:
                kv = nxt
        own = torch.empty_like(kv, dtype=torch.float32)
        _wait(ring.post(None, own) + send_works)
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None


class _Chunks(NamedTuple):
    """This rank's query-side chunks for the backward (fp32 views; ``dq`` written into)."""

    q: list[torch.Tensor]
    dout: list[torch.Tensor]
    lse: list[torch.Tensor]
    delta: list[torch.Tensor]
    dq: list[torch.Tensor]
    ids: list[int]


def _block_grads(
    kv: torch.Tensor,
    c: _Chunks,
    src: int,
    world: int,
    causal: bool,
    scale: float,
    tile: int,
) -> torch.Tensor:
    """This rank's ``dK/dV`` for the K/V block of rank ``src`` (fp32, ``kv``'s layout);
    adds the block's ``dQ`` into ``c.dq`` in place, one query tile at a time."""
    parts = len(c.q)
    ks, vs = _split(kv[0].float(), parts), _split(kv[1].float(), parts)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    dks, dvs = _split(dkv[0], parts), _split(dkv[1], parts)
    for qi, ki, kind in _pairs(c.ids, _chunk_ids(src, world, causal), causal):
        for r0, r1, kend in _tiles(c.q[qi].shape[-2], tile, kind, ks[ki].shape[-2]):
            q, do = c.q[qi][..., r0:r1, :], c.dout[qi][..., r0:r1, :]
            k, v = ks[ki][..., :kend, :], vs[ki][..., :kend, :]
            p = _scores(q, k, scale, kind, r0).sub_(c.lse[qi][..., r0:r1].unsqueeze(-1)).exp_()
            dvs[ki][..., :kend, :] += torch.matmul(p.transpose(-2, -1), do)
            dp = torch.matmul(do, v.transpose(-2, -1))
            ds = p.mul_(dp.sub_(c.delta[qi][..., r0:r1].unsqueeze(-1)))
            c.dq[qi][..., r0:r1, :] += torch.matmul(ds, k) * scale
            dks[ki][..., :kend, :] += torch.matmul(ds.transpose(-2, -1), q) * scale
    return dkv


def _check_tile(tile: int) -> None:
    """Refuse a ``query_tile`` below 1 (the ValueError names the argument and value)."""
    if tile < 1:
        raise ValueError(f"query_tile must be a positive number of query rows; got {tile}")


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, tile: int) -> None:
    _check_tile(tile)
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"ring attention needs q, k and v of one shape (batch, heads, seq, head_dim); "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if causal and q.shape[-2] % 2 != 0:
        raise ValueError(
            f"causal ring attention holds two zig-zag chunks per rank, so the local "
            f"sequence length must be even; got {q.shape[-2]} (the whole sequence must "
            "be divisible by 2 x cp; split it with split_sequence(..., zigzag=True))"
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    causal: bool = False,
    scale: float | None = None,
    query_tile: int = 64,
) -> torch.Tensor:
    """Softmax attention of this rank's queries over the whole sequence held by ``group``.

    Args:
        q: ``(batch, heads, seq / P, head_dim)``, this rank's queries (SDPA's layout).
            ``causal=True``: the zig-zag slice (chunks ``r`` and ``2P - 1 - r`` of ``2P``;
            see ``[Note: zig-zag causal layout]``); ``causal=False``: any slice, e.g. the
            contiguous one.
        k: the same slice's keys, ``q``'s shape.
        v: the same slice's values, ``q``'s shape.
        group: the context-parallel process group (``mesh.group("cp")``) of ``P`` ranks.
        causal: mask each query to the keys at or before its position. Default False.
        scale: the softmax scale; default ``1 / sqrt(head_dim)``.
        query_tile: query rows attended at a time (default 64): each block's scores are
            computed ``query_tile`` rows at a time, forward and backward, so the
            temporaries are ``batch x heads x query_tile x seq / P`` floats, linear in the
            local length instead of quadratic (see ``[Note: query tiles]``). Any
            positive value; it need not divide the local length.

    Returns:
        ``(batch, heads, seq / P, head_dim)`` in ``q``'s dtype: the rows of
        ``scaled_dot_product_attention`` over the whole sequence for this rank's queries.

    Raises:
        ValueError: q, k, v of different shapes, (causal) an odd local length, or
            ``query_tile < 1``.
    """
    _check(q, k, v, causal, query_tile)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out: torch.Tensor = _RingAttention.apply(q, k, v, group, causal, scale, query_tile)
    return out


class RingAttention(nn.Module):
    """:func:`ring_attention` as a module: ``(q, k, v) -> out``, SDPA's layout.

    Example:
        >>> attn = RingAttention(mesh.group("cp"), causal=True)   # doctest: +SKIP
        >>> out = attn(q, k, v)   # (b, h, s/P, d), zig-zag slices   # doctest: +SKIP

    Args:
        group: the context-parallel process group.
        causal: causal mask over the whole sequence (inputs in the zig-zag layout).
            Default True.
        scale: the softmax scale; default None (``1 / sqrt(head_dim)``).
        query_tile: query rows attended at a time, default 64 (see :func:`ring_attention`).

    Raises:
        ValueError: ``query_tile < 1``, at construction (the value named); the inputs'
            checks of :func:`ring_attention` run at each forward.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        causal: bool = True,
        scale: float | None = None,
        query_tile: int = 64,
    ) -> None:
        _check_tile(query_tile)
        super().__init__()
        self.group, self.causal, self.scale, self.query_tile = group, causal, scale, query_tile

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """See :func:`ring_attention`."""
        return ring_attention(
            q, k, v, self.group, causal=self.causal, scale=self.scale, query_tile=self.query_tile
        )
