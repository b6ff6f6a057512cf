"""Failure of a pipeline stage: an abort marker sent to the neighbours in place of data.

[Note: failing fast across stages]
Stages wait only on receives from their two neighbours. When a stage raises inside a
step (a layer, the loss, a receive), its neighbours would wait for the next message
until the process group's timeout. Instead the failing stage sends each neighbour a
marker in place of the message that neighbour waits for next on that link:

- downstream, in place of the next activation header: a header whose first slot is
  ``-1``, the error text packed into the other slots;
- upstream, in place of the oldest output gradient still owed: tensors of the
  expected shapes whose first bytes are :data:`MAGIC` (a NaN bit pattern no
  arithmetic produces), then the text's length and the text, as far as they fit.

A stage that receives a marker raises :class:`StageFailedError` with the original
text (``"stage 1 (rank 1) failed: ValueError: ..."``) and forwards the same marker to
its other neighbour, so every stage of the pipeline names the stage that failed
first. Messages are matched by order on each link, so the marker is always the message
the neighbour reads next. After a failure the pipeline's process group holds unmatched
messages: destroy it and build a new one to continue.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

from shardkit.nn.pipe.p2p import _HEADER_SLOTS, TensorMeta

__all__ = [
    "MAGIC",
    "StageFailedError",
    "abort_header",
    "abort_tensors",
    "header_abort_reason",
    "read_abort",
]

#: first bytes of an abort marker in a gradient (a float32 NaN with a payload)
MAGIC = b"\xde\xc0\xa5\x7f"
_TEXT_BYTES = (_HEADER_SLOTS - 2) * 8


class StageFailedError(RuntimeError):
    """Another stage of the pipeline failed during the step; the message names it.

    Attributes:
        reason: the failing stage's text, ``"stage S (rank R) failed: <error>"``.
    """

    def __init__(self, reason: str, where: str = "") -> None:
        self.reason = reason
        super().__init__(f"{where}: {reason}" if where else reason)

    def __reduce__(self) -> tuple[object, ...]:  # picklable, for the test harness
        return (type(self), (self.reason,))


def _text_bytes(text: str, limit: int) -> bytes:
    return text.encode("utf-8")[:limit]


def abort_header(reason: str) -> torch.Tensor:
    """An activation header meaning "the sender failed": ``[-1, n, text bytes...]``."""
    text = _text_bytes(reason, _TEXT_BYTES)
    padded = text + b"\0" * (_TEXT_BYTES - len(text))
    header = torch.zeros(_HEADER_SLOTS, dtype=torch.int64)
    header[0], header[1] = -1, len(text)
    header[2:] = torch.frombuffer(bytearray(padded), dtype=torch.int64)
    return header


def header_abort_reason(first: torch.Tensor) -> str | None:
    """The failure text of an abort header (the first message of a header), else None."""
    if int(first[0]) != -1:
        return None
    raw = bytes(first[2:].cpu().view(torch.uint8).tolist())[: int(first[1])]
    return raw.decode("utf-8", errors="replace")


def abort_tensors(reason: str, metas: Sequence[TensorMeta]) -> list[torch.Tensor]:
    """Gradients of the expected shapes carrying the abort marker in the first tensor.

    A first tensor of fewer than 8 bytes carries the marker only (no text fits).
    """
    tensors = [torch.zeros(m.shape, dtype=m.dtype) for m in metas]
    if tensors and tensors[0].numel() > 0:
        raw = tensors[0].view(-1).view(torch.uint8)
        text = _text_bytes(reason, max(0, raw.numel() - 8))
        payload = (MAGIC + struct.pack("<I", len(text)) + text)[: raw.numel()]
        raw[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return tensors


def read_abort(tensors: Sequence[torch.Tensor]) -> str | None:
    """The failure text carried by received gradients, or None for ordinary ones.

    Reads at most the first 8 bytes of the first tensor unless it is a marker.
    """
    if not tensors or tensors[0].numel() == 0:
        return None
    raw = tensors[0].detach().reshape(-1).view(torch.uint8)
    if raw.numel() < 4 or bytes(raw[:4].tolist()) != MAGIC:
        return None
    if raw.numel() < 8:
        return "a neighbour stage failed (no room for its error text in this gradient)"
    length = struct.unpack("<I", bytes(raw[4:8].tolist()))[0]
    return bytes(raw[8 : 8 + length].tolist()).decode("utf-8", errors="replace")
