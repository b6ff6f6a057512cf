"""Attribute forwarding from each wrapper to the module it wraps (shardkit.nn.forwarding).

FSDP, ShardedDataParallel and checkpoint_wrapper share one ``__getattr__``: a user
attribute and method of the wrapped module are reachable through the wrapper; a
missing one raises AttributeError naming the wrapper class and the attribute, also on a
half-built wrapper (inside ``__init__``, or made by ``cls.__new__`` as copy and pickle
do), never RecursionError; copy and pickle find the wrapper's protocol, not the
wrapped module's.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from shardkit.nn import FullyShardedDataParallel, ShardedDataParallel, checkpoint_wrapper
from shardkit.nn.checkpoint import CheckpointWrapper
from shardkit.optim import OSS
from shardkit.testing import RankPool

WRAPPERS: list[type[nn.Module]] = [
    CheckpointWrapper,
    ShardedDataParallel,
    FullyShardedDataParallel,
]


class Block(nn.Module):
    """A user module with a plain attribute, a dict attribute and a method."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 3.0
        self.config = {"hidden": 4}

    def doubled_scale(self) -> float:
        return 2 * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class CopiesItself(Block):
    """A wrapped module with its own copy protocol: the wrapper must not borrow it."""

    copied_by_own_protocol = False

    def __deepcopy__(self, memo: dict[int, Any]) -> CopiesItself:
        clone = CopiesItself()
        clone.copied_by_own_protocol = True
        return clone


def _build(kind: str, module: nn.Module) -> nn.Module:
    if kind == "CheckpointWrapper":
        return checkpoint_wrapper(module)
    if kind == "ShardedDataParallel":
        return ShardedDataParallel(module, OSS(module.parameters(), torch.optim.SGD, lr=0.1))
    return FullyShardedDataParallel(module)


def _error(read: Callable[[], Any]) -> str:
    """``ExceptionType: message`` of what ``read()`` raises (``"no error"`` if none)."""
    try:
        read()
    except (AttributeError, RecursionError, KeyError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _probe(kind: str) -> dict[str, Any]:
    """On a rank: what a built wrapper of ``kind`` forwards and what it refuses."""
    wrapper: Any = _build(kind, Block())  # attributes come from Block, through the wrapper
    out = {
        "class": type(wrapper).__name__,
        "scale": wrapper.scale,
        "config": wrapper.config,
        "method": wrapper.doubled_scale(),
        "child": type(wrapper.lin).__name__,
        "output": wrapper(torch.ones(2, 4)).shape[0],
        "missing": _error(lambda: wrapper.no_such_attribute),
        "hasattr": hasattr(wrapper, "no_such_attribute"),
    }
    with_copy = _build(kind, CopiesItself())
    out["borrows __deepcopy__"] = hasattr(with_copy, "__deepcopy__")
    return out


def _probe_all() -> list[dict[str, Any]]:
    return [_probe(cls.__name__) for cls in WRAPPERS]


@pytest.fixture(scope="module")
def built(rank_pool: Callable[[int], RankPool]) -> list[dict[str, Any]]:
    """Every wrapper built on 2 ranks, probed on rank 0 (both ranks must agree)."""
    ranks = rank_pool(2).run(_probe_all)
    assert ranks[0] == ranks[1]
    return ranks[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("index", range(len(WRAPPERS)), ids=[w.__name__ for w in WRAPPERS])
def test_user_attributes_and_methods_are_reachable(built: list[dict[str, Any]], index: int) -> None:
    probe = built[index]
    assert probe["class"] == WRAPPERS[index].__name__
    assert probe["scale"] == 3.0
    assert probe["config"] == {"hidden": 4}
    assert probe["method"] == 6.0
    assert probe["child"] == "Linear"
    assert probe["output"] == 2


@pytest.mark.parametrize("index", range(len(WRAPPERS)), ids=[w.__name__ for w in WRAPPERS])
def test_missing_attribute_names_the_wrapper_and_the_attribute(
    built: list[dict[str, Any]], index: int
) -> None:
    name = WRAPPERS[index].__name__
    probe = built[index]
    assert probe["missing"].startswith(f"AttributeError: '{name}' object has no attribute")
    assert "'no_such_attribute'" in probe["missing"]
    assert "Block" in probe["missing"]  # the wrapped module's class
    assert probe["hasattr"] is False


@pytest.mark.parametrize("index", range(len(WRAPPERS)), ids=[w.__name__ for w in WRAPPERS])
def test_copy_protocol_is_not_borrowed_from_the_wrapped_module(
    built: list[dict[str, Any]], index: int
) -> None:
    assert built[index]["borrows __deepcopy__"] is False


@pytest.mark.parametrize("cls", WRAPPERS, ids=[w.__name__ for w in WRAPPERS])
def test_half_built_wrapper_raises_attribute_error_not_recursion(cls: type[nn.Module]) -> None:
    bare = cls.__new__(cls)  # as copy and pickle make it: not even nn.Module's state
    in_init = cls.__new__(cls)
    nn.Module.__init__(in_init)  # inside __init__, before the wrapped module is set
    for half in (bare, in_init):
        message = _error(lambda: half.no_such_attribute)  # noqa: B023
        assert message.startswith(f"AttributeError: '{cls.__name__}' object has no attribute")
        assert "'no_such_attribute'" in message
        assert "not set yet" in message
        assert getattr(half, "__deepcopy__", None) is None
        assert not hasattr(half, "scale")


@pytest.mark.parametrize("cls", WRAPPERS, ids=[w.__name__ for w in WRAPPERS])
def test_half_built_wrapper_copies_and_pickles(cls: type[nn.Module]) -> None:
    in_init = cls.__new__(cls)
    nn.Module.__init__(in_init)
    for half in (cls.__new__(cls), in_init):
        for clone in (copy.copy(half), copy.deepcopy(half), pickle.loads(pickle.dumps(half))):
            assert type(clone) is cls
            assert _error(lambda: clone.scale).startswith("AttributeError")  # noqa: B023


def test_deepcopy_of_checkpoint_wrapper_copies_the_wrapper() -> None:
    wrapped = checkpoint_wrapper(CopiesItself())
    clone = copy.deepcopy(wrapped)
    assert type(clone) is CheckpointWrapper
    assert clone.scale == 3.0
    assert isinstance(clone.module, CopiesItself)
    assert clone.module is not wrapped.module
    assert clone.module.copied_by_own_protocol  # the wrapped module's own protocol, inside
