"""Flat byte buffers holding one slice's parameters, and their layout.

A slice's parameters are views into one ``uint8`` buffer, each at an offset aligned to
:data:`ALIGN` bytes, so a slice moves (to a device, to a file) as one contiguous copy,
whatever the dtypes of its parameters.

[Note: freeing a buffer without invalidating views]
:meth:`FlatBuffer.free` shrinks the buffer's *storage* to 0 bytes and
:meth:`FlatBuffer.allocate` grows it back (the trick FSDP2 uses for unsharded
parameters). The storage object stays the same, so every view taken of it earlier,
including the ones autograd saved during forward (``weight.t()`` for a linear layer),
is valid again once the buffer is reallocated and refilled: the graph of a slice can
outlive its offload.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["ALIGN", "FlatBuffer", "LayoutEntry", "SliceLayout"]

ALIGN = 64
"""Byte alignment of each tensor inside a flat buffer (a cache line; any dtype's size divides it)."""

_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}


@dataclass(frozen=True)
class LayoutEntry:
    """One tensor inside a flat buffer: name, shape, dtype and byte range."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int

    def to_json(self) -> dict[str, object]:
        """A JSON-serialisable dict (for the disk tier's manifest)."""
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": str(self.dtype),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    @staticmethod
    def from_json(d: dict[str, object]) -> LayoutEntry:
        """Inverse of :meth:`to_json`."""
        shape = d["shape"]
        assert isinstance(shape, list)
        return LayoutEntry(
            name=str(d["name"]),
            shape=tuple(int(s) for s in shape),
            dtype=_DTYPES[str(d["dtype"])],
            offset=int(str(d["offset"])),
            nbytes=int(str(d["nbytes"])),
        )


@dataclass(frozen=True)
class SliceLayout:
    """Where each tensor of a slice lives inside its flat buffer.

    Attributes:
        entries: one :class:`LayoutEntry` per tensor, in order.
        nbytes: size of the whole buffer, in bytes (including alignment padding).
    """

    entries: tuple[LayoutEntry, ...]
    nbytes: int

    @staticmethod
    def of(named: Iterable[tuple[str, torch.Tensor]]) -> SliceLayout:
        """Lay out ``named`` tensors back to back, each aligned to :data:`ALIGN` bytes.

        Raises:
            TypeError: for a dtype other than float64/32/16 or bfloat16.
        """
        entries, offset = [], 0
        for name, tensor in named:
            if str(tensor.dtype) not in _DTYPES:
                raise TypeError(
                    f"offloaded parameter {name!r} has dtype {tensor.dtype}; only floating "
                    f"point dtypes are supported ({sorted(_DTYPES)})"
                )
            nbytes = tensor.numel() * tensor.element_size()
            entries.append(LayoutEntry(name, tuple(tensor.shape), tensor.dtype, offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        return SliceLayout(tuple(entries), offset)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Typed, shaped views of the ``uint8`` tensor ``flat``, one per entry."""
        return [
            flat[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries
        ]

    def to_json(self) -> list[dict[str, object]]:
        """The entries as JSON-serialisable dicts."""
        return [e.to_json() for e in self.entries]


class FlatBuffer:
    """A ``uint8`` buffer on one device that can be freed and reallocated in place.

    Args:
        nbytes: size in bytes.
        device: where the bytes live.
        allocated: start allocated (default True) or freed.
        pin: page-lock the buffer (CPU only; for fast host-device copies).
    """

    def __init__(
        self, nbytes: int, device: torch.device, *, allocated: bool = True, pin: bool = False
    ) -> None:
        self.nbytes = nbytes
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
        if not allocated:
            self.free()

    @property
    def is_allocated(self) -> bool:
        """True when the storage holds its ``nbytes`` bytes."""
        return self.tensor.untyped_storage().nbytes() == self.nbytes

    def allocate(self) -> None:
        """Grow the storage back to ``nbytes`` (contents undefined); no-op if allocated."""
        if not self.is_allocated:
            self.tensor.untyped_storage().resize_(self.nbytes)

    def free(self) -> None:
        """Shrink the storage to 0 bytes; views stay valid objects (see the module note)."""
        if self.nbytes and self.is_allocated:
            self.tensor.untyped_storage().resize_(0)
