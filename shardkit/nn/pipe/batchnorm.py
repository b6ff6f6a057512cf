"""Deferred BatchNorm: running statistics over the whole mini-batch, not per micro-batch.

In training mode each micro-batch is normalised with its own statistics (the layer
sees only that micro-batch), but the running mean and variance are updated once per
mini-batch, from statistics accumulated over all ``chunks`` micro-batches, exactly as a
plain BatchNorm over the whole mini-batch would update them (torchgpipe, Kim et al.
2020, section 3.4). Without it, ``chunks`` micro-batches would apply the momentum
``chunks`` times per step with noisier per-micro-batch statistics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from shardkit.nn.pipe.checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm"]


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm whose running statistics cover ``chunks`` consecutive micro-batches.

    Use :meth:`convert_deferred_batch_norm` to swap it in for every BatchNorm of a
    module (``Pipe(..., deferred_batch_norm=True)`` does). Inputs ``(N, C, ...)``; the
    statistics are over every dim but 1. Eval mode behaves as a plain BatchNorm.

    Args:
        num_features: channels ``C``.
        chunks: micro-batches per mini-batch (the running statistics commit after
            this many training forwards).
        eps, momentum, affine: as ``nn.BatchNorm*``; defaults 1e-5, 0.1, True.
    """

    sum: torch.Tensor
    sum_squares: torch.Tensor
    counted: torch.Tensor

    def __init__(
        self,
        num_features: int,
        chunks: int = 1,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.chunks = chunks
        self.seen = 0
        self.register_buffer(
            "sum", torch.zeros(num_features, dtype=torch.float64), persistent=False
        )
        self.register_buffer("sum_squares", torch.zeros_like(self.sum), persistent=False)
        self.register_buffer("counted", torch.zeros((), dtype=torch.float64), persistent=False)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"DeferredBatchNorm expects (N, C, ...) input; got shape {tuple(input.shape)}"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training:
            return super().forward(input)
        if not is_recomputing():
            self._accumulate(input.detach())
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _accumulate(self, x: torch.Tensor) -> None:
        dims = [d for d in range(x.dim()) if d != 1]
        x = x.double()
        self.sum += x.sum(dims)
        self.sum_squares += (x * x).sum(dims)
        self.counted += x.numel() // x.shape[1]
        self.seen += 1
        if self.seen == self.chunks:
            self._commit()

    def _commit(self) -> None:
        """Fold the accumulated mini-batch statistics into the running ones, then reset."""
        n = self.counted
        mean = self.sum / n
        var = (self.sum_squares / n - mean * mean).clamp_min(0) * (n / (n - 1).clamp_min(1))
        assert self.num_batches_tracked is not None and self.running_mean is not None
        assert self.running_var is not None
        self.num_batches_tracked += 1
        m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
        self.running_var.mul_(1 - m).add_(var.to(self.running_var.dtype), alpha=m)
        self.sum.zero_()
        self.sum_squares.zero_()
        self.counted.zero_()
        self.seen = 0

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module, chunks: int = 1) -> nn.Module:
        """``module`` with every BatchNorm (that tracks statistics) replaced by a
        :class:`DeferredBatchNorm` holding the same parameters and buffers; returns the
        module (replaced in place, or a new layer when ``module`` itself is one)."""
        if (
            isinstance(module, _BatchNorm)
            and module.track_running_stats
            and not isinstance(module, cls)
        ):
            new = cls(module.num_features, chunks, module.eps, module.momentum, module.affine)
            new.load_state_dict(module.state_dict(), strict=False)
            if module.affine:
                new.weight, new.bias = module.weight, module.bias
            return new.train(module.training).to(module.running_mean.device)  # type: ignore[union-attr]
        for name, child in module.named_children():
            module.add_module(name, cls.convert_deferred_batch_norm(child, chunks))
        return module
