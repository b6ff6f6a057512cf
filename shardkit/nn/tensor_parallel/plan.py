"""Apply tensor parallelism to an existing model: a plan maps module names to styles.

A plan is a mapping from module-name patterns (``fnmatch``, e.g. ``"blocks.*.mlp.0"``)
to a style: :class:`ColumnParallel` / :class:`RowParallel` replace an ``nn.Linear``,
:class:`VocabParallel` an ``nn.Embedding``, :class:`HeadParallel` divides an attention
module's head count by the degree (its projections are split by their own entries).
:func:`parallelize` replaces the matched modules in place, each rank keeping its shard
of the existing weights, so the result computes what the model computed before.

Weights tied between two matched modules (a GPT's token embedding and LM head) stay
tied when both are split the same way (the same dimension of the same tensor in the
same blocks); a tie split two different ways raises an error.

[Note: the GPT plan]
:func:`gpt_plan` for :class:`shardkit.models.gpt.GPT` (Shoeybi et al. 2019, section 3):
attention is split by heads (the fused ``qkv`` column-parallel with ``stride=3``, so
each rank gets the q, k and v of its ``n_head / tp`` heads; ``proj`` row-parallel), the
MLP column-then-row, the token embedding vocabulary-parallel with the tied LM head
column-parallel over the vocabulary. Per block: one all-reduce after attention and one
after the MLP in forward, one at each block input in backward. LayerNorms, the position
embedding and the row-parallel biases are replicas (identical gradients on every
tensor-parallel rank): :func:`parallelize` records the tensor-parallel group as the
replica group of every tensor it does not split (its shard descriptor, see
:mod:`~shardkit.nn.tensor_parallel.universal_layout`), so a checkpoint writes each
once, whatever data-parallel wrapper is put around the model.

[Note: the GPT plan with sequence parallelism]
``gpt_plan(sequence_parallel=True)`` keeps the residual stream split along the sequence
between the tensor-parallel regions (Korthikanti et al. 2022, section 4.2.2): the
embedding dropout (``drop``) scatters the summed embeddings to ``(b, s / T, h)`` and
runs on the chunk; ``ln_1``, ``ln_2`` and ``ln_f`` become
:class:`~shardkit.nn.tensor_parallel.SequenceParallelLayerNorm`; ``qkv``, ``mlp.0`` and
the LM head all-gather their input along the sequence, ``proj`` and ``mlp.2``
reduce-scatter their output; the MLP's dropout runs on the chunk. The dropouts of the
sequence chunks draw from the RNG tracker's tensor-parallel stream (different positions
on every rank, so they must not share masks; call
:func:`~shardkit.nn.tensor_parallel.model_parallel_manual_seed` when ``dropout > 0``).
Per block: 2 all-gathers and 2 reduce-scatters of ``b x s x h`` in forward and in
backward, the bytes of TP's 4 all-reduces; plus one all-reduce of the LayerNorm and
row-parallel-bias gradients (``6 h`` elements). Outside the blocks: one all-gather more
than TP in backward (the scatter after the embedding; the LM head's input gather and
its reduce-scatter replace one all-reduce).
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from shardkit.distributed.shard_descriptor import ranks_of
from shardkit.nn.tensor_parallel.embedding import VocabParallelEmbedding
from shardkit.nn.tensor_parallel.groups import TPGroup, rank_and_size, resolve_group
from shardkit.nn.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from shardkit.nn.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from shardkit.nn.tensor_parallel.partition import is_tensor_parallel
from shardkit.nn.tensor_parallel.random import get_rng_tracker
from shardkit.nn.tensor_parallel.sequence_parallel import SequenceParallelLayerNorm
from shardkit.nn.tensor_parallel.universal_layout import record_replica

__all__ = [
    "ColumnParallel",
    "HeadParallel",
    "ParallelStyle",
    "RowParallel",
    "SequenceParallel",
    "VocabParallel",
    "gpt_plan",
    "hf_gpt2_plan",
    "parallelize",
]


@dataclass(frozen=True)
class ColumnParallel:
    """Replace an ``nn.Linear`` with :class:`ColumnParallelLinear` (split by output features).

    Attributes:
        gather_output: all-gather the output. Default False (a row-parallel layer follows).
        stride: interleaved blocks (3 for a fused ``[q | k | v]``). Default 1.
        sequence_parallel: the input is a sequence chunk, all-gathered along dim 1
            (:class:`ColumnParallelLinear`'s ``sequence_parallel``). Default False.
    """

    gather_output: bool = False
    stride: int = 1
    sequence_parallel: bool = False


@dataclass(frozen=True)
class RowParallel:
    """Replace an ``nn.Linear`` with :class:`RowParallelLinear` (split by input features).

    Attributes:
        input_is_parallel: the input is a column-parallel output. Default True.
        sequence_parallel: reduce-scatter the output along the sequence (dim 1) instead
            of all-reducing it (:class:`RowParallelLinear`'s ``sequence_parallel``).
            Default False.
    """

    input_is_parallel: bool = True
    sequence_parallel: bool = False


@dataclass(frozen=True)
class VocabParallel:
    """Replace an ``nn.Embedding`` with :class:`VocabParallelEmbedding`."""


@dataclass(frozen=True)
class HeadParallel:
    """Divide an attention module's head count (and any other per-rank sizes) by the
    degree; its forward must size its views from these attributes or from the local
    projection, as the GPT's and Hugging Face GPT-2's do.

    Attributes:
        attribute: the module attribute holding the number of heads. Default ``"n_head"``.
        also: further attributes divided by the degree (Hugging Face GPT-2:
            ``("split_size",)``, the width of each of q, k, v). Default none.
        fork_rng: in training mode, run the module's forward inside the model-parallel
            RNG tracker's fork (``[Note: two random streams]`` in
            :mod:`~shardkit.nn.tensor_parallel.random`), so the attention dropout of
            different tensor-parallel ranks is independent. Only for a module whose
            every random draw is on its own heads (the GPT's attention, not Hugging
            Face GPT-2's, which also drops its replicated output). Needs
            :func:`~shardkit.nn.tensor_parallel.model_parallel_manual_seed`. Default False.
    """

    attribute: str = "n_head"
    also: tuple[str, ...] = ()
    fork_rng: bool = False


@dataclass(frozen=True)
class SequenceParallel:
    """Run a module on this rank's chunk of the sequence (dim 1): a LayerNorm (replaced
    by :class:`SequenceParallelLayerNorm`, its gradients summed over the group) or a
    module without parameters (dropout, an activation), Megatron-LM's sequence-parallel
    region (Korthikanti et al. 2022, section 4.2.2).

    Attributes:
        scatter_input: split the module's first input along the sequence before it runs
            (:func:`~shardkit.nn.tensor_parallel.scatter_to_sequence_parallel_region`):
            where the region starts from an activation every rank holds whole (the
            GPT's embedding dropout). Default False (the input is already a chunk).
        fork_rng: in training mode, run the forward inside the RNG tracker's fork
            (``[Note: two random streams]`` in
            :mod:`~shardkit.nn.tensor_parallel.random`): a dropout on a sequence chunk
            draws independent masks on each rank. An ``nn.Dropout`` of probability 0
            draws nothing and gets no fork. Needs
            :func:`~shardkit.nn.tensor_parallel.model_parallel_manual_seed`. Default False.
    """

    scatter_input: bool = False
    fork_rng: bool = False


_FORKS = "_tensor_parallel_rng_forks"


def _enter_rng_fork(module: nn.Module, args: object) -> None:
    """Forward pre-hook of a ``HeadParallel(fork_rng=True)`` module."""
    if module.training:
        fork = get_rng_tracker().fork()
        fork.__enter__()
        module.__dict__.setdefault(_FORKS, []).append(fork)


def _exit_rng_fork(module: nn.Module, args: object, output: object) -> None:
    """Forward hook (also called when forward raises): leave the fork entered before."""
    forks = module.__dict__.get(_FORKS)
    if forks:
        forks.pop().__exit__(None, None, None)


def _register_fork(module: nn.Module) -> None:
    """Run ``module``'s forward inside the tracker's fork in training mode."""
    module.register_forward_pre_hook(_enter_rng_fork)
    module.register_forward_hook(_exit_rng_fork, always_call=True)


class _ScatterInput:
    """Forward pre-hook of a ``SequenceParallel(scatter_input=True)`` module: its first
    input replaced by this rank's sequence chunk."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group

    def __call__(self, module: nn.Module, args: tuple[object, ...]) -> tuple[object, ...]:
        first, *rest = args
        assert isinstance(first, torch.Tensor)
        return (scatter_to_sequence_parallel_region(first, self.group), *rest)


def _sequence_parallel(
    module: nn.Module, name: str, style: SequenceParallel, group: TPGroup
) -> nn.Module:
    if isinstance(module, nn.LayerNorm):
        module = SequenceParallelLayerNorm.from_layer_norm(module, group)
    elif any(True for _ in module.parameters()):
        raise TypeError(
            f"plan entry {style} matched {name!r}, a {type(module).__name__} with "
            "parameters; on a sequence chunk only a LayerNorm (its gradients summed over "
            "the group) or a module without parameters (dropout, activation) can run"
        )
    if style.scatter_input:
        module.register_forward_pre_hook(_ScatterInput(group))
    zero_dropout = isinstance(module, nn.Dropout) and module.p == 0.0
    if style.fork_rng and not zero_dropout:
        _register_fork(module)
    return module


ParallelStyle = ColumnParallel | RowParallel | VocabParallel | HeadParallel | SequenceParallel

#: tied weights seen so far: id of the original tensor -> (dim, stride, the shard, the
#: original, kept alive so that its id is not reused by another tensor)
_Ties = dict[int, tuple[int, int, nn.Parameter, torch.Tensor]]


def _expect(module: nn.Module, cls: type, name: str, style: ParallelStyle) -> None:
    if not isinstance(module, cls):
        raise TypeError(
            f"plan entry {style} matched {name!r}, a {type(module).__name__}; it applies "
            f"to {cls.__name__} only"
        )


def _tie(
    ties: _Ties, original: torch.Tensor, new: nn.Parameter, dim: int, stride: int
) -> nn.Parameter:
    """The shard to use for ``original``: the one made earlier if it is tied, else ``new``."""
    key = id(original)
    if key not in ties:
        ties[key] = (dim, stride, new, original)
        return new
    tied_dim, tied_stride, shard, _ = ties[key]
    if (tied_dim, tied_stride) != (dim, stride):
        raise ValueError(
            f"a tied weight is split along dim {tied_dim} (stride {tied_stride}) by one "
            f"module and along dim {dim} (stride {stride}) by another; split both the same way"
        )
    return shard


def _as_linear(module: nn.Module) -> nn.Module:
    """A Hugging Face ``Conv1D`` (a linear layer with its weight stored ``(in, out)``) as
    the ``nn.Linear`` it computes (weight transposed to ``(out, in)``); else ``module``.

    Detected by name and shape, so that ``shardkit.nn`` does not import transformers.
    """
    weight = getattr(module, "weight", None)
    if type(module).__name__ != "Conv1D" or not isinstance(weight, torch.Tensor):
        return module
    bias = getattr(module, "bias", None)
    linear = nn.Linear(
        weight.shape[0],
        weight.shape[1],
        bias=bias is not None,
        dtype=weight.dtype,
        device=weight.device,
    )
    with torch.no_grad():
        linear.weight.copy_(weight.t())
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


def _apply(
    module: nn.Module, name: str, style: ParallelStyle, group: TPGroup, ties: _Ties
) -> nn.Module:
    if isinstance(style, HeadParallel):
        heads = getattr(module, style.attribute)
        world = rank_and_size(group)[1]
        if heads % world != 0:
            raise ValueError(
                f"{name!r} has {style.attribute}={heads} attention heads, not divisible by "
                f"the tensor-parallel degree {world}; choose a degree that divides {heads}"
            )
        setattr(module, style.attribute, heads // world)
        for attribute in style.also:
            setattr(module, attribute, getattr(module, attribute) // world)
        if style.fork_rng:
            _register_fork(module)
        return module
    if isinstance(style, SequenceParallel):
        return _sequence_parallel(module, name, style, group)
    if isinstance(style, VocabParallel):
        _expect(module, nn.Embedding, name, style)
        assert isinstance(module, nn.Embedding)
        emb = VocabParallelEmbedding.from_embedding(module, process_group=group)
        emb.weight = _tie(ties, module.weight, emb.weight, 0, 1)
        return emb
    original = getattr(module, "weight", None)
    module = _as_linear(module)
    _expect(module, nn.Linear, name, style)
    assert isinstance(module, nn.Linear) and isinstance(original, torch.Tensor)
    if isinstance(style, ColumnParallel):
        col = ColumnParallelLinear.from_linear(
            module,
            gather_output=style.gather_output,
            stride=style.stride,
            sequence_parallel=style.sequence_parallel,
            process_group=group,
        )
        col.weight = _tie(ties, original, col.weight, 0, style.stride)
        return col
    row = RowParallelLinear.from_linear(
        module,
        input_is_parallel=style.input_is_parallel,
        sequence_parallel=style.sequence_parallel,
        process_group=group,
    )
    row.weight = _tie(ties, original, row.weight, 1, 1)
    return row


def parallelize(
    model: nn.Module, plan: Mapping[str, ParallelStyle], process_group: TPGroup = None
) -> nn.Module:
    """Apply ``plan`` to ``model`` in place and return it.

    Modules are visited in ``named_modules`` order; the first pattern that matches a
    module's qualified name decides its style. ``model`` must be the same on every rank
    (same seed, or loaded weights): each rank keeps its shard of the existing weights.
    Every parameter and buffer left whole is recorded as a replica across the
    tensor-parallel group (its shard descriptor's replica group), so that a checkpoint
    writes it once.

    Args:
        model: the model; its matched modules are replaced.
        plan: module-name pattern -> style.
        process_group: the tensor-parallel group; default None (the mesh's).

    Returns:
        ``model``.

    Raises:
        ValueError: a pattern matched nothing (a typo in the plan), a size not divisible
            by the degree (heads, features or vocabulary, sizes named), or a tied
            weight split two ways.
        TypeError: a style matched a module of the wrong type.
    """
    group = resolve_group(process_group)
    used: set[str] = set()
    ties: _Ties = {}
    for name, module in list(model.named_modules()):
        pattern = next((p for p in plan if fnmatch.fnmatchcase(name, p)), None)
        if pattern is None:
            continue
        used.add(pattern)
        new = _apply(module, name, plan[pattern], group, ties)
        if new is not module:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, new)
    unused = [p for p in plan if p not in used]
    if unused:
        raise ValueError(f"plan patterns matched no module: {unused}")
    if group is not None:
        replicas = ranks_of(group)
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            if not is_tensor_parallel(tensor):
                record_replica(tensor, replicas)
    return model


def gpt_plan(
    loss_parallel: bool = False, fork_rng: bool = False, sequence_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The plan for :class:`shardkit.models.gpt.GPT` (see ``[Note: the GPT plan]``).

    Args:
        loss_parallel: keep the logits vocabulary-parallel ``(B, T, V / tp)`` for
            :func:`~shardkit.nn.tensor_parallel.vocab_parallel_cross_entropy` (call the
            model without targets); False all-gathers them to ``(B, T, V)`` so the
            model's own loss works unchanged. Default False.
        fork_rng: attention dropout from the RNG tracker's tensor-parallel stream
            (independent across tensor-parallel ranks, as Megatron-LM); the MLP's dropout
            stays on the default stream (the same on every tensor-parallel rank). For a
            GPT with ``dropout > 0``; call
            :func:`~shardkit.nn.tensor_parallel.model_parallel_manual_seed` first.
            Default False.
        sequence_parallel: Megatron-LM's sequence parallelism (``[Note: the GPT plan
            with sequence parallelism]``): LayerNorms, dropouts and the residual stream
            on ``(b, s / tp, h)`` chunks, the same outputs and gradients and the same
            bytes per block as without it, less activation memory. The sequence length
            must be divisible by ``tp`` (a ``ValueError`` at the first forward
            otherwise). Default False.
    """
    sp = sequence_parallel
    plan: dict[str, ParallelStyle] = {
        "wte": VocabParallel(),
        "blocks.*.attn": HeadParallel("n_head", fork_rng=fork_rng),
        "blocks.*.attn.qkv": ColumnParallel(stride=3, sequence_parallel=sp),
        "blocks.*.attn.proj": RowParallel(sequence_parallel=sp),
        "blocks.*.mlp.0": ColumnParallel(sequence_parallel=sp),
        "blocks.*.mlp.2": RowParallel(sequence_parallel=sp),
        "lm_head": ColumnParallel(gather_output=not loss_parallel, sequence_parallel=sp),
    }
    if sp:
        plan |= {
            "drop": SequenceParallel(scatter_input=True, fork_rng=True),
            "blocks.*.ln_1": SequenceParallel(),
            "blocks.*.ln_2": SequenceParallel(),
            "blocks.*.mlp.3": SequenceParallel(fork_rng=True),
            "ln_f": SequenceParallel(),
        }
    return plan


def hf_gpt2_plan(
    loss_parallel: bool = False, prefix: str = "transformer."
) -> dict[str, ParallelStyle]:
    """The plan for Hugging Face GPT-2 (``GPT2LMHeadModel``; ``prefix=""`` for a bare
    ``GPT2Model``, which has no ``lm_head``): the same split as :func:`gpt_plan`.

    The ``Conv1D`` projections become column- / row-parallel ``nn.Linear`` layers, so
    their weights are stored ``(out, in)`` afterwards (transposed from Hugging Face's
    ``(in, out)``): a consolidated state dict of the split model has that layout.

    Args:
        loss_parallel: keep the logits vocabulary-parallel (see :func:`gpt_plan`).
            Default False.
        prefix: the name of the ``GPT2Model`` inside the model, with a trailing dot.
            Default ``"transformer."``.
    """
    plan: dict[str, ParallelStyle] = {
        f"{prefix}wte": VocabParallel(),
        f"{prefix}h.*.attn": HeadParallel("num_heads", also=("split_size",)),
        f"{prefix}h.*.attn.c_attn": ColumnParallel(stride=3),
        f"{prefix}h.*.attn.c_proj": RowParallel(),
        f"{prefix}h.*.mlp.c_fc": ColumnParallel(),
        f"{prefix}h.*.mlp.c_proj": RowParallel(),
    }
    if prefix:
        plan["lm_head"] = ColumnParallel(gather_output=not loss_parallel)
    return plan
