"""Column- and row-parallel linear layers (Shoeybi et al. 2019, Megatron-LM, section 3).

``Y = X A + b`` with ``A`` split across the T tensor-parallel ranks:

- :class:`ColumnParallelLinear` splits ``A`` by output features (``A = [A_1 .. A_T]``):
  every rank takes the whole input, computes ``Y_i = X A_i + b_i``, and either keeps
  its slice (``gather_output=False``, the input of a row-parallel layer) or all-gathers
  the full ``Y``.
- :class:`RowParallelLinear` splits ``A`` by input features (``A = [A_1; ..; A_T]``):
  rank i takes ``X_i`` (already split when ``input_is_parallel=True``), computes the
  partial sum ``X_i A_i`` and one all-reduce gives ``Y``; the bias is added after it.

A column-then-row pair (an MLP, or attention split by heads) costs one all-reduce in
forward and one in backward.

With ``sequence_parallel=True`` (Megatron-LM's flag; Korthikanti et al. 2022, section
4.2.2) the activations outside the pair are split along the sequence dimension
(``(b, s / T, h)`` on each rank): the column-parallel layer all-gathers its input along
the sequence instead of ``f``, the row-parallel layer reduce-scatters its output along
the sequence instead of ``g``'s all-reduce, and adds its bias (a replica) to its
sequence chunk, the bias gradient summed over the group (see
``[Note: sequence-parallel regions]`` in :mod:`~shardkit.nn.tensor_parallel.mappings`).

[Note: init_method semantics]
As FairScale (``fairscale.nn.model_parallel.layers``): the full *master* weight is
created and initialised with ``init_method`` on every rank, then each rank keeps its
shard. With the same seed on every rank, the shards together are exactly the weight the
unsplit layer would get from the same seed and ``init_method``, so the tensor-parallel
model's output equals the unsplit model's. The master weight is fp32 and transient
(it costs one full weight of memory during construction). Biases start at zero.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.distributed.shard_descriptor import ranks_of
from shardkit.nn.tensor_parallel.groups import TPGroup, rank_and_size, resolve_group
from shardkit.nn.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from shardkit.nn.tensor_parallel.partition import divide, mark_tensor_parallel, shard
from shardkit.nn.tensor_parallel.universal_layout import record_replica

__all__ = ["ColumnParallelLinear", "InitMethod", "RowParallelLinear"]

#: An in-place initialiser of a full weight, e.g. ``torch.nn.init.xavier_normal_``.
InitMethod = Callable[[torch.Tensor], object]


def _master_shard(
    shape: tuple[int, int],
    init_method: InitMethod,
    dim: int,
    group: TPGroup,
    stride: int,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> tuple[nn.Parameter, torch.Tensor]:
    """Initialise the full fp32 master weight and return (this rank's shard, master),
    the shard marked tensor-parallel over ``group`` along ``dim``."""
    rank, world = rank_and_size(group)
    master = torch.empty(shape, dtype=torch.float32)
    with torch.no_grad():
        init_method(master)
    local = shard(master, dim, rank, world, stride).to(
        dtype=dtype or torch.get_default_dtype(), device=device
    )
    param = nn.Parameter(local)
    mark_tensor_parallel(param, dim, stride, group=group)
    return param, master


class ColumnParallelLinear(nn.Module):
    """A linear layer whose weight is split by output features across tensor-parallel ranks.

    Example:
        >>> fc = ColumnParallelLinear(64, 256, gather_output=False)  # doctest: +SKIP
        >>> fc(x).shape                     # (B, T, 256 / tp)

    Args:
        in_features: input size.
        out_features: output size (all ranks together); divisible by ``tp x stride``.
        bias: add a bias (split like the output). Default True.
        gather_output: all-gather the output so every rank has ``(..., out_features)``;
            False keeps ``(..., out_features / tp)`` for a following
            :class:`RowParallelLinear`. Default True (as FairScale).
        init_method: initialises the full master weight ``(out_features, in_features)``
            in place (see ``[Note: init_method semantics]``). Default
            ``torch.nn.init.xavier_normal_`` (as FairScale).
        stride: interleaved blocks per rank (3 for a fused ``[q | k | v]`` projection
            so each rank gets whole heads of each). Default 1.
        keep_master_weight_for_test: keep the master weight as ``self.master_weight``.
            Default False.
        sequence_parallel: the input is this rank's chunk of the sequence,
            ``(batch, seq / tp, in_features)``, all-gathered along dim 1 before the
            matmul (reduce-scatter of its gradient in backward); the output covers the
            whole sequence. Default False (the input is whole on every rank).
        process_group: the tensor-parallel group; default None (the mesh's, see
            :func:`~shardkit.nn.tensor_parallel.groups.resolve_group`).
        dtype: of the local shard; default None (torch's default dtype).
        device: of the local shard; default None (CPU).

    Shapes: input ``(..., in_features)`` (``(batch, seq / tp, in_features)`` with
    ``sequence_parallel``); output ``(..., out_features)`` or
    ``(..., out_features / tp)`` over the whole sequence. Parameters: ``weight``
    ``(out_features / tp, in_features)``, ``bias`` ``(out_features / tp,)``, marked
    tensor-parallel along dim 0.

    Raises:
        ValueError: ``out_features`` not divisible by ``tp x stride`` (sizes named).

    Source: Shoeybi et al. 2019, "Megatron-LM", section 3 (``f`` then ``X A_i``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = True,
        init_method: InitMethod = nn.init.xavier_normal_,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        *,
        sequence_parallel: bool = False,
        process_group: TPGroup = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.process_group = resolve_group(process_group)
        world = rank_and_size(self.process_group)[1]
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.stride, self.world_size = gather_output, stride, world
        self.sequence_parallel = sequence_parallel
        self.output_size_per_partition = (
            divide(
                out_features, world * stride, f"ColumnParallelLinear out_features {out_features}"
            )
            * stride
        )
        self.weight, master = _master_shard(
            (out_features, in_features), init_method, 0, self.process_group, stride, dtype, device
        )
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(
                torch.zeros(self.output_size_per_partition, dtype=self.weight.dtype, device=device)
            )
            mark_tensor_parallel(self.bias, 0, stride, group=self.process_group)
        else:
            self.register_parameter("bias", None)
        if keep_master_weight_for_test:
            self.master_weight = master

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        gather_output: bool = True,
        stride: int = 1,
        sequence_parallel: bool = False,
        process_group: TPGroup = None,
    ) -> ColumnParallelLinear:
        """The column-parallel version of ``linear``: this rank keeps its shard of
        ``linear``'s weight and bias (``linear`` must be the same on every rank)."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            gather_output=gather_output,
            init_method=lambda w: w.copy_(linear.weight.detach()),
            stride=stride,
            sequence_parallel=sequence_parallel,
            process_group=process_group,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
        )
        if linear.bias is not None and layer.bias is not None:
            rank, world = rank_and_size(layer.process_group)
            with torch.no_grad():
                layer.bias.copy_(shard(linear.bias.detach(), 0, rank, world, stride))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.process_group)
        else:
            x = copy_to_tensor_parallel_region(x, self.process_group)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.process_group)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp={self.world_size}, stride={self.stride}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """A linear layer whose weight is split by input features across tensor-parallel ranks.

    Example:
        >>> proj = RowParallelLinear(256, 64, input_is_parallel=True)  # doctest: +SKIP
        >>> proj(fc(x)).shape               # (B, T, 64), the same on every rank

    Args:
        in_features: input size (all ranks together); divisible by ``tp x stride``.
        out_features: output size.
        bias: add a bias (replicated, added after the all-reduce). Default True.
        input_is_parallel: the input is already this rank's ``(..., in_features / tp)``
            slice (the output of a :class:`ColumnParallelLinear` with
            ``gather_output=False``); False takes the full input and keeps this rank's
            chunk of its last dimension. Default False (as FairScale).
        init_method: initialises the full master weight ``(out_features, in_features)``
            in place. Default ``torch.nn.init.xavier_normal_``.
        stride: interleaved blocks per rank along the input. Default 1.
        keep_master_weight_for_test: keep the master weight as ``self.master_weight``.
        sequence_parallel: reduce-scatter the output along the sequence (dim 1) instead
            of all-reducing it: each rank gets the sum for its chunk of the sequence,
            ``(batch, seq / tp, out_features)``, and adds the bias there (its gradient
            summed over the group in backward, so every rank's is the whole gradient).
            Needs ``input_is_parallel``. Default False.
        process_group: the tensor-parallel group; default None (the mesh's).
        dtype: of the local shard; default None (torch's default dtype).
        device: of the local shard; default None (CPU).

    Shapes: input ``(..., in_features / tp)`` or ``(..., in_features)``; output
    ``(..., out_features)`` (``(batch, seq / tp, out_features)`` with
    ``sequence_parallel``). Parameters: ``weight`` ``(out_features, in_features / tp)``
    marked tensor-parallel along dim 1, ``bias`` ``(out_features,)`` a replica
    (its shard descriptor's replica group is the tensor-parallel group).

    Raises:
        ValueError: ``in_features`` not divisible by ``tp x stride`` (sizes named);
            ``sequence_parallel`` without ``input_is_parallel``; in forward with
            ``sequence_parallel``, a sequence length not divisible by ``tp``.

    Source: Shoeybi et al. 2019, "Megatron-LM", section 3 (``X_i A_i`` then ``g``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        init_method: InitMethod = nn.init.xavier_normal_,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        *,
        sequence_parallel: bool = False,
        process_group: TPGroup = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear(sequence_parallel=True) needs input_is_parallel=True: "
                "its input is the output of a column-parallel layer; pass "
                "input_is_parallel=True"
            )
        self.process_group = resolve_group(process_group)
        world = rank_and_size(self.process_group)[1]
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.stride, self.world_size = input_is_parallel, stride, world
        self.sequence_parallel = sequence_parallel
        self.input_size_per_partition = (
            divide(in_features, world * stride, f"RowParallelLinear in_features {in_features}")
            * stride
        )
        self.weight, master = _master_shard(
            (out_features, in_features), init_method, 1, self.process_group, stride, dtype, device
        )
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(
                torch.zeros(out_features, dtype=self.weight.dtype, device=device)
            )
            # every tensor-parallel rank holds it whole: a replica across the group
            record_replica(self.bias, ranks_of(self.process_group))
        else:
            self.register_parameter("bias", None)
        if keep_master_weight_for_test:
            self.master_weight = master

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        input_is_parallel: bool = False,
        stride: int = 1,
        sequence_parallel: bool = False,
        process_group: TPGroup = None,
    ) -> RowParallelLinear:
        """The row-parallel version of ``linear`` (the same on every rank)."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            input_is_parallel=input_is_parallel,
            init_method=lambda w: w.copy_(linear.weight.detach()),
            stride=stride,
            sequence_parallel=sequence_parallel,
            process_group=process_group,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
        )
        if linear.bias is not None and layer.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(linear.bias.detach())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.process_group)
        partial = F.linear(x, self.weight)
        if not self.sequence_parallel:
            y = reduce_from_tensor_parallel_region(partial, self.process_group)
            return y if self.bias is None else y + self.bias
        y = reduce_scatter_to_sequence_parallel_region(partial, self.process_group)
        if self.bias is None:
            return y
        # each rank's chunk gives a partial bias gradient: summed over the group in backward
        return y + copy_to_tensor_parallel_region(self.bias, self.process_group)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp={self.world_size}, stride={self.stride}, "
            f"input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
