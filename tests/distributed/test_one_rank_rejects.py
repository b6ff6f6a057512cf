"""A bad input on one rank only stops every rank at wrap time, not at the timeout.

Bad parameters, a module wrapped twice, an OSS without parameters or with a learning
rate its optimizer refuses, an invalid FSDP option. Rank 1 gets the bad input, rank 0 a good one. Rank 1 must raise its own error; rank 0
must raise PeerRejectedError naming rank 1 and its message, well before the group's
60 s timeout (the bound is half of it: a regression waits the whole timeout in the
first collective and then fails with CollectiveError).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.consistency import PeerRejectedError
from shardkit.nn import FullyShardedDataParallel, ShardedDataParallel
from shardkit.optim import OSS

_TIMEOUT_S = 60.0

Case = Callable[[dist.ProcessGroup, bool], Callable[[], object]]


def _model(extra: torch.Tensor | None = None) -> nn.Module:
    model = nn.Sequential(nn.Linear(2, 2))
    if extra is not None:
        model[0].register_parameter("extra", nn.Parameter(extra, requires_grad=False))
    return model


def _oss_int(group: dist.ProcessGroup, bad: bool) -> Callable[[], object]:
    """A complex parameter (frozen integer ones are accepted, as by FairScale and DDP)."""
    model = _model(torch.zeros(3, dtype=torch.complex64) if bad else torch.zeros(3))
    optimizer = OSS(model.parameters(), lr=0.1, group=group)
    return optimizer.step  # the first collective rank 0 would wait in


def _oss_meta(group: dist.ProcessGroup, bad: bool) -> Callable[[], object]:
    model = nn.Linear(2, 2, device="meta" if bad else "cpu")
    optimizer = OSS(model.parameters(), lr=0.1, group=group)
    return optimizer.step


def _sdp_meta(group: dist.ProcessGroup, bad: bool) -> Callable[[], object]:
    """A frozen parameter (in no optimizer) on meta on rank 1: OSS accepts, SDP refuses."""
    model = _model(torch.zeros(3, device="meta" if bad else "cpu"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    wrapped = ShardedDataParallel(model, OSS(trainable, lr=0.1, group=group), group)
    return lambda: wrapped(torch.ones(1, 2)).sum().backward()


def _sdp_orphan(group: dist.ProcessGroup, bad: bool) -> Callable[[], object]:
    """Rank 1's module has a trainable parameter its OSS does not hold."""
    model = _model()
    if bad:
        model[0].register_parameter("extra", nn.Parameter(torch.zeros(3)))
    optimizer = OSS([model[0].weight, model[0].bias], lr=0.1, group=group)
    wrapped = ShardedDataParallel(model, optimizer, group)
    return lambda: wrapped(torch.ones(1, 2)).sum().backward()


def _fsdp_int(group: dist.ProcessGroup, bad: bool) -> Callable[[], object]:
    model = _model(torch.zeros(3, dtype=torch.int64) if bad else torch.zeros(3))
    wrapped = FullyShardedDataParallel(model, process_group=group)
    return lambda: wrapped(torch.ones(1, 2))


class _NoInit(nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2, 2, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def _fsdp_meta_no_init(group: dist.ProcessGroup, bad: bool) -> Callable[[], object]:
    """Rank 1's meta module has no reset_parameters (its deferred init fails); the
    descriptions match, so only the error exchange can stop rank 0."""
    inner = _NoInit("meta" if bad else "cpu")
    outer = nn.Sequential(FullyShardedDataParallel(inner, process_group=group), nn.Linear(2, 2))
    wrapped = FullyShardedDataParallel(outer, process_group=group)
    return lambda: wrapped(torch.ones(1, 2))


def _oss_of_oss(group: dist.ProcessGroup, bad: bool) -> Callable[[], object]:
    """Both ranks build an OSS; rank 1 then wraps that OSS again (rank 0 its parameters)."""
    model = _model()
    first = OSS(model.parameters(), lr=0.1, group=group)
    optimizer = OSS(first if bad else model.parameters(), lr=0.1, group=group)
    return optimizer.step


def _oss_optim_oss(group: dist.ProcessGroup, bad: bool) -> Callable[[], object]:
    optim = OSS if bad else torch.optim.SGD
    optimizer = OSS(_model().parameters(), optim=optim, lr=0.1, group=group)
    return optimizer.step


def _oss_empty(group: dist.ProcessGroup, bad: bool) -> Callable[[], object]:
    """Rank 1 passes a generator another optimizer consumed already."""
    params = _model().parameters()
    if bad:
        torch.optim.SGD(params, lr=0.1)
    return OSS(params, lr=0.1, group=group).step


def _oss_empty_groups(group: dist.ProcessGroup, bad: bool) -> Callable[[], object]:
    """Rank 1's only param group is empty (was an IndexError after the exchange)."""
    params = [] if bad else list(_model().parameters())
    return OSS([{"params": params}], lr=0.1, group=group).step


def _oss_bad_lr(group: dist.ProcessGroup, bad: bool) -> Callable[[], object]:
    """The inner optimizer refuses rank 1's learning rate (OSS compares only its class)."""
    optimizer = OSS(_model().parameters(), lr=-1.0 if bad else 0.1, group=group)
    return optimizer.step


def _fsdp_twice(group: dist.ProcessGroup, bad: bool) -> Callable[[], object]:
    """Rank 1 wraps a module whose parameters a unit already shards, rank 0 a fresh one
    (wrapping the unit itself is fine: FairScale's auto_wrap-then-FSDP pattern)."""
    model = _model()
    FullyShardedDataParallel(model, process_group=group)
    wrapped = FullyShardedDataParallel(model if bad else _model(), process_group=group)
    return lambda: wrapped(torch.ones(1, 2))


def _fsdp_option(group: dist.ProcessGroup, bad: bool) -> Callable[[], object]:
    wrapped = FullyShardedDataParallel(_model(), process_group=group, bucket_cap_mb=0 if bad else 1)
    return lambda: wrapped(torch.ones(1, 2))


Outcome = tuple[str, float, object]  # the error's text, seconds, PeerRejectedError's fields


def _outcome(case: Case, group: dist.ProcessGroup) -> Outcome:
    start = time.monotonic()
    try:
        case(group, dist.get_rank(group) == 1)()
    except PeerRejectedError as err:
        fields = (err.rank, err.error)
        return f"{type(err).__name__}: {err}", time.monotonic() - start, fields
    except Exception as err:
        return f"{type(err).__name__}: {err}", time.monotonic() - start, None
    return "ok", time.monotonic() - start, None


def _cases() -> dict[str, Outcome]:
    group = dist.new_group([0, 1], timeout=timedelta(seconds=_TIMEOUT_S))
    cases: dict[str, Case] = {
        "oss-int": _oss_int,
        "oss-meta": _oss_meta,
        "sdp-meta": _sdp_meta,
        "sdp-orphan": _sdp_orphan,
        "fsdp-int": _fsdp_int,
        "fsdp-meta-no-init": _fsdp_meta_no_init,
        "oss-of-oss": _oss_of_oss,
        "oss-optim-oss": _oss_optim_oss,
        "oss-empty": _oss_empty,
        "oss-empty-groups": _oss_empty_groups,
        "oss-bad-lr": _oss_bad_lr,
        "fsdp-twice": _fsdp_twice,
        "fsdp-option": _fsdp_option,
    }
    return {name: _outcome(case, group) for name, case in cases.items()}


def test_a_bad_parameter_on_one_rank_stops_every_rank_at_once(rank_pool: Any) -> None:
    good, bad = rank_pool(2).run(_cases)
    own = {
        "oss-int": "TypeError: OSS: parameter `param_groups[0][2]` (shape (3,)) has the complex dtype "
        "torch.complex64",
        "oss-meta": "ValueError: OSS: parameter `param_groups[0][0]` (shape (2, 2)) is on the "
        "meta device",
        "sdp-meta": "ValueError: ShardedDataParallel: parameter `0.extra` (shape (3,)) is on "
        "the meta device",
        "sdp-orphan": "ValueError: 1 trainable parameters of the module (shapes [(3,)]) are in "
        "no OSS optimizer",
        "fsdp-int": "TypeError: FullyShardedDataParallel: parameter `0.extra` (shape (3,)) has "
        "the dtype torch.int64",
        "fsdp-meta-no-init": "ValueError: module `_NoInit` (_NoInit) has parameters on the meta "
        "device and no reset_parameters()",
        "oss-of-oss": "TypeError: OSS got an instance of OSS as its parameters",
        "oss-optim-oss": "TypeError: OSS(optim=OSS) would shard an already sharded optimizer",
        "oss-empty": "ValueError: OSS got an empty parameter list",
        "oss-empty-groups": "ValueError: OSS got an empty parameter list",
        "oss-bad-lr": "ValueError: Invalid learning rate: -1.0",
        "fsdp-twice": "ValueError: parameter `0.weight` of the FSDP unit wrapping Sequential "
        "is already sharded by an FSDP unit",
        "fsdp-option": "ValueError: bucket_cap_mb must be > 0 megabytes; got 0",
    }
    what = {
        "oss-int": "OSS",
        "oss-meta": "OSS",
        "sdp-meta": "ShardedDataParallel",
        "sdp-orphan": "ShardedDataParallel",
        "fsdp-int": "FullyShardedDataParallel (the FSDP unit wrapping Sequential)",
        "fsdp-meta-no-init": "FullyShardedDataParallel (the FSDP unit wrapping _NoInit)",
        **{
            f"oss-{case}": "OSS"
            for case in ("of-oss", "optim-oss", "empty", "empty-groups", "bad-lr")
        },
        "fsdp-twice": "FullyShardedDataParallel (the FSDP unit wrapping Sequential)",
        "fsdp-option": "FullyShardedDataParallel (the FSDP unit wrapping Sequential)",
    }
    for name, start in own.items():
        assert bad[name][0].startswith(start), (name, bad[name][0])
        message, elapsed, fields = good[name]
        peer = f"PeerRejectedError: {what[name]}: rank 1 rejected its parameters: {start}"
        assert message.startswith(peer), (name, message)
        assert "fix the inputs of rank 1" in message, message
        assert fields == (1, bad[name][0]), (name, fields)  # rank 1's own error, verbatim
        assert elapsed < _TIMEOUT_S / 2, (name, elapsed)  # a bound, not a speed test
