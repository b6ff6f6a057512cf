"""Wrapping policies (no process group needed: a plain marker wrapper)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from shardkit.models import GPT, Block, GPTConfig
from shardkit.nn.wrap import (
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    is_wrapper_unit,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)


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


# FairScale's default_auto_wrap_policy surface -------------------------------------


class Unit(nn.Module):
    """A wrapper from another library that marks itself as a unit (as FSDP does)."""

    _shardkit_wrapper_unit = True

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


class Forwarding(nn.Module):
    """A wrapper that forwards unknown attributes to its inner module."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.inner = module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


class WithOwnParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(200))
        self.child = nn.Linear(10, 10)  # 110 elements


def _size(min_num_params: int, **kwargs: Any) -> Any:
    return functools.partial(default_auto_wrap_policy, min_num_params=min_num_params, **kwargs)


def _tree() -> nn.Sequential:  # FairScale's test tree: 30 + 60 elements
    return nn.Sequential(nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5)))


def test_default_policy_class_sets_are_fairscales_sets() -> None:
    leaves = default_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
    excluded = default_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]
    assert leaves == {nn.MultiheadAttention}
    assert excluded == {nn.ModuleList, nn.ModuleDict}
    assert leaves.union({nn.Linear}) == {nn.MultiheadAttention, nn.Linear}


def test_class_sets_are_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_auto_wrap_policy, "EXCLUDE_WRAP_MODULES", {nn.Linear})
    assert not default_auto_wrap_policy(nn.Linear(2, 2), False, 10**9)
    assert default_auto_wrap_policy(nn.ModuleList(), False, 10**9)


def test_root_not_wrapped_when_its_remainder_is_small() -> None:
    with enable_wrap(wrapper_cls=Marker):
        model = auto_wrap(_tree(), auto_wrap_policy=_size(60))
    assert isinstance(model, nn.Sequential) and isinstance(model[0], nn.Linear)
    assert isinstance(model[1], Marker)
    assert all(isinstance(m, nn.Linear) for m in model[1].module)


def test_skip_params_check_for_root_wraps_the_root() -> None:
    with enable_wrap(wrapper_cls=Marker):
        model = auto_wrap(_tree(), auto_wrap_policy=_size(60, skip_params_check_for_root=True))
    assert isinstance(model, Marker)
    assert isinstance(model.module[0], nn.Linear) and isinstance(model.module[1], Marker)
    # as in FairScale, a root below the threshold is not looked into, so not wrapped
    small = nn.Sequential(nn.Linear(2, 2))
    with enable_wrap(wrapper_cls=Marker):
        assert auto_wrap(small, _size(60, skip_params_check_for_root=True)) is small
    policy = size_based_auto_wrap_policy(60, skip_params_check_for_root=True)
    assert policy(module=nn.Linear(2, 2), recurse=False, unwrapped_params=0, module_is_root=True)


def test_root_wrapped_when_its_remainder_is_large() -> None:
    """FairScale's rule: the root's own 200 elements reach the threshold, so the root is
    wrapped after its child; ``FSDP(model)`` afterwards makes an outer unit."""
    with enable_wrap(wrapper_cls=Marker):
        model = auto_wrap(WithOwnParam(), _size(100))
    assert isinstance(model, Marker) and isinstance(model.module.child, Marker)


def test_exclude_wrap_modules() -> None:
    with enable_wrap(wrapper_cls=Marker):
        two = auto_wrap(nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)]), _size(40))
        one = auto_wrap(nn.ModuleList([nn.Linear(10, 10)]), _size(40))
        custom = auto_wrap(_tree(), _size(20, exclude_wrap_modules={nn.Linear}))
    assert isinstance(two, nn.ModuleList) and all(isinstance(m, nn.Linear) for m in two)
    assert isinstance(one, nn.ModuleList) and isinstance(one[0], Marker)
    assert isinstance(custom, Marker) and isinstance(custom.module[1], Marker)
    assert isinstance(custom.module[0], nn.Linear)


def test_force_leaf_modules_are_neither_entered_nor_wrapped() -> None:
    with enable_wrap(wrapper_cls=Marker):
        model = auto_wrap(
            nn.Sequential(nn.Linear(10, 10), nn.MultiheadAttention(100, 1)), _size(40)
        )
    assert isinstance(model, Marker) and isinstance(model.module[0], Marker)
    assert isinstance(model.module[1], nn.MultiheadAttention)
    assert isinstance(model.module[1].out_proj, nn.Linear)
    leaves = default_auto_wrap_policy.FORCE_LEAF_MODULES.union({nn.Linear})  # type: ignore[attr-defined]
    tree = nn.Sequential(nn.Linear(10, 10), nn.ModuleList([nn.Linear(10, 10)]))
    with enable_wrap(auto_wrap_policy=_size(40, force_leaf_modules=leaves), wrapper_cls=Marker):
        model = auto_wrap(tree)
    assert isinstance(model, Marker)  # nothing inside was wrapped: the root holds it all
    assert isinstance(model.module[0], nn.Linear) and isinstance(model.module[1][0], nn.Linear)


# wrapping with any wrapper class --------------------------------------------------


def test_marked_units_are_not_entered_counted_or_rewrapped() -> None:
    inner = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    model = nn.Sequential(Unit(inner), nn.Linear(5, 5))
    with enable_wrap(wrapper_cls=Marker):
        wrapped = auto_wrap(model, _size(40))
    # the unit's 220 elements do not count: the 30 left are below the threshold
    assert wrapped is model and isinstance(model[0], Unit) and model[0].module is inner
    assert all(isinstance(m, nn.Linear) for m in inner)
    assert is_wrapper_unit(Unit(nn.Linear(1, 1)))


def test_marker_is_read_from_the_class() -> None:
    forwarding = Forwarding(Unit(nn.Linear(1, 1)))
    assert forwarding._shardkit_wrapper_unit is True  # forwarded from the inner unit
    assert not is_wrapper_unit(forwarding)
    lin = nn.Linear(1, 1)
    lin._shardkit_wrapper_unit = True  # type: ignore[assignment]
    assert not is_wrapper_unit(lin)


def test_second_pass_does_not_rewrap() -> None:
    with enable_wrap(wrapper_cls=Marker):
        once = auto_wrap(WithOwnParam(), _size(100))
        twice = auto_wrap(once, _size(100))
    assert twice is once and isinstance(once.module.child, Marker)
    assert not isinstance(once.module.child.module, Marker)


def test_wrapper_may_be_any_callable() -> None:
    calls: list[dict[str, Any]] = []

    def make(module: nn.Module, **kwargs: Any) -> nn.Module:
        calls.append(kwargs)
        return Unit(module)

    with enable_wrap(wrapper_cls=make, a=1):
        model = auto_wrap(_tree(), _size(60), a=2, b=3)  # overrides reach every wrap
        again = auto_wrap(model, _size(1))  # units made by ``make`` are marked: kept
    assert again is model and calls == [{"a": 2, "b": 3}, {"a": 1}]
    assert isinstance(model[0], Unit) and isinstance(model[1], Unit)
    assert all(isinstance(m, nn.Linear) for m in model[1].module)


def test_policy_is_called_with_fairscales_keywords() -> None:
    seen: list[tuple[bool, int, bool]] = []

    def policy(module: nn.Module, unwrapped_params: int, **kwargs: Any) -> bool:
        seen.append((kwargs["recurse"], unwrapped_params, kwargs["module_is_root"]))
        return bool(kwargs["recurse"])

    with enable_wrap(policy, wrapper_cls=Marker):  # the policy may come first, positionally
        auto_wrap(nn.Sequential(nn.Linear(2, 2)))
    assert seen[0] == (True, 6, True) and seen[-1] == (False, 6, True)


def test_move_module_cuda_half(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nn.Module, "cuda", lambda self, device=None: self)  # no GPU needed
    with enable_wrap(wrapper_cls=Marker, move_module_cuda_half=True, a=1):
        wrapped = wrap(nn.Linear(2, 2))
    assert isinstance(wrapped, Marker) and wrapped.kwargs == {"a": 1}
    assert wrapped.module.weight.dtype == torch.float16
    with enable_wrap(wrapper_cls=Marker):  # reset when the context ends
        assert wrap(nn.Linear(2, 2)).module.weight.dtype == torch.float32
