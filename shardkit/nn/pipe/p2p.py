"""Point-to-point transfer of micro-batch tensors between stages over a process group.

Activations travel after a small header (one fixed-size int64 message: a tensor or a
tuple, then dtype, ``requires_grad`` and shape of each tensor), so stages need not know
each other's shapes in advance and an uneven last micro-batch needs nothing special. Gradients
travel without a header: the receiver of a gradient sent the matching activation,
so it knows the shapes.

[Note: sends never block]
Every send is an ``isend`` whose handle (and tensor) is kept until :meth:`P2P.wait`;
only receives block. A stage that sends an activation forward while its neighbour
sends a gradient back (1F1B) therefore cannot deadlock on two blocking sends, and a
schedule is deadlock-free exactly when its receive order is (the schedule tests
check that by simulation). Between two ranks each direction carries one kind of
message, in order, so messages match by order without tags.

[Note: receives posted ahead]
gloo (like NCCL) moves a message only once both sides have posted it: a receive
posted after its send costs a round trip through both ranks' transport threads,
which on busy cores wait to be scheduled. :meth:`P2P.irecv` and
:meth:`P2P.irecv_header` post a receive early and return a :class:`PendingRecv`
whose ``wait`` blocks; the stage posts each receive as soon as it knows the shapes,
in the order the peer sends, so the transfer overlaps its compute.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardkit.distributed.failures import collective_context

__all__ = ["P2P", "PendingRecv", "TensorMeta"]

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip


# A header fits one message of this many int64 slots (a length, then the fields) for
# up to 6 tensors of 3 dims; longer headers send the rest in a second message.
_HEADER_SLOTS = 40


class TensorMeta(NamedTuple):
    """What a receiver needs to allocate a tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def encode_header(tensors: Sequence[torch.Tensor], atomic: bool) -> torch.Tensor:
    """``[atomic, n, (dtype, requires_grad, ndim, *shape) per tensor]`` as int64."""
    fields = [int(atomic), len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype} between stages")
        fields += [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
    return torch.tensor(fields, dtype=torch.int64)


def decode_header(header: torch.Tensor) -> tuple[bool, list[TensorMeta]]:
    """Inverse of :func:`encode_header`: whether the value was a single tensor, and metas."""
    fields = header.tolist()
    atomic, count, pos, metas = bool(fields[0]), fields[1], 2, []
    for _ in range(count):
        dtype, grad, ndim = fields[pos : pos + 3]
        shape = tuple(fields[pos + 3 : pos + 3 + ndim])
        metas.append(TensorMeta(shape, _DTYPES[dtype], bool(grad)))
        pos += 3 + ndim
    return atomic, metas


class PendingRecv:
    """Receives posted ahead (:meth:`P2P.irecv`); :meth:`wait` returns their tensors."""

    def __init__(self, p2p: P2P, works: list[dist.Work], tensors: list[torch.Tensor]) -> None:
        self._p2p, self._works, self.tensors = p2p, works, tensors

    def wait(self) -> list[torch.Tensor]:
        """Block until every tensor arrived (time counted in ``wait_s``); the tensors."""
        start = time.perf_counter()
        with self._p2p.failures("wait for receives posted ahead"):
            for work in self._works:
                work.wait()
        self._p2p.wait_s += time.perf_counter() - start
        return self.tensors


class P2P:
    """Sends and receives lists of tensors to and from peers of one process group.

    Args:
        process_group: the group; peers are given as ranks in it.
        device: where received tensors are allocated (a CUDA device for NCCL).

    Attributes:
        wait_s: seconds spent blocked in receives since the last reset (waiting for a
            neighbour plus the transfer itself; on CPU, about this rank's share of the
            bubble).
    """

    def __init__(self, process_group: ProcessGroup, device: torch.device) -> None:
        self.group = process_group
        self.device = device
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.wait_s = 0.0

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer)

    def failures(self, operation: str) -> AbstractContextManager[None]:
        """A peer's timeout or disconnection in the body: a CollectiveError naming it."""
        return collective_context("PipelineStage", operation, self.group)

    def _isend(self, tensor: torch.Tensor, peer: int) -> None:
        tensor = tensor.detach().to(self.device).contiguous()
        with self.failures(f"send to stage {peer}"):
            work = dist.isend(tensor, self._global(peer), group=self.group)
        assert work is not None
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        self._pending.append((work, tensor))

    def _recv(self, tensor: torch.Tensor, peer: int) -> torch.Tensor:
        start = time.perf_counter()
        with self.failures(f"receive from stage {peer}"):
            dist.recv(tensor, self._global(peer), group=self.group)
        self.wait_s += time.perf_counter() - start
        return tensor

    def _irecv(self, tensor: torch.Tensor, peer: int) -> dist.Work:
        with self.failures(f"receive from stage {peer}"):
            work = dist.irecv(tensor, self._global(peer), group=self.group)
        assert work is not None
        return work

    def send(
        self, tensors: Sequence[torch.Tensor], peer: int, *, atomic: bool | None = None
    ) -> None:
        """Send ``tensors`` to ``peer``; with ``atomic`` given, a header first (see module)."""
        if atomic is not None:
            header = encode_header(tensors, atomic)
            first = torch.zeros(_HEADER_SLOTS, dtype=torch.int64)
            first[0] = header.numel()
            first[1 : 1 + min(header.numel(), _HEADER_SLOTS - 1)] = header[: _HEADER_SLOTS - 1]
            self._isend(first, peer)
            if header.numel() > _HEADER_SLOTS - 1:
                self._isend(header[_HEADER_SLOTS - 1 :], peer)
        for t in tensors:
            self._isend(t, peer)

    def recv_header(self, peer: int) -> tuple[bool, list[TensorMeta]]:
        """Receive a header from ``peer``: single tensor or tuple, and each tensor's meta."""
        first = self._recv(torch.empty(_HEADER_SLOTS, dtype=torch.int64, device=self.device), peer)
        return self.finish_header(first, peer)

    def recv(self, metas: Sequence[TensorMeta], peer: int) -> list[torch.Tensor]:
        """Receive one tensor per meta from ``peer`` (``requires_grad`` as in the meta)."""
        out = []
        for meta in metas:
            t = self._recv(torch.empty(meta.shape, dtype=meta.dtype, device=self.device), peer)
            out.append(t.requires_grad_(meta.requires_grad))
        return out

    def irecv(self, metas: Sequence[TensorMeta], peer: int) -> PendingRecv:
        """Post receives of one tensor per meta from ``peer`` now (see module note)."""
        tensors = [
            torch.empty(m.shape, dtype=m.dtype, device=self.device).requires_grad_(m.requires_grad)
            for m in metas
        ]
        return PendingRecv(self, [self._irecv(t.detach(), peer) for t in tensors], tensors)

    def irecv_header(self, peer: int) -> PendingRecv:
        """Post the receive of a header's first message from ``peer``; decode it with
        :meth:`finish_header` after ``wait``."""
        first = torch.empty(_HEADER_SLOTS, dtype=torch.int64, device=self.device)
        return PendingRecv(self, [self._irecv(first, peer)], [first])

    def finish_header(self, first: torch.Tensor, peer: int) -> tuple[bool, list[TensorMeta]]:
        """Decode a header's first message, receiving the rest when it did not fit."""
        first = first.cpu()
        size = int(first[0])
        header = first[1 : 1 + size]
        if size > _HEADER_SLOTS - 1:
            rest = torch.empty(size - _HEADER_SLOTS + 1, dtype=torch.int64, device=self.device)
            header = torch.cat([header, self._recv(rest, peer).cpu()])
        return decode_header(header)

    def wait(self) -> None:
        """Wait for every send issued so far (their buffers are released after)."""
        with self.failures("wait for sends to the neighbour stages"):
            for work, _ in self._pending:
                work.wait()
        self._pending.clear()
