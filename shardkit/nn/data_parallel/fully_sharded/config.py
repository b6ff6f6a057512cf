"""User-facing options of FullyShardedDataParallel, validated once at construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from shardkit.distributed.compression import GradCompressor
from shardkit.nn.data_parallel.fully_sharded.precision import (
    MixedPrecision,
    resolve_mixed_precision,
)

__all__ = [
    "FSDPConfig",
    "ShardingStrategy",
    "resolve_offload",
    "resolve_sharding_strategy",
]


class ShardingStrategy(enum.Enum):
    """What each rank keeps between the phases of a step (torch FSDP's names).

    - ``FULL_SHARD``: parameters, gradients and optimizer state sharded over the
      process group; full parameters exist only around a unit's forward and backward
      (ZeRO-3).
    - ``SHARD_GRAD_OP``: as ``FULL_SHARD``, but full parameters are kept from forward
      to backward (``reshard_after_forward=False``): one all-gather less per unit and
      step, more memory (ZeRO-2-like).
    - ``HYBRID_SHARD``: ``FULL_SHARD`` inside a shard group (a node), replicas across
      shard groups: gradients are reduce-scattered inside the shard group, then each
      rank all-reduces only its 1/S shard across the R replicas.
    - ``HYBRID_SHARD_ZERO2``: ``HYBRID_SHARD`` with full parameters kept from forward
      to backward.
    """

    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    HYBRID_SHARD = enum.auto()
    HYBRID_SHARD_ZERO2 = enum.auto()

    @property
    def hybrid(self) -> bool:
        """True for the strategies with replica groups."""
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)

    @property
    def keeps_params_after_forward(self) -> bool:
        """True where full parameters stay from forward to backward."""
        return self in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.HYBRID_SHARD_ZERO2)


@dataclass(frozen=True)
class FSDPConfig:
    """The options of one FSDP unit (FairScale's argument names and defaults).

    Attributes:
        reshard_after_forward: free the full parameters after the unit's forward and
            all-gather them again before its backward (ZeRO-3). False keeps them from
            forward to backward: one all-gather less per step, more memory. Default True.
        disable_reshard_on_root: keep the root unit's full parameters after forward
            (it is the first unit needed in backward). Default True.
        flatten_parameters: FairScale's flag, accepted either way: each unit
            communicates one flat buffer and exposes the original parameters (names and
            shapes) regardless, so False changes nothing but this attribute. Default True.
        bucket_cap_mb: most megabytes (2**20 bytes) of gradient reduce-scatters in
            flight before the oldest is waited for. Default 25.
        compute_device: device of the full parameters during forward and backward;
            default None: the device of the module's parameters.
        state_dict_device: device of the tensors of ``state_dict()``; default None:
            the compute device.
        state_dict_on_rank_0_only: ``state_dict()`` returns the full state on the
            group's first rank and ``{}`` elsewhere. Default False.
        gradient_predivide_factor: gradients are divided by this factor before the
            reduce-scatter and by ``world_size / factor`` after (averaged, as DDP).
            Default None: 1 (all of the division after the sum).
        mixed_precision: the dtypes of compute, reduction and buffers; None: the
            parameters' own dtype throughout (see :mod:`.precision`). Default None.
        move_params_to_cpu: keep the master shard, its gradient and the optimizer state
            in CPU memory; the shard is copied to ``compute_device`` per unit before its
            all-gather (see :mod:`.placement`). Default False.
        broadcast_buffers: as torch DDP's: before a forward that follows a forward with
            grad enabled outside ``no_sync`` (and before the first), the root broadcasts
            its group's first rank's buffers (BatchNorm statistics) to every rank, one
            broadcast per buffer. Each unit also broadcasts its own buffers once at
            construction, with either value. False: only then (DDP's
            ``forward_sync_buffers=False``); they may drift apart across ranks later.
            Default True.
        sharding_strategy: see :class:`ShardingStrategy`. Default ``FULL_SHARD``.
        grad_compression: compresses the gradient reduction that crosses the slowest
            link: the cross-replica all-reduce with a hybrid strategy (the reduce-scatter
            inside a node stays exact), else the reduce-scatter
            (:mod:`shardkit.distributed.compression`). Default None: exact.
    """

    reshard_after_forward: bool = True
    disable_reshard_on_root: bool = True
    flatten_parameters: bool = True
    bucket_cap_mb: float = 25.0
    compute_device: torch.device | None = None
    state_dict_device: torch.device | None = None
    state_dict_on_rank_0_only: bool = False
    gradient_predivide_factor: float | None = None
    mixed_precision: MixedPrecision | None = None
    move_params_to_cpu: bool = False
    broadcast_buffers: bool = True
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    grad_compression: GradCompressor | None = None

    def __post_init__(self) -> None:
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0 megabytes; got {self.bucket_cap_mb}")
        factor = self.gradient_predivide_factor
        if factor is not None and factor <= 0:
            raise ValueError(f"gradient_predivide_factor must be > 0; got {factor}")

    def divide_factors(self, world_size: int) -> tuple[float, float]:
        """(pre, post) divisors of the gradient sum; their product is ``world_size``."""
        pre = 1.0 if self.gradient_predivide_factor is None else self.gradient_predivide_factor
        return pre, world_size / pre


def resolve_offload(
    move_params_to_cpu: bool, cpu_offload: bool, move_grads_to_cpu: bool | None
) -> bool:
    """FairScale's three offload arguments as one flag (parameters and gradients on CPU).

    ``cpu_offload`` is FairScale's older name of ``move_params_to_cpu``;
    ``move_grads_to_cpu`` defaults to it and may not differ from it.

    Raises:
        ValueError: ``move_grads_to_cpu`` differs from the parameters' placement.
    """
    offload = move_params_to_cpu or cpu_offload
    if move_grads_to_cpu is not None and move_grads_to_cpu != offload:
        raise ValueError(
            f"move_grads_to_cpu={move_grads_to_cpu} with move_params_to_cpu={offload}: the "
            "optimizer steps the master shard where it lives, so its gradient must live there "
            "too; leave move_grads_to_cpu unset (it follows move_params_to_cpu)"
        )
    return offload


def fairscale_config(
    mixed_precision: bool | MixedPrecision | None,
    fp32_reduce_scatter: bool,
    compute_dtype: torch.dtype | None,
    buffer_dtype: torch.dtype | None,
    move_params_to_cpu: bool,
    cpu_offload: bool,
    move_grads_to_cpu: bool | None,
    compute_device: torch.device | str | None,
    state_dict_device: torch.device | str | None,
    **options: object,
) -> FSDPConfig:
    """An :class:`FSDPConfig` from FullyShardedDataParallel's (FairScale's) arguments.

    Raises:
        ValueError: inconsistent arguments (see :func:`resolve_mixed_precision`,
            :func:`resolve_offload`) or an invalid option.
    """
    return FSDPConfig(
        mixed_precision=resolve_mixed_precision(
            mixed_precision, compute_dtype, buffer_dtype, fp32_reduce_scatter
        ),
        move_params_to_cpu=resolve_offload(move_params_to_cpu, cpu_offload, move_grads_to_cpu),
        compute_device=None if compute_device is None else torch.device(compute_device),
        state_dict_device=None if state_dict_device is None else torch.device(state_dict_device),
        **options,  # type: ignore[arg-type]
    )


def resolve_sharding_strategy(strategy: ShardingStrategy | str) -> ShardingStrategy:
    """A :class:`ShardingStrategy` from itself or its name (``"hybrid_shard"``).

    Raises:
        ValueError: an unknown name (the known ones listed).
    """
    if isinstance(strategy, ShardingStrategy):
        return strategy
    try:
        return ShardingStrategy[str(strategy).upper()]
    except KeyError:
        known = [s.name for s in ShardingStrategy]
        raise ValueError(f"unknown sharding_strategy {strategy!r}; use one of {known}") from None
