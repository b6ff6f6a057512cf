"""OSS, ShardedDataParallel and FSDP on CUDA with NCCL: parity with the plain model.

The plain model trains on the global batch on the same GPU; the wrapped one on this
rank's part (DDP semantics), SGD with momentum, 3 steps. fp32 on CUDA is not bit for
bit across batch shapes, hence ``FP32_ATOL``. FSDP's CUDA paths: the asynchronous
all-gather of the next unit (prefetch, in forward and backward), the asynchronous
reduce-scatters bounded by ``bucket_cap_mb`` (1e-6: wait for each but the newest at once; 25 MB: all in
flight until the end of backward), ``no_sync`` accumulation.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu import workers
from tests.gpu.common import CUDA, FP32_ATOL, WORLD_SIZES

pytestmark = CUDA


@pytest.mark.parametrize("mode", ["ddp", "hook", "sdp"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_oss_and_sharded_ddp_match_plain_model(nccl_pool, world_size: int, mode: str) -> None:
    results = nccl_pool(world_size).run(workers.oss_parity, mode)
    for rank, result in enumerate(results):
        assert result["on_cuda"], f"rank {rank}: parameters left the GPU"
        assert result["missing"] == []
        assert result["max_diff"] <= FP32_ATOL, f"rank {rank} ({mode}): {result['max_diff']:.3g}"


def _rank_mean(results: list[dict]) -> list[float]:
    """Per step, the mean over ranks of the losses on their parts of the global batch."""
    return [sum(step) / len(results) for step in zip(*(r["losses"] for r in results), strict=True)]


_FSDP_GRID = [
    {"nesting": "flat", "fsdp": {}},
    {"nesting": "block", "fsdp": {}},
    {"nesting": "block", "fsdp": {"reshard_after_forward": False}},
    {"nesting": "block", "fsdp": {"bucket_cap_mb": 1e-6}},
    {"nesting": "block", "fsdp": {}, "micro": 2},
]


@pytest.mark.parametrize(
    "cfg", _FSDP_GRID, ids=lambda c: f"{c['nesting']}-{c['fsdp']}-m{c.get('micro', 1)}"
)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fsdp_matches_plain_model(nccl_pool, world_size: int, cfg: dict) -> None:
    results = nccl_pool(world_size).run(workers.fsdp_parity, cfg)
    for rank, result in enumerate(results):
        assert result["missing"] == [], f"rank {rank}: full state dict lacks {result['missing']}"
        assert result["param_devices"] == ["cuda"]
        assert result["output_device"].startswith("cuda")
        assert result["max_diff"] <= FP32_ATOL, f"rank {rank}: {result['max_diff']:.3g}"
    # the ranks' mean loss is the plain model's loss on the global batch
    assert _rank_mean(results) == pytest.approx(results[0]["ref_losses"], abs=1e-4)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fsdp_bf16_mixed_precision_trains_like_fp32(nccl_pool, world_size: int) -> None:
    cfg = {"nesting": "block", "fsdp": {"mixed_precision": True, "compute_dtype": torch.bfloat16}}
    results = nccl_pool(world_size).run(workers.fsdp_parity, cfg)
    # bf16 has an 8-bit mantissa: the losses agree to about 1e-2 relative
    assert _rank_mean(results) == pytest.approx(results[0]["ref_losses"], rel=2e-2)
    for result in results:
        assert result["missing"] == []
        assert result["max_diff"] <= 1e-2  # fp32 master weights; bf16 forward and backward
