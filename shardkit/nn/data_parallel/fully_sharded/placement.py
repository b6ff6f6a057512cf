"""Where a unit's tensors live and in which dtype: the device abstraction of FSDP.

Three homes: the *master shard* (and its gradient, and the optimizer state built on
it) on the shard device in the master dtype; the *full parameters* on the compute
device in the compute dtype; the *gradient reduction* on the compute device in the
reduce dtype. With CPU offload (``move_params_to_cpu``) the shard device is the CPU
and the compute device a GPU: the shard is cast and copied to the compute device
before each all-gather, and each reduced gradient shard copied back. Host buffers
are page-locked (pinned) only when the compute device is a CUDA device; on a
CPU-only machine every copy below is a no-op and the same code runs.

Source: ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale
Model Training", section 4: fp32 master and optimizer step on CPU, parameters in
reduced precision on the device) and FairScale's ``move_params_to_cpu``.

With the disk tier (``on_disk``) the master shard's home is a file: between uses it is
not in memory at all (see :mod:`.disk_tier`); while in use it is on the CPU, and the
full parameters never alias it, even with one rank (the full buffer outlives the
shard's residency).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Placement", "default_compute_device"]


def default_compute_device(param_device: torch.device, offload: bool) -> torch.device:
    """The compute device when none is given: the parameters' device, or the current
    CUDA device when offloading parameters that sit on the CPU (CPU if there is none)."""
    if offload and param_device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return param_device


def meta_init_device() -> torch.device:
    """Where a unit built on the meta device is materialised when no compute device is
    given: the current CUDA device, or the CPU when there is none."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class Placement:
    """Devices and dtypes of one unit's tensors.

    Attributes:
        compute_device: where full parameters, activations and reductions live.
        shard_device: where the master shard and its gradient live (CPU when offloaded).
        master_dtype: dtype of the master shard, its gradient and the optimizer state.
        compute_dtype: dtype of the full parameters in forward and backward.
        reduce_dtype: dtype of the flat gradient during the reduce-scatter.
        on_disk: the master shard lives in the disk tier's files (CPU while resident).
            Default False.
    """

    compute_device: torch.device
    shard_device: torch.device
    master_dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    on_disk: bool = False

    @property
    def offloaded(self) -> bool:
        """True when the shard lives apart from the computation: on the CPU for another
        device, or on disk."""
        return self.shard_device != self.compute_device or self.on_disk

    @property
    def pin_memory(self) -> bool:
        """Whether host buffers are page-locked (a CPU shard feeding a CUDA device)."""
        return self.shard_device.type == "cpu" and self.compute_device.type == "cuda"

    def to_shard_home(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the shard device in the master dtype (itself if already there)."""
        if tensor.device == self.shard_device and tensor.dtype == self.master_dtype:
            return tensor
        out = torch.empty(
            tensor.shape,
            dtype=self.master_dtype,
            device=self.shard_device,
            pin_memory=self.pin_memory,
        )
        out.copy_(tensor)
        return out

    def to_compute(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``tensor`` on the compute device in ``dtype`` (itself if already there)."""
        return tensor.to(device=self.compute_device, dtype=dtype)
