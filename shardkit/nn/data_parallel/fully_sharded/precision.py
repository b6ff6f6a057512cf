"""Mixed precision of FSDP: the policy, FairScale's arguments mapped onto it, the casts.

[Note: what each dtype governs]
A unit keeps its *master* shard in the parameters' own dtype (fp32 for a model built
in fp32); the optimizer steps it and its state is created in that dtype. Only
copies are made in lower precision:

- ``param_dtype`` (the *compute dtype*): before an all-gather the local shard is cast
  to it, so the all-gather moves ``param_dtype`` bytes and forward and backward run
  with full parameters in ``param_dtype``. Their gradients come out in it too.
- ``reduce_dtype``: the flat gradient is cast to it before the reduce-scatter (fp32
  for an exact sum of low-precision gradients, at twice the traffic); the reduced
  shard is cast to the master dtype and accumulated into the sharded ``.grad``.
- ``buffer_dtype``: floating buffers are cast to it once, at construction; state
  dicts return them in their original dtype.

Floating-point inputs of a unit's forward are cast to ``param_dtype``
(``cast_forward_inputs``), other inputs (token ids, masks) are left alone: FairScale
casts every input to fp16, which breaks bf16 models and integer inputs.

Source: Micikevicius et al. 2018, "Mixed Precision Training", section 3 (fp32
master weights, reduced-precision compute); FairScale's FSDP arguments and torch's
FSDP2 ``MixedPrecisionPolicy`` (the policy object).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

__all__ = [
    "BufferCast",
    "MixedPrecision",
    "cast_buffers",
    "cast_floating",
    "original_buffer_dtypes",
    "resolve_mixed_precision",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_dtype(what: str, dtype: torch.dtype | None) -> None:
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{what} must be one of {[str(d) for d in _FLOAT_DTYPES]} or None; got {dtype!r}"
        )


@dataclass(frozen=True)
class MixedPrecision:
    """Which dtypes an FSDP unit computes, reduces and keeps buffers in.

    Example:
        >>> policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        >>> model = FSDP(model, mixed_precision=policy)

    Attributes:
        param_dtype: dtype of the full parameters in forward and backward (the compute
            dtype); the all-gather moves this dtype. Default None: the parameters' own
            dtype (no cast).
        reduce_dtype: dtype of the gradient reduce-scatter. Default None: ``param_dtype``.
        buffer_dtype: dtype floating buffers are cast to at wrapping. Default None:
            buffers keep their dtype.
        cast_forward_inputs: cast floating-point tensors among the forward's arguments
            to ``param_dtype``; integer and bool tensors are never cast. Default True.

    The master shard, its gradient and the optimizer state stay in the parameters'
    own dtype (fp32). See [Note: what each dtype governs].

    Raises:
        ValueError: a dtype that is not a floating-point dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        _check_dtype("param_dtype", self.param_dtype)
        _check_dtype("reduce_dtype", self.reduce_dtype)
        _check_dtype("buffer_dtype", self.buffer_dtype)

    def compute_dtype(self, master: torch.dtype) -> torch.dtype:
        """The full parameters' dtype for a master shard of dtype ``master``."""
        return master if self.param_dtype is None else self.param_dtype

    def gradient_dtype(self, master: torch.dtype) -> torch.dtype:
        """The reduce-scatter's dtype for a master shard of dtype ``master``."""
        return self.compute_dtype(master) if self.reduce_dtype is None else self.reduce_dtype


def resolve_mixed_precision(
    mixed_precision: bool | MixedPrecision | None,
    compute_dtype: torch.dtype | None,
    buffer_dtype: torch.dtype | None,
    fp32_reduce_scatter: bool,
) -> MixedPrecision | None:
    """FairScale's arguments (or a policy) as one :class:`MixedPrecision`, or None (no
    casts). ``mixed_precision=None`` is ``False``.

    FairScale's ``mixed_precision=True, compute_dtype=c (default fp16), buffer_dtype=b
    (default c), fp32_reduce_scatter=f`` is
    ``MixedPrecision(param_dtype=c, reduce_dtype=fp32 if f else c, buffer_dtype=b)``.

    Raises:
        ValueError: a policy object combined with ``compute_dtype``, ``buffer_dtype`` or
            ``fp32_reduce_scatter``; one of those without ``mixed_precision=True``.
    """
    loose = {
        "compute_dtype": compute_dtype,
        "buffer_dtype": buffer_dtype,
        "fp32_reduce_scatter": fp32_reduce_scatter or None,
    }
    given = [name for name, value in loose.items() if value is not None]
    if isinstance(mixed_precision, MixedPrecision):
        if given:
            raise ValueError(
                f"mixed_precision is a MixedPrecision policy; {given} would override it. Put "
                "the dtypes in the policy (param_dtype, reduce_dtype, buffer_dtype) instead"
            )
        return mixed_precision
    if not mixed_precision:
        if given:
            raise ValueError(
                f"{given} need mixed_precision=True (or pass "
                "mixed_precision=MixedPrecision(param_dtype=..., reduce_dtype=...))"
            )
        return None
    compute = torch.float16 if compute_dtype is None else compute_dtype
    return MixedPrecision(
        param_dtype=compute,
        reduce_dtype=torch.float32 if fp32_reduce_scatter else compute,
        buffer_dtype=compute if buffer_dtype is None else buffer_dtype,
    )


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` (args, kwargs; nested containers) with floating tensors cast to ``dtype``.

    Integer, bool and complex tensors and non-tensors are returned as they are.
    """

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            return value.to(dtype)
        return value

    return tree_map(cast, tree)


@dataclass
class BufferCast:
    """One floating buffer a unit cast: ``module._buffers[attr]``, originally ``dtype``."""

    module: nn.Module
    attr: str
    dtype: torch.dtype


def cast_buffers(buffers: list[tuple[nn.Module, str]], dtype: torch.dtype) -> list[BufferCast]:
    """Cast the floating buffers among ``(module, attr)`` to ``dtype``; what was cast."""
    done = []
    for module, attr in buffers:
        buf = module._buffers[attr]
        if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
            done.append(BufferCast(module, attr, buf.dtype))
            module._buffers[attr] = buf.to(dtype)
    return done


@contextlib.contextmanager
def original_buffer_dtypes(casts: list[BufferCast]) -> Iterator[None]:
    """Inside, the cast buffers are in their original dtypes (state dicts see those)."""
    lowered = [(c, c.module._buffers[c.attr]) for c in casts]
    for cast, buf in lowered:
        assert buf is not None
        cast.module._buffers[cast.attr] = buf.to(cast.dtype)
    try:
        yield
    finally:
        for cast, buf in lowered:
            assert buf is not None
            restored = cast.module._buffers[cast.attr]
            assert restored is not None
            with torch.no_grad():  # a load inside the context lands in the lowered buffer
                buf.copy_(restored)
            cast.module._buffers[cast.attr] = buf
