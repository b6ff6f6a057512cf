"""A one-rank stand-in process group (an object with ``rank()`` and ``size()``, as
FairScale's ``DummyProcessGroup``) without ``init_process_group``: FSDP (nested through
``enable_wrap``), OSS and OSS + ShardedDataParallel train exactly as the plain model;
a stand-in that would have to communicate is refused."""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.nn import FSDP, ShardedDataParallel, enable_wrap, wrap
from shardkit.optim import OSS


class StandIn:
    """FairScale's ``DummyProcessGroup``: a rank and a size, nothing else."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    )


def _fsdp(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    with enable_wrap(wrapper_cls=FSDP, process_group=StandIn(), flatten_parameters=False):
        model[2] = wrap(model[2])
    wrapped = FSDP(model, process_group=StandIn())
    return wrapped, torch.optim.Adam(wrapped.parameters(), lr=0.05)


def _oss(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    return model, OSS(model.parameters(), torch.optim.Adam, lr=0.05, group=StandIn())


def _sdp(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    optimizer = OSS(model.parameters(), torch.optim.Adam, lr=0.05, group=StandIn())
    return ShardedDataParallel(model, optimizer, process_group=StandIn()), optimizer


def _train_as_plain(build: Callable[[nn.Module], tuple[nn.Module, torch.optim.Optimizer]]) -> None:
    reference = _model()
    model, optimizer = build(copy.deepcopy(reference))
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=0.05)
    torch.manual_seed(1)
    for _ in range(4):
        x = torch.randn(6, 4)
        for net, opt in ((reference, ref_optimizer), (model, optimizer)):
            opt.zero_grad()
            net(x).pow(2).sum().backward()
            opt.step()
    expected = reference.state_dict()
    got = (model.module if isinstance(model, ShardedDataParallel) else model).state_dict()
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert (got["0.weight"] - _model().state_dict()["0.weight"]).abs().max() > 0.05  # it trained
    if isinstance(optimizer, OSS):  # a sharded checkpoint of one rank, written and read back
        with tempfile.TemporaryDirectory() as directory:
            optimizer.save_sharded(directory)
            optimizer.load_sharded(directory)
        optimizer.consolidate_state_dict()
        state = optimizer.state_dict()["state"]
        ref_state = ref_optimizer.state_dict()["state"]
        for key, entry in ref_state.items():
            torch.testing.assert_close(state[key]["exp_avg"], entry["exp_avg"], rtol=0, atol=1e-6)


BUILDS = [_fsdp, _oss, _sdp]


@pytest.mark.parametrize("build", BUILDS, ids=["fsdp", "oss", "sdp"])
def test_one_rank_stand_in_trains_as_the_plain_model(
    build: Callable[[nn.Module], tuple[nn.Module, torch.optim.Optimizer]],
) -> None:
    assert not dist.is_initialized()  # no process group at all
    _train_as_plain(build)


def _all_builds() -> int:
    for build in BUILDS:
        _train_as_plain(build)
    return dist.get_world_size()


def test_one_rank_stand_in_next_to_an_initialised_world(rank_pool: Any) -> None:
    # the world group exists (1 rank) but the wrappers get the stand-in, as FairScale's tests
    assert rank_pool(1).run(_all_builds) == [1]


def test_stand_in_that_would_communicate_is_refused() -> None:
    with pytest.raises(ValueError, match=r"StandIn with rank\(\) 1 and size\(\) 2.*new_group"):
        FSDP(nn.Linear(2, 2), process_group=StandIn(1, 2))
    with pytest.raises(ValueError, match=r"size\(\) 2"):
        OSS(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1, group=StandIn(0, 2))
    with pytest.raises(TypeError, match="got a str"):
        FSDP(nn.Linear(2, 2), process_group="world")  # type: ignore[arg-type]
