"""LayerNorm inside a sequence-parallel region: each rank normalises its chunk of the
sequence with the whole (replicated) weight and bias.

[Note: replicated parameters in a sequence-parallel region]
Under Megatron-LM's sequence parallelism (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4.2.2) a LayerNorm runs on
``(batch, seq / tp, h)``: every tensor-parallel rank holds the same weight but sees only
its ``seq / tp`` positions, so its gradient is a *partial* sum over the sequence.
Megatron-LM marks such parameters ``sequence_parallel=True`` and all-reduces their
gradients over the tensor-parallel group after the backward (a step the training loop
must not forget). Here the sum is part of the autograd graph instead: the forward reads
the weight and bias through :func:`~shardkit.nn.tensor_parallel.copy_to_tensor_parallel_region`
(identity in forward, all-reduce of the gradient in backward), so every rank's gradient
is the whole-sequence gradient after each backward, whatever wraps the model (torch
DDP, FSDP, activation checkpointing, gradient accumulation: each backward adds the
already-summed gradient). The row-parallel bias, added to the sequence chunk after the
reduce-scatter, is read the same way by
:class:`~shardkit.nn.tensor_parallel.RowParallelLinear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.nn.tensor_parallel.groups import TPGroup, resolve_group
from shardkit.nn.tensor_parallel.mappings import copy_to_tensor_parallel_region

__all__ = ["SequenceParallelLayerNorm"]


class SequenceParallelLayerNorm(nn.LayerNorm):
    """An ``nn.LayerNorm`` on this rank's sequence chunk whose weight and bias gradients
    are summed over the tensor-parallel group (``[Note: replicated parameters in a
    sequence-parallel region]``).

    Example:
        >>> ln = SequenceParallelLayerNorm.from_layer_norm(block.ln_1, tp_group)  # doctest: +SKIP
        >>> ln(x_chunk).shape               # (B, T / tp, C), normalised over C

    Built by :func:`~shardkit.nn.tensor_parallel.parallelize` for a
    :class:`~shardkit.nn.tensor_parallel.SequenceParallel` plan entry; its parameters
    and state-dict keys are the LayerNorm's.

    Args:
        normalized_shape: the trailing dimensions normalised over (``nn.LayerNorm``'s).
        eps: added to the variance. Default 1e-5.
        elementwise_affine: learn a weight (and a bias). Default True.
        bias: learn a bias. Default True.
        process_group: the tensor-parallel group; default None (the mesh's, see
            :func:`~shardkit.nn.tensor_parallel.groups.resolve_group`).
        device: of the parameters; default None (CPU).
        dtype: of the parameters; default None (torch's default dtype).

    Shapes: input ``(..., *normalized_shape)``, any number of sequence positions; output
    the same shape.
    """

    def __init__(
        self,
        normalized_shape: int | list[int] | torch.Size,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        process_group: TPGroup = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.process_group = resolve_group(process_group)

    @classmethod
    def from_layer_norm(
        cls, norm: nn.LayerNorm, process_group: TPGroup = None
    ) -> SequenceParallelLayerNorm:
        """The sequence-parallel version of ``norm``, sharing its parameter objects (so
        ties and references to them stay valid)."""
        layer = cls(
            list(norm.normalized_shape),
            norm.eps,
            norm.elementwise_affine,
            bias=norm.bias is not None,
            process_group=process_group,
            device="meta",
        )
        layer.weight, layer.bias = norm.weight, norm.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.process_group
        weight = None if self.weight is None else copy_to_tensor_parallel_region(self.weight, group)
        bias = None if self.bias is None else copy_to_tensor_parallel_region(self.bias, group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)
