"""What the CUDA tests share: the marker that skips them without a GPU, tolerances."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

CUDA_REASON = (
    "needs CUDA (a GPU and a CUDA build of torch) with NCCL; run `make test-gpu` on a GPU machine"
)
HAS_CUDA = torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()

#: ``pytestmark = CUDA`` in every module of tests/gpu: marked ``cuda``, skipped without it.
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason=CUDA_REASON)]

#: World sizes tried: 1 rank always, 2 where the machine has two GPUs (else skipped).
WORLD_SIZES = [1, 2]

#: fp32 parity on CUDA: the wrapped and the plain model run different kernel shapes
#: (local vs global batch) and sum gradients in another order, so not bit for bit.
FP32_ATOL = 2e-5
