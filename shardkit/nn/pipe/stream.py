"""Device abstraction for streams: a CUDA stream, or a CPU stand-in that does nothing.

The pipeline code calls these helpers without asking which device it runs on: on CUDA
they create side streams, make one stream wait for another and tell the caching
allocator which streams use a tensor; on CPU every call is a no-op over
:class:`CPUStream`, so the same schedule runs (and is tested) with
``devices=["cpu", "cpu"]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = [
    "AbstractStream",
    "CPUStream",
    "current_stream",
    "new_stream",
    "record_stream",
    "use_stream",
    "wait_stream",
]


class CPUStream:
    """Stand-in for a stream on CPU, where work is synchronous."""

    device = torch.device("cpu")

    def __repr__(self) -> str:
        return "CPUStream()"


AbstractStream = torch.cuda.Stream | CPUStream
CPU_STREAM = CPUStream()


def new_stream(device: torch.device) -> AbstractStream:
    """A new side stream on ``device`` (the CPU stand-in for non-CUDA devices)."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.Stream(device)


def current_stream(device: torch.device) -> AbstractStream:
    """The stream work on ``device`` is issued to now."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.current_stream(device)


@contextlib.contextmanager
def use_stream(stream: AbstractStream) -> Iterator[None]:
    """Issue work inside the block to ``stream`` (and its device); no-op on CPU."""
    if isinstance(stream, CPUStream):
        yield
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


def wait_stream(waiter: AbstractStream, source: AbstractStream) -> None:
    """Make later work on ``waiter`` wait for the work issued so far on ``source``."""
    if isinstance(waiter, CPUStream) or isinstance(source, CPUStream):
        return  # CPU work is synchronous; a CUDA stream waiting on CPU work has nothing to wait for
    waiter.wait_stream(source)


def record_stream(tensor: torch.Tensor, stream: AbstractStream) -> None:
    """Tell the caching allocator that ``stream`` uses ``tensor`` (CUDA only)."""
    if isinstance(stream, CPUStream) or not tensor.is_cuda:
        return
    tensor.record_stream(stream)
