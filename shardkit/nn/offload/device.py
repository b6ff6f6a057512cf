"""The device-specific bits of offloading, behind one small abstraction.

Everything else in the package is device-agnostic: it runs on CPU (tests, CPU-only
machines) and on CUDA alike. CUDA adds page-locked host buffers (fast, asynchronous
host-to-device copies). (Activation recomputation, with its random number generator
replay, is :func:`shardkit.nn.checkpoint.run_checkpointed`.)
"""

from __future__ import annotations

import torch

__all__ = ["DeviceOps"]


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

    def synchronize(self) -> None:
        """Wait for pending copies to the host (no-op on CPU)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
