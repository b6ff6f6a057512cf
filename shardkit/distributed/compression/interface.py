"""The compressor interface: :class:`GradCompressor` (exact), its error-feedback
state per key, and the shared checks of every compressor.

[Note: the contract]
- Every method returns the **sum** over the ranks of the group of their input tensors
  (no division): callers that want DDP's mean divide their input by the group size
  first, as every shardkit path does (that also keeps fp16 sums from overflowing).
- The methods are **synchronous**: the result is complete when the call returns (a
  lossy method issues two collectives, the second depending on the first). A caller
  that overlaps communication with compute calls it where it would wait.
- ``all_reduce(tensor)`` writes the sum into ``tensor`` (in place) and returns it.
- ``reduce(tensor, dst)`` writes the sum into ``tensor`` on the rank ``dst`` (a
  *global* rank, as ``torch.distributed.reduce`` takes); on the other ranks
  ``tensor`` is scratch afterwards (exact and half-precision: as torch's reduce
  leaves it; lossy ones: it holds the same sum, as they all-reduce).
- ``reduce_scatter(output, input)``: ``input`` is ``(N * S,)`` elements, ``output``
  ``(S,)``; group rank r receives the sum of elements ``[r S, (r + 1) S)``. ``input``
  is left as it was (lossy ones) or as the backend leaves it (exact, half).
- Every rank of the group calls the same method with the same ``key``, the same
  number of elements and the same ``shapes``, in the same order (the collectives
  must match). Float tensors only (fp32, fp16, bf16); lossy compressors compute in
  fp32 and write back in the tensor's dtype.

[Note: error feedback]
A lossy compressor sends C(g + e) instead of g and keeps the part it did not send,
``e <- (g + e) - C(g + e)``, for the next call with the same key (Seide et al. 2014,
"1-bit SGD"; Karimireddy et al. 2019, "Error Feedback Fixes SignSGD"; Vogels et al.
2019, "PowerSGD", section 3 / Algorithm 2). Nothing is lost, only delayed: that is
what lets rank-1 PowerSGD or 8-bit reductions train to the same loss. State is one
fp32 tensor of the input's size per key (an extra psi of fp32 per rank for a whole
model), dropped when a key comes back with another number of elements or shapes
(a re-bucketing), and by :meth:`GradCompressor.reset`. ``error_feedback=False``
turns it off (each call compresses its input alone).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GradCompressor", "IdentityCompressor", "Shapes"]

Shapes = Sequence[Sequence[int]] | None


def _check_flat(tensor: torch.Tensor, what: str) -> None:
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(
            f"{what} must be a contiguous 1-D (flat) tensor; got shape {tuple(tensor.shape)}"
            f"{'' if tensor.is_contiguous() else ' (not contiguous)'}"
        )
    if not tensor.is_floating_point():
        raise TypeError(f"{what} must be a float tensor (fp32, fp16, bf16); got {tensor.dtype}")


def _check_shapes(shapes: Shapes, numel: int) -> None:
    if shapes is None:
        return
    total = sum(math.prod(s) for s in shapes)
    if total != numel:
        raise ValueError(
            f"shapes {[tuple(s) for s in shapes][:6]} hold {total} elements but the flat "
            f"tensor has {numel}: shapes must describe its consecutive pieces exactly"
        )


def _scatter_sizes(input: torch.Tensor, output: torch.Tensor, n: int) -> int:
    _check_flat(input, "reduce_scatter input")
    _check_flat(output, "reduce_scatter output")
    if input.numel() != n * output.numel():
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements, which is not the group "
            f"size ({n}) times output's {output.numel()}"
        )
    return output.numel()


class GradCompressor:
    """Reduce (sum) a flat gradient over a process group, possibly compressed.

    The base class is exact (:class:`IdentityCompressor` is it under its own name):
    the methods are ``torch.distributed``'s own collectives, so a path with the
    identity compressor gives bitwise the values of the same path without one. See
    the module's [Note: the contract] for what every compressor guarantees.

    Attributes:
        name: short name (``"identity"``, ``"bf16"``, ``"powersgd"``, ``"int8"``).
        exact: True when the result equals the uncompressed sum (up to the
            backend's order of additions).
        error_feedback: whether a lossy compressor keeps what it did not send (see
            [Note: error feedback]); False for exact ones.
    """

    name = "identity"
    exact = True

    def __init__(self, error_feedback: bool = False) -> None:
        self.error_feedback = error_feedback
        self._errors: dict[Hashable, torch.Tensor] = {}
        self._signatures: dict[Hashable, tuple[Any, ...]] = {}

    # public interface -------------------------------------------------------------
    def all_reduce(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup | None = None,
        *,
        key: Hashable = None,
        shapes: Shapes = None,
    ) -> torch.Tensor:
        """Sum ``tensor`` (flat, n elements) over ``group``, in place; return it.

        Args:
            tensor: the flat gradient ``(n,)``, float.
            group: the process group; default None (the world group).
            key: names this reduction (e.g. ``("sdp", bucket_index)``): the state of
                error feedback and warm start is kept per key. Needed by a lossy
                compressor with error feedback; ignored by exact ones.
            shapes: shapes of the consecutive pieces of ``tensor`` (each parameter's
                gradient); their elements must add up to n. Used by PowerSGD (a piece
                of 2 or more dimensions is a matrix); default None (one piece).

        Returns:
            ``tensor``, holding the sum over the group's ranks.

        Raises:
            ValueError: ``tensor`` not 1-D and contiguous; ``shapes`` not adding up to
                n; a lossy compressor with error feedback and no ``key``.
            TypeError: ``tensor`` not a float tensor.
        """
        _check_flat(tensor, "all_reduce tensor")
        _check_shapes(shapes, tensor.numel())
        if tensor.numel() == 0 or dist.get_world_size(group) == 1:
            return tensor
        self._all_reduce(tensor, group, key, shapes)
        return tensor

    def reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        group: dist.ProcessGroup | None = None,
        *,
        key: Hashable = None,
        shapes: Shapes = None,
    ) -> torch.Tensor:
        """Sum ``tensor`` over ``group`` into ``tensor`` on global rank ``dst``; return it.

        On the other ranks ``tensor`` is scratch afterwards. Arguments and errors as
        :meth:`all_reduce`; ``dst`` is a *global* rank (as ``torch.distributed.reduce``).
        """
        _check_flat(tensor, "reduce tensor")
        _check_shapes(shapes, tensor.numel())
        if tensor.numel() == 0 or dist.get_world_size(group) == 1:
            return tensor
        self._reduce(tensor, dst, group, key, shapes)
        return tensor

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup | None = None,
        *,
        key: Hashable = None,
        shapes: Shapes = None,
    ) -> torch.Tensor:
        """Sum ``input`` ``(N * S,)`` over ``group``; group rank r gets elements
        ``[r S, (r + 1) S)`` of the sum in ``output`` ``(S,)``; return ``output``.

        ``shapes`` describe ``input`` (the full flat gradient, padding included as a
        last vector piece if any). Other arguments and errors as :meth:`all_reduce`;
        also raises ValueError when ``input`` is not N times ``output``'s size.
        """
        n = dist.get_world_size(group)
        _scatter_sizes(input, output, n)
        _check_shapes(shapes, input.numel())
        if output.numel() == 0:
            return output
        if n == 1:
            output.copy_(input)
            return output
        self._reduce_scatter(output, input, group, key, shapes)
        return output

    def reset(self, key: Hashable = None) -> None:
        """Forget the state (error feedback, warm start) of ``key``, or of every key."""
        if key is None:
            self._errors.clear()
            self._signatures.clear()
        else:
            self._errors.pop(key, None)
            self._signatures.pop(key, None)

    def state_bytes(self) -> int:
        """Bytes of state this compressor holds on this rank (error feedback, warm start)."""
        return sum(e.numel() * e.element_size() for e in self._errors.values())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(error_feedback={self.error_feedback})"

    # implementations (exact) ----------------------------------------------------------
    def _all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None, key: Hashable, shapes: Shapes
    ) -> None:
        dist.all_reduce(tensor, group=group)

    def _reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        group: dist.ProcessGroup | None,
        key: Hashable,
        shapes: Shapes,
    ) -> None:
        dist.reduce(tensor, dst=dst, group=group)

    def _reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup | None,
        key: Hashable,
        shapes: Shapes,
    ) -> None:
        dist.reduce_scatter_single(output, input, group=group)

    # error feedback helpers -----------------------------------------------------------
    def _state_for(self, key: Hashable, signature: tuple[Any, ...]) -> bool:
        """Check ``key``'s state matches ``signature``; drop it otherwise. True if kept."""
        if self._signatures.get(key) == signature:
            return True
        self.reset(key)
        self._signatures[key] = signature
        return False

    def _need_key(self, key: Hashable) -> None:
        if key is None and self.error_feedback:
            raise ValueError(
                f"{type(self).__name__} with error feedback needs a key naming the reduction "
                "(e.g. key=('sdp', bucket_index)): its residual is kept per key"
            )

    def _with_error(self, key: Hashable, x: torch.Tensor) -> torch.Tensor:
        """``x`` (fp32) plus the residual kept for ``key`` (error feedback on)."""
        if self.error_feedback and key in self._errors:
            x.add_(self._errors[key])
        return x

    def _keep_error(self, key: Hashable, residual: torch.Tensor) -> None:
        if self.error_feedback:
            self._errors[key] = residual


class IdentityCompressor(GradCompressor):
    """Exact: ``torch.distributed``'s all-reduce, reduce and reduce-scatter, unchanged."""

    name = "identity"

    def __init__(self) -> None:
        super().__init__(error_feedback=False)


class _ReduceByAllReduce(GradCompressor):
    """A lossy compressor whose reduce to one rank is its compressed all-reduce (the
    contract lets the other ranks hold the sum too): two phases whose second depends
    on every rank's first cannot end on one rank only."""

    exact = False

    def _reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        group: dist.ProcessGroup | None,
        key: Hashable,
        shapes: Shapes,
    ) -> None:
        self._all_reduce(tensor, group, key, shapes)
