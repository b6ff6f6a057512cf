"""Balancing: choose how many layers each partition gets, by parameter size or by time.

Both helpers reduce a model to one cost per layer and then solve the contiguous
partition problem with the one validated solver shared with OffloadModel,
:func:`solve_balance` (re-exported from :mod:`shardkit.distributed.linear_partition`):
cut the list of costs into
``partitions`` non-empty runs so that the largest run sum is as small as possible
(the slowest stage sets the pipeline's pace; GPipe, Huang et al. 2019, section 2.2).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from shardkit.distributed.linear_partition import solve_balance
from shardkit.nn.pipe.microbatch import Batch, TensorOrTensors, check_value
from shardkit.nn.pipe.partition import verify_module

__all__ = ["balance_by_size", "balance_by_time", "layer_sizes", "layer_times", "solve_balance"]


def layer_sizes(module: nn.Sequential) -> list[int]:
    """Bytes of parameters and buffers per layer; a shared tensor counts in its first layer.
    Works on the meta device (sizes from shapes and dtypes)."""
    seen: set[int] = set()
    sizes = []
    for layer in verify_module(module):
        size = 0
        for t in [*layer.parameters(), *layer.buffers()]:
            # meta tensors have no storage (every data_ptr is 0): a shared one is one object
            key = t.untyped_storage().data_ptr() if t.numel() and not t.is_meta else id(t)
            if key not in seen:
                seen.add(key)
                size += t.numel() * t.element_size()
        sizes.append(size)
    return sizes


def balance_by_size(partitions: int, module: nn.Sequential) -> list[int]:
    """A balance giving each partition about the same bytes of parameters and buffers.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))
        >>> balance_by_size(2, model)
        [2, 1]

    Args:
        partitions: number of partitions (devices or stages).
        module: the model to split.

    Returns:
        Layers per partition (see :func:`solve_balance`). Use when memory, not time,
        limits the model; activations are not counted.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        BalanceError: more partitions than layers.
    """
    return solve_balance(layer_sizes(module), partitions)


def layer_times(
    module: nn.Sequential, sample: TensorOrTensors, *, timeout_s: float = 1.0
) -> list[float]:
    """Median seconds of forward + backward per layer on ``sample``, run repeatedly.

    Each layer is timed on the output of the previous one; after one untimed warm-up
    pass, repeats continue until ``timeout_s`` seconds have passed (at least one).
    Gradients the timing creates are cleared afterwards.
    """
    module = verify_module(module)
    _time_layers(module, sample, [[] for _ in module])  # warm-up: allocators, kernels
    runs: list[list[float]] = [[] for _ in module]
    deadline = time.perf_counter() + timeout_s
    while not runs[0] or time.perf_counter() < deadline:
        _time_layers(module, sample, runs)
    module.zero_grad(set_to_none=True)
    return [sorted(r)[len(r) // 2] for r in runs]


def _time_layers(module: nn.Sequential, sample: TensorOrTensors, runs: list[list[float]]) -> None:
    """One forward + backward per layer on ``sample``, appending seconds to ``runs``."""
    batch = Batch(check_value(sample, "sample"))
    for i, layer in enumerate(module):
        inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in batch.tensors]
        start = time.perf_counter()
        out = Batch(check_value(layer(batch.with_tensors(inputs).value), "layer output"))
        grads = [t for t in out.tensors if t.requires_grad]
        if grads:
            torch.autograd.backward(grads, [torch.ones_like(t) for t in grads])
        runs[i].append(time.perf_counter() - start)
        batch = out


def balance_by_time(
    partitions: int, module: nn.Sequential, sample: TensorOrTensors, *, timeout_s: float = 1.0
) -> list[int]:
    """A balance giving each partition about the same measured forward + backward time.

    Example:
        >>> model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
        >>> sum(balance_by_time(2, model, torch.randn(16, 32), timeout_s=0.1))
        4

    Args:
        partitions: number of partitions (devices or stages).
        module: the model to split; timed on the device its parameters are on.
        sample: a representative micro-batch (a tensor or tuple of tensors).
        timeout_s: seconds to spend timing (repeats; medians are used). Default 1.0.

    Returns:
        Layers per partition (see :func:`solve_balance`).

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential`` or ``sample`` not tensors.
        BalanceError: more partitions than layers.
    """
    return solve_balance(layer_times(module, sample, timeout_s=timeout_s), partitions)
