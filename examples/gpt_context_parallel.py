"""The main job's context parallelism: each sequence split over the mesh's ``cp`` ranks.

``--cp P --cp-method ulysses|ring`` (``train_gpt.py``): the ``P`` ranks of a
context-parallel group read the same rows (they are one data-parallel rank) and each
keeps ``seq_len / P`` tokens of every row, with their positions
(:func:`apply_context_parallel` registers a forward pre-hook on the GPT that splits
``idx`` and ``targets`` and passes ``position_ids``). Every block's attention is
replaced by a context-parallel one over the ``cp`` group (``CausalSelfAttention.core``):

- ``ulysses``: :class:`shardkit.nn.context_parallel.DistributedAttention` around causal
  SDPA, on the contiguous split (each rank's heads, ``n_head / tp`` under ``--tp``,
  must divide by ``P``);
- ``ring``: :class:`shardkit.nn.context_parallel.RingAttention`, causal, on the zig-zag
  split (``seq_len`` must divide by ``2 P``; any head count).

Under ``--tp T`` the attention core receives the rank's ``n_head / T`` tensor-parallel
heads (``tp.gpt_plan``'s head split) and runs over the ``cp`` group of the ``P`` ranks
``T`` apart in the mesh; the two splits are independent (``--sequence-parallel`` then
splits each rank's ``seq_len / P`` tokens again over ``tp``).

The parameters are the same on the ``P`` ranks, so the data-parallel wrapper reduces
gradients over ``dp x cp`` (:func:`strategies.build_strategy`): torch DDP, OSS and
ShardedDataParallel over ``"dp_cp"`` (the world when ``--tp`` is 1), FSDP sharding over
``"dp_shard_cp"``, hybrid (hsdp) sharding over ``"dp_shard_cp"`` and replicating over
``"dp_replicate"`` (``shardkit.compose``). Each rank's loss is the mean over its tokens;
all ranks hold the same number of tokens, so the gradient average over those ranks is
the gradient of the mean over every token of the global batch
(``shardkit.nn.context_parallel``'s ``[Note: the loss over a split sequence]``).
pipe, offload and ``--moe-experts`` refuse ``--cp`` (:func:`cp_error` says why).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardkit.models import GPT, Block
from shardkit.nn.context_parallel import (
    DistributedAttention,
    RingAttention,
    position_ids,
    split_sequence,
)

CP_METHODS = ("ulysses", "ring")
CP_STRATEGIES = ("ddp", "oss", "sdp", "fsdp", "hsdp")

#: Why the other strategies refuse ``--cp``: each runs the GPT in a way the
#: context-parallel pre-hook and attention do not reach.
_REFUSED = {
    "pipe": "a pipeline stage receives activations, not the token ids the sequence split "
    "and position ids start from, and the stages' replicas reduce over dp only",
    "offload": "OffloadModel runs the GPT as a sequence of slices (shardkit.models."
    "gpt_stages), whose embedding takes no position ids, and averages gradients over "
    "every rank",
}


def cp_error(
    cp: int,
    method: str,
    strategy: str,
    seq_len: int,
    n_head: int,
    tp: int,
    moe: bool,
    sequence_parallel: bool = False,
) -> str | None:
    """Why ``--cp`` does not fit the other flags, or None when it does.

    Args:
        cp: ``--cp``.
        method: ``--cp-method``.
        strategy: ``--strategy``.
        seq_len: ``--seq-len`` (tokens per row, split over the ``cp`` ranks).
        n_head: the GPT's attention heads (``tp`` divides them, :func:`train_gpt.tp_error`);
            Ulysses splits each rank's ``n_head / tp`` over the ``cp`` ranks.
        tp: ``--tp``.
        moe: ``--moe-experts`` > 0.
        sequence_parallel: ``--sequence-parallel``: each rank's ``seq_len / cp`` tokens
            are split again over the ``tp`` ranks. Default False.
    """
    if method not in CP_METHODS:
        return f"--cp-method {method!r}: choose one of {list(CP_METHODS)}"
    if cp == 1:
        return None
    if strategy in _REFUSED:
        return (
            f"--cp {cp} with --strategy {strategy} is not supported ({_REFUSED[strategy]}); "
            f"use --strategy {' / '.join(CP_STRATEGIES)}, or drop --cp"
        )
    if strategy not in CP_STRATEGIES:
        return (
            f"--cp {cp} applies to --strategy {' / '.join(CP_STRATEGIES)}, not {strategy!r}; "
            "use one of them or drop --cp"
        )
    if moe:
        return (
            f"--cp {cp} with --moe-experts is not supported: the experts' gradients are "
            "averaged over the mesh's edp group, which does not hold the cp ranks (they "
            "would drift apart); drop one of them"
        )
    parts = 2 * cp if method == "ring" else cp
    if seq_len % parts:
        return (
            f"--seq-len {seq_len} does not split over --cp {cp} with --cp-method {method} "
            f"({parts} equal chunks); use a --seq-len that is a multiple of {parts}"
        )
    local_heads = n_head // tp if n_head % tp == 0 else n_head  # else tp_error refuses --tp
    if method == "ulysses" and local_heads % cp:
        held = f"{n_head} attention heads" if tp == 1 else f"{local_heads} heads per --tp rank"
        return (
            f"--cp {cp} --cp-method ulysses splits the GPT's {held} over {cp} ranks; "
            f"choose a --cp that divides {local_heads}, or --cp-method ring"
        )
    if sequence_parallel and (seq_len // cp) % tp:
        return (
            f"--sequence-parallel with --cp {cp} splits each rank's {seq_len // cp} tokens "
            f"over --tp {tp}; use a --seq-len that is a multiple of {cp * tp}"
        )
    return None


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def apply_context_parallel(model: GPT, group: dist.ProcessGroup, method: str) -> None:
    """Make ``model`` context parallel over ``group`` (in place): every block's
    attention core and a pre-hook splitting the inputs (see the module docstring)."""
    if method == "ring":
        core: Any = RingAttention(group, causal=True)
    else:  # SDPA's (b, h, s, d): heads on 1, sequence on 2
        core = DistributedAttention(_sdpa_causal, group, scatter_idx=1, gather_idx=2)
    for block in model.blocks:
        assert isinstance(block, Block)
        block.attn.core = core.__call__  # a function: no submodule, the state dict unchanged
    rank, cp, zigzag = dist.get_rank(group), dist.get_world_size(group), method == "ring"

    def split_inputs(
        _: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        names = ("idx", "targets")
        values = {**dict(zip(names, args, strict=False)), **kwargs}
        idx, targets = values["idx"], values.get("targets")
        seq = idx.shape[1]
        local = {
            "targets": None
            if targets is None
            else split_sequence(targets, rank, cp, zigzag=zigzag),
            "position_ids": position_ids(seq, rank, cp, zigzag=zigzag, device=idx.device),
        }
        return (split_sequence(idx, rank, cp, zigzag=zigzag),), local

    model.register_forward_pre_hook(split_inputs, with_kwargs=True)
