"""The one optimizer-step guard: replaced parameters refused, by name; weak, cached, one hook."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks

from shardkit.distributed import optim_guard
from shardkit.distributed.optim_guard import (
    ReplacedParameterError,
    check_optimizer,
    exempt_optimizer,
    is_replaced,
    mark_replaced,
)


def mark(param: torch.Tensor, name: str = "`w` of unit (root)") -> None:
    mark_replaced(param, name=name, wrapper="TestWrapper", fix="Build the optimizer after wrapping")


def step_once(optimizer: torch.optim.Optimizer, *params: torch.Tensor) -> None:
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()


def test_replaced_parameter_is_refused_with_its_name_and_the_fix() -> None:
    kept, replaced = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    mark(replaced)
    optimizer = torch.optim.SGD([kept, replaced], lr=0.5)
    with pytest.raises(ReplacedParameterError) as info:
        step_once(optimizer, kept, replaced)
    assert str(info.value) == (
        "SGD holds the parameter `w` of unit (root), which TestWrapper replaced: "
        "Build the optimizer after wrapping"
    )
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)
    assert torch.equal(kept.detach(), torch.zeros(3))  # refused before any update
    assert is_replaced(replaced) and not is_replaced(kept)


def test_other_optimizers_step_normally() -> None:
    mark(torch.nn.Parameter(torch.zeros(1)))
    p = torch.nn.Parameter(torch.full((2,), 2.0))
    step_once(torch.optim.SGD([p], lr=0.25), p)
    assert torch.equal(p.detach(), torch.full((2,), 1.75))


def test_cached_check_sees_later_marks_and_new_param_groups() -> None:
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([a], lr=1.0)
    step_once(optimizer, a)  # checked and cached
    mark(a, "`a`")
    with pytest.raises(ReplacedParameterError, match="parameter `a`"):
        step_once(optimizer, a)
    fresh = torch.optim.SGD([b], lr=1.0)
    step_once(fresh, b)
    mark(torch.nn.Parameter(torch.zeros(1)))  # a new generation: fresh is walked again
    fresh.add_param_group({"params": [a]})
    with pytest.raises(ReplacedParameterError, match="parameter `a`"):
        check_optimizer(fresh)


def test_exempt_optimizer_steps_replaced_parameters() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    mark(p)
    optimizer = torch.optim.SGD([p], lr=1.0)
    exempt_optimizer(optimizer)
    step_once(optimizer, p)
    assert torch.equal(p.detach(), torch.full((2,), -1.0))


def test_one_global_hook_and_weak_tables() -> None:
    mark(torch.nn.Parameter(torch.zeros(1)))
    hooks = len(_global_optimizer_pre_hooks)
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
    for p in params:
        mark(p)
    assert len(_global_optimizer_pre_hooks) == hooks
    assert optim_guard.check_optimizer in _global_optimizer_pre_hooks.values()
    ref = weakref.ref(params[0])
    optimizer = torch.optim.SGD(params[1:], lr=1.0)
    exempt_optimizer(optimizer)
    opt_ref = weakref.ref(optimizer)
    del params, optimizer
    gc.collect()
    assert ref() is None and opt_ref() is None  # the tables keep nothing alive
