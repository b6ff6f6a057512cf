"""The device-specific bits of offloading, behind one small abstraction.

Everything else in the package is device-agnostic: it runs on CPU (tests, CPU-only
machines) and on CUDA alike. CUDA adds page-locked host buffers (fast, asynchronous
host-to-device copies) and a per-device random number generator that activation
recomputation must replay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["DeviceOps", "RngState"]


@dataclass(frozen=True)
class RngState:
    """Random number generator states captured before a forward, replayed on recompute."""

    cpu: torch.Tensor
    device: torch.Tensor | None


class DeviceOps:
    """What offloading needs to know about the compute device.

    Args:
        device: the compute device (``cpu`` or ``cuda:i``).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"

    def pin_host_memory(self, offload_device: torch.device) -> bool:
        """Whether host buffers should be page-locked (CPU tier feeding a CUDA device)."""
        return self.is_cuda and offload_device.type == "cpu"

    def rng_state(self) -> RngState:
        """The CPU (and CUDA) generator states, to replay dropout on recompute."""
        cuda = torch.cuda.get_rng_state(self.device) if self.is_cuda else None
        return RngState(cpu=torch.get_rng_state(), device=cuda)

    @contextlib.contextmanager
    def replay_rng(self, state: RngState) -> Iterator[None]:
        """Run the body with the generators set to ``state``; restore them afterwards."""
        with torch.random.fork_rng(devices=[self.device] if self.is_cuda else []):
            torch.set_rng_state(state.cpu)
            if state.device is not None:
                torch.cuda.set_rng_state(state.device, self.device)
            yield

    def synchronize(self) -> None:
        """Wait for pending copies to the host (no-op on CPU)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
