"""fp16 loss scaling on CUDA: ShardedGradScaler keeps its scale on the GPU, matches
torch's GradScaler step for step, and an inf on one rank is skipped on every rank."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import workers
from tests.gpu.common import CUDA, WORLD_SIZES

pytestmark = CUDA


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sharded_scaler_matches_torch_scaler_on_cuda(nccl_pool, world_size: int) -> None:
    for rank, runs in enumerate(nccl_pool(world_size).run(workers.scaler_parity, None)):
        sharded, plain = runs["sharded"], runs["torch"]
        assert sharded["scale_device"].startswith("cuda")
        assert sharded["scales"] == plain["scales"] == [1024.0] * 4
        for step, (w, w_ref) in enumerate(zip(sharded["weights"], plain["weights"], strict=True)):
            assert torch.equal(w, w_ref), f"rank {rank} step {step}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_inf_on_rank_0_is_skipped_on_every_rank(nccl_pool, world_size: int) -> None:
    for rank, runs in enumerate(nccl_pool(world_size).run(workers.scaler_parity, 2)):
        sharded, plain = runs["sharded"], runs["torch"]
        assert sharded["scales"] == [1024.0, 1024.0, 512.0, 512.0], f"rank {rank}"
        assert torch.equal(sharded["weights"][1], plain["weights"][1])
        assert torch.equal(sharded["weights"][2], sharded["weights"][1])  # step 2 skipped


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fsdp_fp16_with_sharded_scaler(nccl_pool, world_size: int) -> None:
    for rank, run in enumerate(nccl_pool(world_size).run(workers.fsdp_fp16_with_scaler)):
        steps = workers.STEPS
        # clean steps update the parameters at the initial scale; the poisoned last step
        # (an inf on rank 0 only) is skipped on every rank and the scale halves
        assert run["scales"] == [1024.0] * steps + [512.0], f"rank {rank}"
        assert run["changed"] == [True] * steps + [False], f"rank {rank}"
        if world_size == 1:  # one rank sees the whole batch: losses comparable to fp32
            assert run["losses"][:steps] == pytest.approx(run["ref_losses"], rel=2e-2)
