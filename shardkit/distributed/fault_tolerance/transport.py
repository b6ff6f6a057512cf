"""Process groups built from a store prefix, and a state sent from one replica to another.

A cross-replica group is a ``ProcessGroupGloo`` created directly on a
``PrefixStore`` (not through ``torch.distributed.new_group``): it needs no default
process group, every quorum gets a fresh one under its own prefix, and dropping the
Python object closes its connections, so a peer still waiting in it fails at once.

A live replica hands its state to a joiner over a two-member group of the same kind:
the state (any picklable tree of tensors and numbers, a ``state_dict``) is serialised
with ``torch.save`` into one byte tensor, its length is sent first, then the bytes.
Loading uses ``torch.load(weights_only=True)``: tensors, containers and numbers only.
"""

from __future__ import annotations

import io
from datetime import timedelta
from typing import Any, Protocol, cast

import torch

# The c10d types: public in torch.distributed at run time, declared in this stub only.
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore, Work

__all__ = [
    "GlooGroup",
    "Store",
    "connect_store",
    "gloo_group",
    "host_store",
    "recv_state",
    "send_state",
]


class GlooGroup(Protocol):
    """The collectives used of a ``ProcessGroupGloo`` (torch's stub declares them on
    ``ProcessGroup`` only; the backend object has them at run time)."""

    def allreduce(self, tensors: list[torch.Tensor]) -> Work: ...

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> Work: ...

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> Work: ...


def host_store(port: int, host: str = "0.0.0.0") -> TCPStore:
    """Host the quorum store (a ``TCPStore`` server) on ``port``; 0 picks a free port
    (read it from the returned store's ``port``). It must outlive the replicas."""
    return TCPStore(host, port, is_master=True, wait_for_workers=False)


def connect_store(address: str, timeout_s: float = 60.0) -> Store:
    """A client of the quorum store at ``address`` (``"HOST:PORT"``).

    Args:
        address: e.g. ``"127.0.0.1:29600"``.
        timeout_s: how long to wait for the server and for a blocking ``get`` or
            ``wait``, in seconds. Default 60.

    Raises:
        ValueError: ``address`` is not ``HOST:PORT``.
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(
            f"quorum store address {address!r}: expected HOST:PORT, e.g. 127.0.0.1:29600"
        )
    return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


def gloo_group(store: Store, prefix: str, rank: int, size: int, timeout_s: float) -> GlooGroup:
    """A gloo process group of ``size`` members keyed by ``prefix`` in ``store``.

    Blocks until every member has connected (at most ``timeout_s``); each collective
    of the group fails after ``timeout_s`` too.

    Raises:
        RuntimeError: (torch's ``DistError``) a member did not connect in time.
    """
    group_store = PrefixStore(prefix, store)
    group = ProcessGroupGloo(group_store, rank, size, timedelta(seconds=timeout_s))
    return cast(GlooGroup, group)


def _to_bytes(state: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def send_state(group: GlooGroup, state: Any | None) -> int:
    """Send ``state`` to rank 1 of the two-member ``group`` (this is rank 0); None
    tells the receiver that the source failed to produce it (length -1).

    Returns:
        The number of bytes sent (the serialised state plus its 8-byte length).
    """
    if state is None:
        group.send([torch.tensor([-1], dtype=torch.int64)], 1, 0).wait()
        return 8
    payload = _to_bytes(state)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    group.send([length], 1, 0).wait()
    group.send([payload], 1, 1).wait()
    return payload.numel() + 8


def recv_state(group: GlooGroup) -> tuple[Any, int]:
    """Receive a state sent by :func:`send_state` from rank 0 (this is rank 1).

    Returns:
        The state and the number of bytes received.

    Raises:
        RuntimeError: the source could not produce the state, or the transfer failed.
    """
    length = torch.zeros(1, dtype=torch.int64)
    group.recv([length], 0, 0).wait()
    if int(length.item()) < 0:
        raise RuntimeError("the source replica failed to produce its state")
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    group.recv([payload], 0, 1).wait()
    state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
    return state, payload.numel() + 8
