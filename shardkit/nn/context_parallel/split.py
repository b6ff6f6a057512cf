"""Splitting a batch's sequence across the context-parallel ranks, and back.

Two layouts:

- **contiguous** (Ulysses, and ring attention without a causal mask): rank ``r`` of
  ``P`` holds tokens ``[r T/P, (r+1) T/P)``;
- **zig-zag** (causal ring attention): the sequence is cut into ``2P`` chunks and rank
  ``r`` holds chunks ``r`` and ``2P - 1 - r``, so every rank does the same causal work
  (see ``[Note: zig-zag causal layout]`` in ``ring.py``).

Position ids follow the tokens: :func:`position_ids` is the split of ``arange(T)``, to be
passed to the model's position embedding (the GPT's ``position_ids`` argument).

[Note: the loss over a split sequence]
Each rank computes the loss of its own tokens. The loss of the global batch is the sum
of the per-token losses over every token of every rank divided by the number of tokens
(of the data- and context-parallel ranks together), not the mean of the ranks' means,
which differs when ranks hold different numbers of counted tokens (ignored labels).
:func:`token_mean_loss` returns, on each rank, ``sum of its token losses x W / N``
(``N`` the all-reduced token count, ``W`` the size of the gradient-averaging group): the
data-parallel wrappers average gradients over ``W`` ranks, so the reduced gradient is
exactly that of ``sum / N``. With equal token counts (a split sequence without ignored
labels) it equals the plain per-rank mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["combine_sequence", "position_ids", "split_sequence", "token_mean_loss"]


def _chunks(seq_len: int, cp: int, zigzag: bool) -> int:
    parts = 2 * cp if zigzag else cp
    if cp < 1:
        raise ValueError(f"cp must be >= 1; got {cp}")
    if seq_len % parts != 0:
        layout = "zig-zag (2 x cp chunks)" if zigzag else "contiguous (cp slices)"
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {parts}, the {layout} split "
            f"over cp={cp} ranks; use a sequence length that is a multiple of {parts}"
        )
    return parts


def split_sequence(
    x: torch.Tensor, cp_rank: int, cp: int, *, zigzag: bool, dim: int = 1
) -> torch.Tensor:
    """Rank ``cp_rank``'s part of ``x`` along its sequence dimension ``dim``.

    Args:
        x: any tensor whose ``dim`` is the sequence (default 1: ``(batch, seq, ...)``).
        cp_rank: this rank's index in the context-parallel group, ``[0, cp)``.
        cp: the context-parallel degree.
        zigzag: chunks ``cp_rank`` and ``2 cp - 1 - cp_rank`` of ``2 cp`` (causal ring
            attention) instead of the contiguous slice ``cp_rank`` of ``cp``.
        dim: the sequence dimension. Default 1.

    Returns:
        ``x`` with ``shape[dim] / cp`` (a new tensor for zig-zag, a view otherwise).

    Raises:
        ValueError: ``shape[dim]`` not divisible by ``cp`` (``2 cp`` for zig-zag), or
            ``cp_rank`` outside ``[0, cp)``.
    """
    parts = _chunks(x.shape[dim], cp, zigzag)
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp})")
    chunks = x.chunk(parts, dim=dim)
    if not zigzag:
        return chunks[cp_rank]
    return torch.cat([chunks[cp_rank], chunks[parts - 1 - cp_rank]], dim=dim)


def combine_sequence(parts: list[torch.Tensor], *, zigzag: bool, dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`split_sequence`: ``parts[r]`` is rank ``r``'s part.

    Raises:
        ValueError: no parts, or (zig-zag) a part of odd length.
    """
    cp = len(parts)
    if cp == 0:
        raise ValueError("combine_sequence needs the part of every rank; got none")
    if not zigzag:
        return torch.cat(parts, dim=dim)
    if parts[0].shape[dim] % 2 != 0:
        raise ValueError(f"a zig-zag part holds two equal chunks; got length {parts[0].shape[dim]}")
    halves = [p.chunk(2, dim=dim) for p in parts]
    ordered = [h[0] for h in halves] + [h[1] for h in reversed(halves)]
    return torch.cat(ordered, dim=dim)


def position_ids(
    seq_len: int, cp_rank: int, cp: int, *, zigzag: bool, device: torch.device | None = None
) -> torch.Tensor:
    """The positions of rank ``cp_rank``'s tokens: ``split_sequence(arange(seq_len))``.

    Returns:
        int64 ``(seq_len / cp,)``.
    """
    positions = torch.arange(seq_len, device=device)
    return split_sequence(positions, cp_rank, cp, zigzag=zigzag, dim=0)


def token_mean_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross entropy of the global batch, as each rank's share (see ``[Note: the
    loss over a split sequence]``).

    Args:
        logits: ``(..., vocab)``, this rank's tokens.
        targets: ``logits.shape[:-1]`` int64; ``ignore_index`` is not counted.
        group: the ranks whose gradients are averaged (DDP's or FSDP's group, e.g.
            ``mesh.group("dp_cp")``); None: the world.
        ignore_index: the label not counted. Default -100 (cross entropy's).

    Returns:
        ``(loss, global_loss)``: ``loss`` to call ``backward`` on (``sum x W / N``) and
        the detached loss of the global batch (``sum over all ranks / N``, the same on
        every rank).
    """
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    stats = torch.stack([per_token.detach(), (targets != ignore_index).sum().to(per_token)])
    dist.all_reduce(stats, group=group)
    world = dist.get_world_size(group)
    count = stats[1].clamp(min=1)
    return per_token * world / count, stats[0] / count
