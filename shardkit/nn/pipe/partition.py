"""Partitioning of an ``nn.Sequential`` into contiguous stages by a balance.

A balance is the number of layers in each partition, in order: ``[2, 3]`` puts layers
0-1 in partition 0 and layers 2-4 in partition 1. Partitions are ``nn.Sequential``
objects that keep the original layer names, so a partition's ``state_dict`` keys are
the plain module's keys for those layers and per-stage states merge back into the
whole model's state dict by a union.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from shardkit.distributed.linear_partition import BalanceError, balance_bounds

__all__ = ["BalanceError", "split_module", "stage_module", "verify_module"]


def verify_module(module: object) -> nn.Sequential:
    """Return ``module`` if it is an ``nn.Sequential`` without repeated layers.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential`` (named, with the fix).
        ValueError: the same layer object appears twice (it would live on two devices).
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            "module must be nn.Sequential to be partitioned (a pipeline needs an "
            f"nn.Sequential); got {type(module).__name__}. Express the "
            "model as nn.Sequential(layer_0, layer_1, ...) whose layers pass one value "
            "(a tensor or a tuple of tensors) to the next"
        )
    ids = [id(layer) for layer in module]
    if len(set(ids)) != len(ids):
        names = [n for n, layer in module.named_children() if ids.count(id(layer)) > 1]
        raise ValueError(
            f"module with duplicate children is not supported: layers {names} are the same "
            "module object; a pipeline needs each once (build a new layer for each position)"
        )
    return module


def verify_balance(balance: Sequence[int], num_layers: int) -> list[int]:
    """Check that ``balance`` is positive integers summing to ``num_layers``.

    Raises:
        BalanceError: naming the balance, its sum and the number of layers, with the fix.
    """
    balance = list(balance)
    if not balance or any(int(b) != b or b < 1 for b in balance):
        raise BalanceError(
            f"balance must be a non-empty list of integers >= 1 (layers per partition); got "
            f"{balance}; compute one with shardkit.nn.pipe.balance_by_size(partitions, "
            "module) or balance_by_time(partitions, module, sample)"
        )
    if sum(balance) != num_layers:
        raise BalanceError(
            f"module has {num_layers} layers, but the sum of balance {balance} is "
            f"{sum(balance)}; use a balance summing to {num_layers}, e.g. "
            f"shardkit.nn.pipe.balance_by_size({len(balance)}, module)"
        )
    return [int(b) for b in balance]


def stage_module(module: nn.Sequential, balance: Sequence[int], index: int) -> nn.Sequential:
    """Partition ``index`` of ``module`` as an ``nn.Sequential`` keeping the layer names.

    The layers are shared with ``module`` (not copied).

    Raises:
        TypeError, ValueError: see :func:`verify_module`.
        BalanceError: see :func:`verify_balance`, or ``index`` out of range.
    """
    verify_module(module)
    balance = verify_balance(balance, len(module))
    if not 0 <= index < len(balance):
        raise BalanceError(f"stage index {index} out of range for {len(balance)} partitions")
    start, stop = balance_bounds(balance)[index]
    named = list(module.named_children())[start:stop]
    return nn.Sequential(OrderedDict(named))


def split_module(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Every partition of ``module`` by ``balance`` (see :func:`stage_module`)."""
    return [stage_module(module, balance, i) for i in range(len(list(balance)))]
