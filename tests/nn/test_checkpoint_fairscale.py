"""checkpoint_wrapper's FairScale surface: attributes reach the wrapped module, the
type checks the docs give, ``disable_checkpointing()``, frozen wrapped modules."""

from __future__ import annotations

import torch
from torch import nn

from shardkit.nn.checkpoint import (
    CheckpointWrapper,
    checkpoint_wrapper,
    disable_checkpointing,
    is_checkpointing_disabled,
)


class Counting(nn.Module):
    """FairScale's test model: counts its forwards, returns a list."""

    def __init__(self) -> None:
        super().__init__()
        self.cnt = 0
        self.linear = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.cnt += 1
        return [self.linear(row) for row in x]


class CountingLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cnt = 0
        self.linear = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cnt += 1
        return self.linear(x)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return sum(y.sum() for y in model(x))  # type: ignore[return-value]


def test_attributes_reach_the_wrapped_module() -> None:
    block = Counting()
    block.banana = "sweet"  # type: ignore[assignment]
    wrapped = checkpoint_wrapper(block)
    assert wrapped.cnt == 0 and wrapped.banana == "sweet"
    assert wrapped.linear is block.linear  # submodules too
    _loss(wrapped, torch.rand(4, 2)).backward()
    assert wrapped.cnt == 2 and block.cnt == 2  # forward + recompute, read through
    wrapped.cnt = 10  # an attribute only the wrapped module has: set there
    assert block.cnt == 10 and "cnt" not in wrapped.__dict__
    wrapped.orange = 1  # a new attribute: the wrapper's own
    assert wrapped.orange == 1 and not hasattr(block, "orange")
    assert wrapped.offload_to_cpu is False
    try:
        wrapped.missing  # noqa: B018
    except AttributeError as err:
        assert "missing" in str(err)
    else:
        raise AssertionError("an attribute neither module has must raise AttributeError")


def test_type_checks_as_documented() -> None:
    block = Counting()
    wrapped = checkpoint_wrapper(block)
    assert isinstance(wrapped, CheckpointWrapper) and isinstance(wrapped, nn.Module)
    assert not isinstance(wrapped, Counting)  # FairScale returns the block itself
    assert wrapped.module is block
    assert isinstance(getattr(wrapped, "module", wrapped), Counting)  # the documented check
    assert [n for n, _ in wrapped.named_parameters()] == [
        "module.linear.weight",
        "module.linear.bias",
    ]
    assert list(wrapped.state_dict()) == ["linear.weight", "linear.bias"]
    wrapped.eval()
    assert block.training is False and wrapped.training is False
    wrapped.train()
    assert block.training is True


def test_disable_checkpointing() -> None:
    x = torch.rand(4, 2)
    model1, model2 = checkpoint_wrapper(Counting()), checkpoint_wrapper(Counting())
    model2.load_state_dict(model1.state_dict())
    loss1 = _loss(model1, x)
    loss1.backward()
    assert model1.cnt == 2  # forward, then the recompute in backward
    assert not is_checkpointing_disabled()
    with disable_checkpointing():
        assert is_checkpointing_disabled()
        with disable_checkpointing():
            pass
        assert is_checkpointing_disabled()  # nesting keeps the outer state
        loss2 = _loss(model2, x)
        loss2.backward()
    assert not is_checkpointing_disabled()
    assert model2.cnt == 1  # no recompute
    # the same loss and gradients either way
    assert torch.equal(loss1, loss2)
    for p1, p2 in zip(model1.parameters(), model2.parameters()):
        assert torch.allclose(p1.grad, p2.grad, atol=1e-7)  # type: ignore[arg-type]


def test_frozen_regions_run_once() -> None:
    """FairScale's test_checkpoint_requires_grad: a region whose output needs no
    gradient is not recomputed."""
    x = torch.rand(4, 2)
    model = nn.Sequential(*(checkpoint_wrapper(CountingLinear()) for _ in range(4)))
    for k in range(3):
        model[k].requires_grad_(False)
    model(x).sum().backward()
    assert [m.cnt for m in model] == [1, 1, 1, 2]
    model = nn.Sequential(*(checkpoint_wrapper(CountingLinear()) for _ in range(4)))
    model[1].requires_grad_(False)
    model[2].requires_grad_(False)
    model(x).sum().backward()
    assert [m.cnt for m in model] == [2, 2, 2, 2]
