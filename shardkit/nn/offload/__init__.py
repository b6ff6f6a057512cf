"""OffloadModel: train a sequential model larger than fast memory, one slice at a time.

Modules, by layer: ``partition`` (balanced contiguous slices), ``flat`` (a slice's
parameters in one freeable byte buffer), ``slices`` (a slice and its residency state),
``device`` (the CUDA-specific bits), ``tiers`` (resident / CPU-memory tiers), ``disk``
(the file tier, crash-safe generations), ``function`` (the autograd node that loads a
slice for forward and backward), ``optim`` (slice-by-slice stepping), ``api``
(``OffloadModel``), ``universal_layout`` and ``disk_universal`` (the universal
checkpoint's adapter; the disk tier's files mapped for a save or load). A GPT as a sequence of stages: ``shardkit.models.gpt_stages``.
"""

import shardkit.nn.offload.universal_layout  # noqa: F401 (registers the universal-checkpoint adapter)
from shardkit.nn.offload.api import OffloadModel
from shardkit.nn.offload.disk import DiskTier, remove_offloaded
from shardkit.nn.offload.optim import SlicedOptimizer
from shardkit.nn.offload.partition import balance_by_size
from shardkit.nn.offload.slices import SliceState
from shardkit.nn.offload.tiers import MemoryTier, ResidentTier, Tier

__all__ = [
    "DiskTier",
    "MemoryTier",
    "OffloadModel",
    "ResidentTier",
    "SliceState",
    "SlicedOptimizer",
    "Tier",
    "balance_by_size",
    "remove_offloaded",
]
