"""Property-based fuzzing: random module trees train with parity under every wrapper.

Hypothesis draws small module trees (depth, widths, tied weights, frozen flags,
zero-size parameters) and a world size from 1 to 4; each tree is trained for a few
SGD-with-momentum steps under FSDP (random ``auto_wrap`` threshold, both reshard
modes) and under OSS + ShardedDataParallel, and must end with the parameters of the
unwrapped model trained on the same global batch (DDP semantics).

Examples per world size: ``SHARDKIT_FUZZ_EXAMPLES`` (default 4, enough for the
15-minute suite; set e.g. 200 for a nightly run).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from shardkit.nn import FullyShardedDataParallel, ShardedDataParallel
from shardkit.nn.wrap import auto_wrap, enable_wrap, size_based_auto_wrap_policy
from shardkit.optim import OSS

EXAMPLES = int(os.environ.get("SHARDKIT_FUZZ_EXAMPLES", "4"))
STEPS = 3
LR, MOMENTUM = 0.05, 0.9


@dataclass(frozen=True)
class Leaf:
    """A width-preserving layer: a Linear (maybe frozen), a zero-size parameter, or a
    Linear tied to the weight of an earlier leaf."""

    kind: str  # "linear" | "zero" | "tied"
    frozen: bool = False
    bias: bool = True


@dataclass(frozen=True)
class Tree:
    width: int
    children: tuple[Leaf | Tree, ...]


class ZeroSize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.empty.sum()


class Node(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def build(tree: Tree, width: int, linears: list[nn.Linear]) -> nn.Module:
    layers: list[nn.Module] = []
    for child in tree.children:
        if isinstance(child, Tree):
            layers.append(build(child, width, linears))
        elif child.kind == "zero":
            layers.append(ZeroSize())
        elif child.kind == "tied" and linears:
            tied = nn.Linear(width, width, bias=False)
            tied.weight = linears[0].weight  # a real shared Parameter, like an LM head
            layers.append(tied)
        else:
            lin = nn.Linear(width, width, bias=child.bias)
            lin.requires_grad_(not child.frozen)
            linears.append(lin)
            layers.append(lin)
    return Node(layers)


def leaves() -> st.SearchStrategy[Leaf]:
    return st.builds(
        Leaf,
        kind=st.sampled_from(["linear", "linear", "linear", "zero", "tied"]),
        frozen=st.booleans(),
        bias=st.booleans(),
    )


def trees(width: int) -> st.SearchStrategy[Tree]:
    return st.recursive(
        st.lists(leaves(), min_size=1, max_size=3).map(lambda c: Tree(width, tuple(c))),
        lambda inner: st.lists(inner | leaves(), min_size=1, max_size=3).map(
            lambda c: Tree(width, tuple(c))
        ),
        max_leaves=6,
    )


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, xs: list[torch.Tensor]) -> None:
    for x in xs:
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


def _batches(width: int, world: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(2 * world, width, generator=gen) for _ in range(STEPS)]


def _reference(tree: Tree) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build(tree, tree.width, [])
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=LR, momentum=MOMENTUM)
    _train(model, opt, _batches(tree.width, dist.get_world_size() if dist.is_initialized() else 1))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _local(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    return [x.chunk(world)[rank] for x in xs]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    worst, where = 0.0, ""
    for k, v in b.items():
        d = float((a[k].double() - v.double()).abs().max()) if v.numel() else 0.0
        if d > worst:
            worst, where = d, k
    return worst, where


def _fsdp_run(tree: Tree, threshold: int, reshard: bool) -> tuple[float, str]:
    torch.manual_seed(0)
    model = build(tree, tree.width, [])
    with enable_wrap(wrapper_cls=FullyShardedDataParallel, reshard_after_forward=reshard):
        wrapped = auto_wrap(model, size_based_auto_wrap_policy(threshold))
    # auto_wrap wraps the root itself when the policy says so
    root = (
        wrapped
        if isinstance(wrapped, FullyShardedDataParallel)
        else FullyShardedDataParallel(wrapped)
    )
    opt = torch.optim.SGD(
        [p for p in root.parameters() if p.requires_grad], lr=LR, momentum=MOMENTUM
    )
    _train(root, opt, _local(_batches(tree.width, dist.get_world_size())))
    return _max_diff(root.state_dict(), _reference(tree))


def _sdp_run(tree: Tree) -> tuple[float, str]:
    torch.manual_seed(0)
    model = build(tree, tree.width, [])
    opt = OSS(
        [p for p in model.parameters() if p.requires_grad],
        optim=torch.optim.SGD,
        lr=LR,
        momentum=MOMENTUM,
    )
    ddp = ShardedDataParallel(model, opt)
    _train(ddp, opt, _local(_batches(tree.width, dist.get_world_size())))
    return _max_diff(model.state_dict(), _reference(tree))


def _all_wrappers(tree: Tree, threshold: int) -> dict[str, tuple[float, str]]:
    if not any(p.requires_grad for p in build(tree, tree.width, []).parameters()):
        return {}  # nothing to train (every layer frozen)
    return {
        "fsdp-reshard": _fsdp_run(tree, threshold, True),
        "fsdp-keep": _fsdp_run(tree, threshold, False),
        "oss+sdp": _sdp_run(tree),
    }


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_random_trees_train_like_the_unwrapped_model(rank_pool, world_size: int) -> None:
    pool = rank_pool(world_size)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        width = data.draw(st.integers(1, 5), label="width")
        tree = data.draw(trees(width), label="tree")
        threshold = data.draw(st.integers(1, 60), label="auto_wrap min_num_params")
        per_rank = pool.run(_all_wrappers, copy.deepcopy(tree), threshold)
        for name, (diff, where) in per_rank[0].items():
            assert diff <= 1e-5, f"{name}: {where} differs by {diff:.3e} for {tree}"

    check()
