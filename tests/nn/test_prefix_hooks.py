"""The one pair of state-dict prefix hooks (shardkit.nn.prefix_hooks)."""

from __future__ import annotations

import torch
from torch import nn

from shardkit.nn.checkpoint import checkpoint_wrapper


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].submodule = nn.Linear(2, 1)  # a user's own name containing "module."
    return model


def test_wrapped_and_plain_state_dicts_share_keys_and_load_both_ways() -> None:
    plain = _model()
    wrapped = _model()
    wrapped[1] = checkpoint_wrapper(wrapped[1])
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    wrapped.load_state_dict(plain.state_dict())
    for (name, a), b in zip(wrapped.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


def test_missing_and_unexpected_keys_show_plain_names() -> None:
    wrapped = _model()
    wrapped[1] = checkpoint_wrapper(wrapped[1])
    state = _model().state_dict()
    del state["1.submodule.bias"]
    state["1.extra"] = torch.zeros(1)
    result = wrapped.load_state_dict(state, strict=False)
    assert result.missing_keys == ["1.submodule.bias"]
    assert result.unexpected_keys == ["1.extra"]
