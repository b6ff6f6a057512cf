"""The CUDA paths of tensor parallelism (issue 18), one process, one GPU: the RNG
tracker forks the CUDA generator, and the layers built from CUDA modules stay on the
GPU and equal them. Marked ``cuda``; skipped (and reported as skipped) without CUDA;
on a GPU machine: ``pytest -m cuda tests/nn/tensor_parallel`` (``make test-gpu`` runs
tests/gpu only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.nn import tensor_parallel as tp
from shardkit.nn.tensor_parallel.random import RNGStatesTracker
from tests.gpu.common import CUDA

pytestmark = CUDA


def test_rng_tracker_forks_the_cuda_generator() -> None:
    ones = torch.ones(4096, device="cuda")
    torch.manual_seed(3)
    plain = [F.dropout(ones, 0.5), F.dropout(ones, 0.5)]
    torch.manual_seed(3)
    tracker = RNGStatesTracker()
    tracker.add("tp", 99)
    first = F.dropout(ones, 0.5)
    with tracker.fork("tp"):
        inside = F.dropout(ones, 0.5)
    second = F.dropout(ones, 0.5)
    assert torch.equal(first, plain[0]) and torch.equal(second, plain[1])  # default resumed
    assert not torch.equal(inside, plain[1])
    torch.cuda.manual_seed(99)
    assert torch.equal(inside, F.dropout(ones, 0.5))  # the tracked stream is seed 99's


def test_layers_from_cuda_modules_stay_on_the_gpu() -> None:
    torch.manual_seed(0)
    linear, emb = nn.Linear(16, 32).cuda(), nn.Embedding(64, 16).cuda()
    col = tp.ColumnParallelLinear.from_linear(linear)
    row = tp.RowParallelLinear.from_linear(linear)
    vocab = tp.VocabParallelEmbedding.from_embedding(emb)
    ids = torch.randint(0, 64, (3, 5), device="cuda")
    x = emb(ids)
    for layer in (col, row):
        assert layer.weight.is_cuda and layer.bias is not None and layer.bias.is_cuda
        torch.testing.assert_close(layer(x), linear(x), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(vocab(ids), x, atol=0.0, rtol=0.0)
    logits = torch.randn(3, 5, 64, device="cuda")
    want = F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none").view(3, 5)
    torch.testing.assert_close(
        tp.vocab_parallel_cross_entropy(logits, ids), want, atol=1e-6, rtol=1e-6
    )
