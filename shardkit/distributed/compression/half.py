"""Half-precision compressors: cast to fp16 or bf16, reduce, cast back."""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist

from shardkit.distributed.compression.interface import GradCompressor, Shapes

__all__ = ["BF16Compressor", "FP16Compressor", "HalfPrecisionCompressor"]


class HalfPrecisionCompressor(GradCompressor):
    """Cast to ``dtype`` (fp16 or bf16), reduce, cast back: half of fp32's bytes.

    Like torch's ``fp16_compress_hook`` / ``bf16_compress_hook``: the sum is taken in
    ``dtype`` by the backend. With ``error_feedback=True`` the local rounding of the
    cast, ``(g + e) - cast(g + e)``, is kept per key and added to the next call (the
    rounding of the sum itself is not: the backend does it).

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``; default bf16.
        error_feedback: keep the cast's rounding (see above); default False (torch's
            hooks have none).

    Raises:
        ValueError: ``dtype`` is not fp16 or bf16.
    """

    exact = False

    def __init__(self, dtype: torch.dtype = torch.bfloat16, error_feedback: bool = False) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"HalfPrecisionCompressor takes fp16 or bf16; got {dtype}")
        super().__init__(error_feedback=error_feedback)
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dtype={self.dtype}, error_feedback={self.error_feedback})"

    def _cast(self, tensor: torch.Tensor, key: Hashable) -> torch.Tensor:
        """``tensor`` (+ residual) in the wire dtype, a new tensor; keeps the residual."""
        if not self.error_feedback:
            return tensor.to(self.dtype, copy=True)
        self._need_key(key)
        self._state_for(key, (tensor.numel(),))
        x = self._with_error(key, tensor.to(torch.float32, copy=True))
        half = x.to(self.dtype)
        self._keep_error(key, x.sub_(half.to(torch.float32)))
        return half

    def _all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None, key: Hashable, shapes: Shapes
    ) -> None:
        half = self._cast(tensor, key)
        dist.all_reduce(half, group=group)
        tensor.copy_(half)

    def _reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        group: dist.ProcessGroup | None,
        key: Hashable,
        shapes: Shapes,
    ) -> None:
        half = self._cast(tensor, key)
        dist.reduce(half, dst=dst, group=group)
        tensor.copy_(half)

    def _reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup | None,
        key: Hashable,
        shapes: Shapes,
    ) -> None:
        half = self._cast(input, key)
        out = torch.empty(output.numel(), dtype=self.dtype, device=output.device)
        dist.reduce_scatter_single(out, half, group=group)
        output.copy_(out)


class FP16Compressor(HalfPrecisionCompressor):
    """:class:`HalfPrecisionCompressor` in fp16 (sums above 65504 overflow: divide first)."""

    def __init__(self, error_feedback: bool = False) -> None:
        super().__init__(torch.float16, error_feedback)


class BF16Compressor(HalfPrecisionCompressor):
    """:class:`HalfPrecisionCompressor` in bf16 (fp32's range, 8 bits of mantissa)."""

    def __init__(self, error_feedback: bool = False) -> None:
        super().__init__(torch.bfloat16, error_feedback)
