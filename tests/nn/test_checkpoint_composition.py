"""checkpoint_wrapper inside a Pipe: equal gradients, fewer activation bytes kept.

(Its composition with FSDP and ShardedDataParallel is tested on ranks in
``tests/nn/data_parallel/test_mixed_precision.py``.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardkit.models import Block, GPTConfig
from shardkit.nn import Pipe
from shardkit.nn.checkpoint import checkpoint_wrapper
from shardkit.testing import assert_tensors_close

CONFIG = GPTConfig(vocab_size=32, block_size=16, n_layer=4, n_head=2, n_embd=32)


class _Head(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.pow(2).mean(dim=(1, 2))


def _layers(wrapped: bool) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [Block(CONFIG) for _ in range(CONFIG.n_layer)]
    if wrapped:
        blocks = [checkpoint_wrapper(b) for b in blocks]
    return nn.Sequential(*blocks, _Head())


def _run(pipe: Pipe, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], int]:
    """Gradients after one backward, and the activation bytes kept from forward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = pipe(x)
    out.sum().backward()
    grads = {n.replace("module.", ""): p.grad.clone() for n, p in pipe.named_parameters()}
    return grads, sum(storages.values())


@pytest.mark.parametrize("mode", ["never", "always"])
def test_checkpoint_wrapper_inside_pipe_gives_equal_gradients(mode: str) -> None:
    x = torch.randn(8, 16, CONFIG.n_embd, generator=torch.Generator().manual_seed(1))
    plain = Pipe(_layers(False), balance=[3, 2], devices=["cpu", "cpu"], chunks=2, checkpoint=mode)
    wrapped = Pipe(_layers(True), balance=[3, 2], devices=["cpu", "cpu"], chunks=2, checkpoint=mode)
    grads, plain_bytes = _run(plain, x)
    wrapped_grads, wrapped_bytes = _run(wrapped, copy.deepcopy(x))
    assert sorted(grads) == sorted(wrapped_grads)
    for name, grad in grads.items():
        assert_tensors_close(wrapped_grads[name], grad, atol=0, rtol=0, name=name)
    if mode == "never":  # Pipe keeps every activation; the wrapper keeps block inputs only
        assert wrapped_bytes < 0.5 * plain_bytes, (wrapped_bytes, plain_bytes)
