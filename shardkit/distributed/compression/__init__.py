"""Gradient compression: one interface for every reduce path shardkit owns.

A :class:`GradCompressor` reduces a flat gradient tensor over a process group, for
each collective kind the wrappers use:

- :meth:`GradCompressor.all_reduce` (torch DDP through :func:`register_ddp_comm_hook`,
  the hybrid cross-replica all-reduce, parameters OSS owns on no rank),
- :meth:`GradCompressor.reduce` (reduce to the owner: OSS's ``reduce_to_owner_hook``,
  ShardedDataParallel's buckets),
- :meth:`GradCompressor.reduce_scatter` (FSDP's gradient reduce-scatter).

It knows no wrapper: a caller passes the flat tensor, its process group, a ``key``
naming the reduction (the state of error feedback and of PowerSGD's warm start is
kept per key) and, optionally, the ``shapes`` of the consecutive pieces of the flat
tensor (the parameters whose gradients lie one after another in it).

The package, one concept per module:

- :mod:`~shardkit.distributed.compression.interface`: :class:`GradCompressor` (exact),
  its [Note: the contract] and [Note: error feedback];
- :mod:`~shardkit.distributed.compression.half`: fp16 / bf16;
- :mod:`~shardkit.distributed.compression.powersgd`: PowerSGD;
- :mod:`~shardkit.distributed.compression.int8`: int8 block quantization;
- :mod:`~shardkit.distributed.compression.router`: which compressor a reduction
  uses (:class:`OnlyOnGroups` by process group, :func:`get_compressor` by name);
- :mod:`~shardkit.distributed.compression.ddp_hook`: the torch DDP communication hook.

[Note: bytes sent]
Payload bytes as ``benchmarks.comm`` counts them, for a tensor of n elements in
dtype of ``b`` bytes (fp32: 4), group size N:

==================  ==========================================================
compressor          collectives of one ``all_reduce`` (payload bytes)
==================  ==========================================================
identity            one all-reduce, ``b n`` (exact)
fp16 / bf16         one all-reduce, ``2 n`` (half of fp32's)
PowerSGD rank r     all-reduce of ``4 (sum_vectors v + sum_matrices r m)``, then
                    all-reduce of ``4 sum_matrices r n`` (``4 r (m + n)`` per
                    m x n matrix instead of ``4 m n``; vectors as they are)
int8 (block B)      all-to-all of ``N R`` and all-gather of ``N R`` bytes, with
                    ``R = c (1 + 4 / B)``, ``c = ceil(n / N)`` rounded up to a
                    multiple of B: ring volume ``2 (N - 1) R`` bytes against
                    fp32's ``8 (N - 1) n / N``: ``(1 + 4 / B) / 4`` of it
==================  ==========================================================

``reduce`` and ``reduce_scatter`` of identity and fp16 / bf16 are one reduce / one
reduce-scatter of the same bytes per element; PowerSGD runs its all-reduce for both
(so its reduce costs ``2 (N - 1) / N`` ring volume of the compressed size, against
``(N - 1) / N`` of the full size for an exact reduce); int8's reduce-scatter is the
all-to-all alone (``(1 + 4 / B) / 4`` of fp32's reduce-scatter volume), its reduce is
its all-reduce.

Sources: Vogels, Karimireddy, Jaggi 2019, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization" (NeurIPS), Algorithm 1 (rank-r power
iteration with warm start, sections 3-4) and Algorithm 2 (error feedback); torch's
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` (vectors uncompressed,
``min_compression_rate``); Tang et al. 2021, "1-bit Adam: Communication Efficient
Large-Scale Training with Adam's Convergence Speed", section 4 (compressed
all-reduce in two phases, all-to-all then all-gather, with worker and server error
feedback); Wang et al. 2023, "ZeRO++", section 3.3 (qgZ: block-quantized int8
gradients exchanged by all-to-all, reduced in full precision after dequantization).
"""

from shardkit.distributed.compression.ddp_hook import (
    DDPCompressionState,
    ddp_compression_hook,
    register_ddp_comm_hook,
)
from shardkit.distributed.compression.half import (
    BF16Compressor,
    FP16Compressor,
    HalfPrecisionCompressor,
)
from shardkit.distributed.compression.int8 import Int8Compressor
from shardkit.distributed.compression.interface import GradCompressor, IdentityCompressor
from shardkit.distributed.compression.powersgd import PowerSGDCompressor, powersgd_elements
from shardkit.distributed.compression.router import OnlyOnGroups, get_compressor

__all__ = [
    "BF16Compressor",
    "DDPCompressionState",
    "FP16Compressor",
    "GradCompressor",
    "HalfPrecisionCompressor",
    "IdentityCompressor",
    "Int8Compressor",
    "OnlyOnGroups",
    "PowerSGDCompressor",
    "ddp_compression_hook",
    "get_compressor",
    "powersgd_elements",
    "register_ddp_comm_hook",
]
