"""The GPT of ``shardkit.models``: shapes, tied head, parameter counts of the named sizes;
the deprecated alias ``shardkit.testing.models``."""

from __future__ import annotations

import pytest
import torch

from shardkit.models import GPT, GPTConfig, gpt_config


def test_forward_shapes_and_loss() -> None:
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 256, (3, 16))
    targets = torch.randint(0, 256, (3, 16))
    logits, loss = model(idx, targets=targets)
    assert logits.shape == (3, 16, 256)
    assert loss is not None
    # at init (std 0.02 weights) the loss is close to uniform: ln(256) = 5.545
    assert abs(float(loss.detach()) - 5.545) < 0.1


def test_tied_head_and_counts() -> None:
    model = GPT(gpt_config("tiny"))
    assert model.lm_head.weight is model.wte.weight
    # emb 256*128 + pos 256*128 + 4 blocks * (2 LN 512 + qkv 49536 + proj 16512 + mlp 131712)
    # + final LN 256
    assert model.num_parameters() == 256 * 128 * 2 + 4 * (512 + 49536 + 16512 + 131712) + 256


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        gpt_config("huge")
    with pytest.raises(ValueError, match="n_embd \\(10\\) must be divisible by n_head \\(3\\)"):
        GPTConfig(n_embd=10, n_head=3)
    with pytest.raises(ValueError, match="sequence length 20 exceeds block_size 16"):
        GPT(GPTConfig(block_size=16))(torch.zeros(1, 20, dtype=torch.long))


def test_deprecated_alias_is_the_same_module_contents() -> None:
    import shardkit.models
    import shardkit.testing.models as alias

    assert sorted(alias.__all__) == sorted(shardkit.models.__all__)
    for name in shardkit.models.__all__:
        assert getattr(alias, name) is getattr(shardkit.models, name), name
