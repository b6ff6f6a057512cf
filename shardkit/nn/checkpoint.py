"""Activation checkpointing that composes with the sharding wrappers.

``checkpoint_wrapper(module)`` makes ``module`` keep none of its intermediate
activations during forward; backward re-runs its forward to recompute them
(re-materialization: Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost"; GPipe, Huang et al. 2019, section 2.3). Memory for activations drops from
O(layers) to O(checkpointed regions), at the cost of one extra forward.

Built on ``torch.utils.checkpoint`` in its non-reentrant mode, so keyword arguments,
non-tensor outputs, inputs that do not require grad, and nesting all work.

[Note: BatchNorm and recomputation]
A BatchNorm in training mode updates its running statistics on every forward, so
the recomputation in backward would update them a second time (FairScale patches
momentum to 0 for this). Here the recompute pass runs inside a context that
snapshots every normalization buffer of the wrapped module on entry and restores it
on exit: the statistics are updated exactly once, whatever the momentum mode
(including ``momentum=None``, the cumulative average, which a zero-momentum patch
would get wrong through ``num_batches_tracked``).

[Note: offload_to_cpu]
With ``offload_to_cpu=True`` the tensors the checkpoint keeps (the region's inputs)
are copied to CPU memory in forward and back to their device in the recompute; on a
CPU-only machine the copy is a no-op and the code path is the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["CheckpointWrapper", "checkpoint_wrapper"]

_NORM_TYPES = (nn.modules.batchnorm._BatchNorm,)


@contextlib.contextmanager
def _frozen_norm_statistics(module: nn.Module) -> Iterator[None]:
    """Restore the buffers of every BatchNorm in ``module`` when the block exits."""
    saved = [
        (buf, buf.detach().clone())
        for sub in module.modules()
        if isinstance(sub, _NORM_TYPES)
        for buf in sub.buffers()
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)


class CheckpointWrapper(nn.Module):
    """A module whose forward is checkpointed (see :func:`checkpoint_wrapper`).

    Attributes:
        module: the wrapped module (parameter names appear under ``module.``;
            state-dict keys do not carry that prefix).
        offload_to_cpu: whether the region's inputs are kept in CPU memory.
    """

    def __init__(self, module: nn.Module, offload_to_cpu: bool = False) -> None:
        super().__init__()
        self.module = module
        self.offload_to_cpu = offload_to_cpu
        # State dicts keep the wrapped module's own keys (no "module." prefix), so a
        # checkpoint of a wrapped model loads into the plain model and back.
        self.register_state_dict_post_hook(_strip_prefix_hook)
        self.register_load_state_dict_pre_hook(_add_prefix_hook)

    def _context_fns(self) -> tuple[contextlib.AbstractContextManager[None], Any]:
        return contextlib.nullcontext(), _frozen_norm_statistics(self.module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        devices = [a.device if isinstance(a, torch.Tensor) else None for a in args]
        if self.offload_to_cpu:
            args = tuple(a.to("cpu") if isinstance(a, torch.Tensor) else a for a in args)
        return checkpoint(
            self._run,
            devices,
            *args,
            use_reentrant=False,
            context_fn=self._context_fns,
            **kwargs,
        )

    def _run(self, devices: list[torch.device | None], *args: Any, **kwargs: Any) -> Any:
        moved = tuple(
            a.to(d) if isinstance(a, torch.Tensor) and d is not None else a
            for a, d in zip(args, devices)
        )
        return self.module(*moved, **kwargs)


def _strip_prefix_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _add_prefix_hook(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False) -> nn.Module:
    """Wrap ``module`` so its activations are recomputed in backward instead of stored.

    Example:
        >>> block = checkpoint_wrapper(nn.Sequential(nn.Linear(8, 8), nn.GELU()))
        >>> y = block(torch.randn(4, 8, requires_grad=True))
        >>> y.sum().backward()   # the Linear + GELU forward runs again here

    Args:
        module: any ``nn.Module``; its forward may take keyword arguments and return
            non-tensor values (tuples, dicts, None).
        offload_to_cpu: keep the checkpointed inputs in CPU memory between forward and
            backward (saves accelerator memory; a no-op on CPU). Default False.

    Returns:
        A :class:`CheckpointWrapper` around ``module``. Its ``state_dict()`` keys are
        ``module``'s own (no extra prefix), so checkpoints move freely between the
        wrapped and plain models. Inside FSDP, wrap the layer before FSDP wraps it
        (``FSDP(checkpoint_wrapper(block))``) so the recompute runs while the unit's
        parameters are gathered.

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``.

    Notes:
        Outputs and gradients equal the unwrapped module's; BatchNorm running
        statistics are updated once per forward, not again in the recompute. Under
        ``torch.no_grad()`` the module runs plainly, without checkpoint overhead.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_wrapper expects an nn.Module, got {type(module).__name__}")
    return CheckpointWrapper(module, offload_to_cpu=offload_to_cpu)
