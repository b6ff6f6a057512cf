"""checkpoint_wrapper: same outputs and gradients, recompute happens, BatchNorm once."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from shardkit.nn.checkpoint import checkpoint_wrapper
from shardkit.testing import assert_state_dicts_close, assert_tensors_close


class KwargsBlock(nn.Module):
    """Takes a keyword argument and returns non-tensor values alongside tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)
        self.calls = 0

    def forward(self, x: torch.Tensor, *, scale: float = 1.0, mask: Any = None) -> Any:
        self.calls += 1
        y = torch.tanh(self.norm(self.lin(x))) * scale
        return y, {"aux": y.sum(), "tag": "block"}, None


def _run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    y, extra, none = model(x, scale=0.5, mask=None)
    assert none is None and extra["tag"] == "block"
    (y.pow(2).sum() + extra["aux"]).backward()
    return y.detach(), {n.removeprefix("module."): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_parity_kwargs_nontensor_and_batchnorm_once(offload: bool, momentum: float | None) -> None:
    torch.manual_seed(0)
    plain = KwargsBlock()
    plain.norm.momentum = momentum
    wrapped = checkpoint_wrapper(copy.deepcopy(plain), offload_to_cpu=offload)
    for step in range(3):
        x = torch.randn(5, 6, requires_grad=True)
        x2 = x.detach().clone().requires_grad_(True)
        y_ref, g_ref = _run(plain, x)
        y, g = _run(wrapped, x2)
        assert_tensors_close(y, y_ref, atol=0, rtol=0, name=f"step {step} output")
        for name, grad in g_ref.items():
            assert_tensors_close(g[name], grad, atol=1e-6, name=name)
        assert_tensors_close(x2.grad, x.grad, atol=1e-6, name="input grad")
        for p in [*plain.parameters(), *wrapped.parameters()]:
            p.grad = None
    # running statistics updated once per forward, exactly as the plain module
    assert_state_dicts_close(wrapped.state_dict(), plain.state_dict(), atol=0, rtol=0)
    assert int(wrapped.state_dict()["norm.num_batches_tracked"]) == 3
    # the forward ran twice per step: once in forward, once recomputed in backward
    assert plain.calls == 3 and wrapped.module.calls == 6


def test_no_grad_runs_once_and_state_dict_keys_are_plain() -> None:
    block = KwargsBlock()
    wrapped = checkpoint_wrapper(block)
    with torch.no_grad():
        wrapped(torch.randn(2, 6))
    assert block.calls == 1
    assert list(wrapped.state_dict()) == list(KwargsBlock().state_dict())
    other = KwargsBlock()
    checkpoint_wrapper(other).load_state_dict(block.state_dict())
    assert_state_dicts_close(other, block, atol=0, rtol=0)


def test_nested_in_sequential_saves_activations() -> None:
    # The wrapped model keeps fewer saved tensors: count them with saved-tensor hooks.
    def count_saved(model: nn.Module) -> int:
        n = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal n
            n += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randn(4, 16, requires_grad=True)).sum().backward()
        return n

    layers = [nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)) for _ in range(4)]
    plain = nn.Sequential(*layers)
    wrapped = nn.Sequential(*(checkpoint_wrapper(copy.deepcopy(m)) for m in layers))
    assert count_saved(wrapped) < count_saved(plain)


def test_bad_input() -> None:
    with pytest.raises(TypeError, match="expects an nn.Module, got function"):
        checkpoint_wrapper(lambda x: x)  # type: ignore[arg-type]


def test_retain_graph_backward_twice_recomputes_twice() -> None:
    """Regression: the recompute context was a one-shot generator, so the second
    backward of a ``retain_graph=True`` graph raised AttributeError (torch enters the
    context ``context_fn`` returned once per recompute)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(5, 4)
    losses = [m(x).square().sum() for m in (plain, wrapped)]
    for loss in losses:
        loss.backward(retain_graph=True)
        loss.backward()
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters()):
        assert q.grad is not None and p.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6)
    # two recomputes, BatchNorm statistics counted once (the forward's update only)
    assert int(wrapped.module[1].num_batches_tracked) == 1
    assert_state_dicts_close(wrapped.module.state_dict(), plain.state_dict())
