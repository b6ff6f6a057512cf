"""Wrapping policies (no process group needed: a plain marker wrapper)."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from shardkit.nn.wrap import (
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)
from shardkit.testing.models import GPT, Block, GPTConfig


class Marker(nn.Module):
    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.module, self.kwargs = module, kwargs


def _gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))


def test_wrap_outside_context_is_identity_and_inside_merges_kwargs() -> None:
    lin = nn.Linear(2, 2)
    assert wrap(lin) is lin
    assert auto_wrap(lin) is lin
    lin.wrapper_config = {"b": 2}  # type: ignore[assignment]
    with enable_wrap(wrapper_cls=Marker, a=1, b=1):
        wrapped = wrap(lin, c=3)
    assert isinstance(wrapped, Marker) and wrapped.kwargs == {"a": 1, "b": 2, "c": 3}


def test_nested_enable_wrap_raises() -> None:
    with (
        enable_wrap(wrapper_cls=Marker),
        pytest.raises(RuntimeError, match="nested"),
        enable_wrap(wrapper_cls=Marker),
    ):
        pass


def test_transformer_policy_wraps_each_block_only() -> None:
    with enable_wrap(wrapper_cls=Marker):
        model = auto_wrap(_gpt(), transformer_auto_wrap_policy({Block}))
    assert all(isinstance(b, Marker) for b in model.blocks)
    assert not isinstance(model, Marker) and not isinstance(model.blocks, Marker)
    with pytest.raises(ValueError, match="at least one"):
        transformer_auto_wrap_policy([])


def test_size_policy_keeps_tied_weights_in_the_common_ancestor() -> None:
    with enable_wrap(wrapper_cls=Marker):
        model = auto_wrap(_gpt(), size_based_auto_wrap_policy(100))
    # wte (32 x 16 = 512 elements) passes the threshold but is tied to lm_head
    assert isinstance(model, Marker)
    inner = model.module
    assert not isinstance(inner.wte, Marker) and not isinstance(inner.lm_head, Marker)
    assert isinstance(inner.wpe, Marker)  # 8 x 16 = 128 >= 100, not tied
    assert not isinstance(inner.blocks, Marker)  # a ModuleList is never wrapped alone
    assert isinstance(inner.blocks[0].attn.qkv, Marker)  # 16 x 48 + 48 elements
    assert not isinstance(inner.blocks[0], Marker)  # remainder (LayerNorms) below 100


def test_default_policy_threshold_and_leaves() -> None:
    mha = nn.MultiheadAttention(8, 2)
    assert not default_auto_wrap_policy(mha, True, 10**9)  # kept whole: not looked into
    assert default_auto_wrap_policy(mha, False, 10**9)
    assert not default_auto_wrap_policy(nn.Linear(2, 2), False, 10, min_num_params=11)
    assert default_auto_wrap_policy(nn.Linear(2, 2), False, 11, min_num_params=11)
    assert not default_auto_wrap_policy(nn.ModuleList(), False, 10**9)


def test_config_policy_wraps_annotated_modules() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].wrapper_config = {"x": 1}  # type: ignore[assignment]
    with enable_wrap(wrapper_cls=Marker):
        wrapped = auto_wrap(model, config_auto_wrap_policy)
    assert not isinstance(wrapped[0], Marker)
    assert isinstance(wrapped[1], Marker) and wrapped[1].kwargs == {"x": 1}
