"""Rank-side workers of test_buffers_follow_ddp: every wrapper next to torch DDP.

Each rank builds the same BatchNorm model twice, once under torch DDP (the reference)
and once under the wrapper of the configuration, runs the same operations on both
with the same local data, and records both models' buffers after every operation
(top level: pickled to spawned ranks).
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.nn import ShardedDataParallel
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy
from shardkit.optim import OSS

# "-local": broadcast_buffers=False against DDP(forward_sync_buffers=False)
WRAPPERS = ("fsdp-flat", "fsdp-nested", "sdp", "oss-ddp", "fsdp-nested-local", "sdp-local")
STEPS = 2  # of two micro-batches each, the first under no_sync


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.bn(self.fc(x)))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 8)
        self.bn = nn.BatchNorm1d(8)
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.tanh(self.bn(self.fc(x))))


class BNNet(nn.Module):
    """BatchNorm on the input (its statistics depend on data and buffers only), then
    BatchNorms behind trained layers; ``Outer`` and ``Inner`` are units nested twice."""

    def __init__(self) -> None:
        super().__init__()
        self.bn0 = nn.BatchNorm1d(5)
        self.outer = Outer()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.outer(self.bn0(x)))


def bn_net() -> BNNet:
    """The same parameters on every rank, different buffers (rank 0's must win)."""
    torch.manual_seed(0)
    model = BNNet()
    rank = dist.get_rank()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm1d):
            assert m.running_mean is not None and m.running_var is not None
            m.running_mean.fill_(0.5 * rank)
            m.running_var.fill_(1.0 + rank)
    return model


def batch(index: int) -> torch.Tensor:
    """Rank-dependent data: each rank's BatchNorm statistics differ."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(9000 + 10 * index + rank)
    return torch.randn(6, 5, generator=g) * (1 + rank) + rank


class Pair:
    """torch DDP + SGD and the wrapper + its optimizer, driven by the same operations."""

    def __init__(self, wrapper: str, group: dist.ProcessGroup) -> None:
        plain = bn_net()
        sync = not wrapper.endswith("-local")
        self.ddp = DDP(copy.deepcopy(plain), process_group=group, forward_sync_buffers=sync)
        self.ddp_opt = torch.optim.SGD(self.ddp.parameters(), lr=0.1, momentum=0.9)
        self.model, self.opt, self.inner = self._wrap(
            wrapper.removesuffix("-local"), plain, group, sync
        )
        self.records: list[tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
        self.record("construction")

    @staticmethod
    def _wrap(
        wrapper: str, plain: BNNet, group: dist.ProcessGroup, sync: bool
    ) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module]:
        kwargs = {"process_group": group, "broadcast_buffers": sync}
        if wrapper == "fsdp-flat":
            model: nn.Module = FSDP(plain, **kwargs)
        elif wrapper == "fsdp-nested":
            with enable_wrap(wrapper_cls=FSDP, **kwargs):
                wrapped = auto_wrap(plain, transformer_auto_wrap_policy({Outer, Inner}))
            model = FSDP(wrapped, **kwargs)
        elif wrapper == "sdp":
            oss = OSS(plain.parameters(), torch.optim.SGD, group=group, lr=0.1, momentum=0.9)
            model = ShardedDataParallel(plain, oss, **kwargs)
            return model, oss, plain
        else:  # OSS (ZeRO-1) under torch DDP itself
            model = DDP(plain, process_group=group)
            oss = OSS(model.parameters(), torch.optim.SGD, group=group, lr=0.1, momentum=0.9)
            return model, oss, plain
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model

    def both(self) -> Iterator[nn.Module]:
        yield from (self.ddp, self.model)

    def record(self, what: str, states: tuple[Any, Any] | None = None) -> None:
        """Both models' buffers (or the buffer entries of two state dicts), clean names."""
        if states is None:
            mine = {n: b.detach().clone() for n, b in self.inner.named_buffers()}
            ref = {n: b.detach().clone() for n, b in self.ddp.module.named_buffers()}
        else:
            names = {n for n, _ in self.ddp.module.named_buffers()}
            ref = {n: states[0][n].detach().clone() for n in names}
            mine = {n: _entry(states[1], n).detach().clone() for n in names}
        self.records.append((what, mine, ref))

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        return model.no_sync()  # type: ignore[operator,no-any-return]

    def params(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Full parameters of both (the wrapper's gathered by ``state_dict()``)."""
        names = [n for n, _ in self.ddp.module.named_parameters()]
        state = self.model.state_dict()
        ref = self.ddp.module.state_dict()
        return {n: _entry(state, n).clone() for n in names}, {n: ref[n].clone() for n in names}


def _entry(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """``name`` in a wrapper's state dict (ShardedDataParallel's keys start ``module.``)."""
    return state[name] if name in state else state["module." + name]


def _forward(pair: Pair, x: torch.Tensor, mode: str) -> list[torch.Tensor]:
    """One forward of both models: ``train``, ``eval`` (with grad), ``eval-no-grad``,
    ``train-no-grad``, ``summon`` (FSDP: inside ``summon_full_params``)."""
    outs = []
    for model in pair.both():
        model.train(not mode.startswith("eval"))
        grad: AbstractContextManager[Any] = (
            torch.no_grad() if mode.endswith("no-grad") else nullcontext()
        )
        summon = mode == "summon" and isinstance(model, FSDP)
        with grad, model.summon_full_params() if summon else nullcontext():  # type: ignore[operator]
            outs.append(model(x))
        model.train()
    return outs


def scenario(pair: Pair) -> None:
    """Two steps of two micro-batches (the first forward and backward inside
    ``no_sync``), an eval pass under ``no_grad`` and ``state_dict()`` after each; then
    the forwards that leave a different flag behind (eval with grad, train without
    grad, a forward inside ``summon_full_params``), each followed by a training step.
    Buffers recorded after every operation."""
    index = 0
    for step in range(STEPS):
        for micro in range(2):
            x = batch(index)
            index += 1
            losses = []
            for model in pair.both():
                with pair.no_sync(model) if micro == 0 else nullcontext():
                    losses.append(model(x).square().mean())
            pair.record(f"step {step} micro {micro} forward{' (no_sync)' * (micro == 0)}")
            for model, loss in zip(pair.both(), losses):
                with pair.no_sync(model) if micro == 0 else nullcontext():
                    loss.backward()
            pair.record(f"step {step} micro {micro} backward")
        for opt in (pair.ddp_opt, pair.opt):
            opt.step()
            opt.zero_grad()
        pair.record(f"step {step} optimizer step")
        _forward(pair, batch(100 + step), "eval-no-grad")
        pair.record(f"step {step} eval forward (no_grad)")
        pair.record(
            f"step {step} state_dict()", (pair.ddp.module.state_dict(), pair.model.state_dict())
        )
    for mode in ("eval", "train-no-grad", "summon", "train", "summon", "eval-no-grad"):
        _forward(pair, batch(index), mode)
        index += 1
        pair.record(f"{mode} forward")
    _frozen_norms(pair, index)


def _frozen_norms(pair: Pair, index: int) -> None:
    """Frozen BatchNorms (eval mode in a training model, saving their running
    statistics for backward): two forwards, the second after a synchronised one (so
    it broadcasts), then one backward through both and a step."""
    for model in pair.both():
        model(batch(index)).square().mean().backward()  # leaves the flag set
        for module in model.modules():
            if isinstance(module, nn.BatchNorm1d):
                module.eval()
        loss = model(batch(index + 1)).square().mean() + model(batch(index + 2)).square().mean()
        loss.backward()
        model.train()
    pair.record("frozen BatchNorm: two forwards, one backward")
    for opt in (pair.ddp_opt, pair.opt):
        opt.step()
        opt.zero_grad()
    pair.record("frozen BatchNorm: optimizer step")


def buffers_vs_ddp(wrappers: list[str]) -> list[dict[str, Any]]:
    """Rank-side: for each wrapper (own process group), the records and the final
    parameters of both, or the error."""
    results = []
    for wrapper in wrappers:
        group = dist.new_group(timeout=timedelta(seconds=60))
        try:
            pair = Pair(wrapper, group)
            scenario(pair)
            results.append({"records": pair.records, "params": pair.params(), "error": None})
        except Exception:
            results.append({"records": [], "params": None, "error": traceback.format_exc()})
    return results
