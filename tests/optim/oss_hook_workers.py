"""Rank-side workers of test_oss_comm_hook: torch DDP + OSS + ``reduce_to_owner_hook``
trained side by side with torch DDP + the plain optimizer (the reference), step by step.

Each rank builds both from the same seed, feeds both its own batch, and reports the
differences (losses, gradients on the owner, final parameters, clip norms, loss
scales) and what the hooked model sent (counted with ``benchmarks.comm``).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks import comm
from shardkit.models import GPT, GPTConfig
from shardkit.optim import OSS, reduce_to_owner_hook, register_reduce_to_owner_hook
from shardkit.optim.grad_scaler import ShardedGradScaler
from shardkit.testing import max_abs_diff

LOCAL_BATCH = 2
SEQ = 8
# [Note: eps] At 3 ranks gloo's reduce and all-reduce add the ranks' gradients in other
# orders (1 ulp apart); AdamW at its default eps (1e-8) turns that into 1e-5 parameter
# gaps where a gradient is near zero (m / sqrt(v) of rounding noise). eps = 1e-3 keeps
# the update linear there, so the parity holds at 1e-6 and still shows any real error.
OPTIMS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-3}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


class OddNet(nn.Module):
    """Odd shapes (a conv kernel of 5 x 7 x 3), an unused, a frozen and an empty parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 7)
        self.conv = nn.Conv1d(7, 5, kernel_size=3)
        self.head = nn.Linear(5, 3)
        self.unused = nn.Parameter(torch.randn(3, 5))
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.empty = nn.Parameter(torch.zeros(0))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.conv(self.emb(idx).transpose(1, 2))).mean(-1)  # (B, 5)
        out = self.frozen(self.head(h)) + self.empty.sum()
        return out, (out - targets).pow(2).mean()


def build(kind: str) -> nn.Module:
    if kind == "gpt":
        return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    return OddNet()


def batch(kind: str, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    if kind == "gpt":
        idx = torch.randint(0, 64, (LOCAL_BATCH, SEQ + 1), generator=g)
        return idx[:, :-1], idx[:, 1:]
    return torch.randint(0, 11, (LOCAL_BATCH, SEQ), generator=g), torch.randn(
        LOCAL_BATCH, 3, generator=g
    )


# bucket -> owner of each of its parameters, as the hook saw them (the "record" config)
BUCKET_OWNERS: list[list[int | None]] = []


def recording_hook(state: OSS, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """``reduce_to_owner_hook`` that first notes the owners of the bucket's parameters."""
    owners = state.param_to_rank
    BUCKET_OWNERS.append([owners.get(p) for p in bucket.parameters()])
    return reduce_to_owner_hook(state, bucket)


recording_hook.__annotations__ = reduce_to_owner_hook.__annotations__


def _relative_gap(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual - expected|`` over ``max(1, max |expected|)``."""
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    return max_abs_diff(actual, expected) / max(1.0, scale)


class Pair:
    """The hooked model (DDP + OSS + hook) and the reference (DDP + plain optimizer)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        torch.manual_seed(0)
        self.kind = cfg["model"]
        self.model = build(self.kind)
        self.ref = copy.deepcopy(self.model)
        kw = {
            "find_unused_parameters": self.kind == "odd",
            "bucket_cap_mb": cfg.get("bucket_mb", 25),
            "gradient_as_bucket_view": cfg.get("bucket_view", False),
        }
        self.ddp, self.ref_ddp = DDP(self.model, **kw), DDP(self.ref, **kw)
        optim, defaults = OPTIMS[cfg["optim"]]
        self.oss = OSS(self.model.parameters(), optim=optim, **defaults)
        self.ref_opt = optim(self.ref.parameters(), **defaults)
        if cfg.get("record"):
            self.ddp.register_comm_hook(self.oss, recording_hook)
        else:
            register_reduce_to_owner_hook(self.ddp, self.oss)
        scaled = cfg.get("scaler", False)
        self.scaler = ShardedGradScaler(init_scale=1024.0, device="cpu") if scaled else None
        self.ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaled else None

    def backward(
        self, x: torch.Tensor, y: torch.Tensor, inf_into: str | None, sync: bool
    ) -> tuple[float, float]:
        """Forward and backward of both models on one micro-batch; both losses."""
        losses = []
        for ddp, model, scaler in (
            (self.ddp, self.model, self.scaler),
            (self.ref_ddp, self.ref, self.ref_scaler),
        ):
            with contextlib.nullcontext() if sync else ddp.no_sync():
                _, loss = ddp(x, targets=y)
                if inf_into is not None:  # an overflow in one parameter's gradient
                    loss = loss + (dict(model.named_parameters())[inf_into] * float("inf")).sum()
                (loss if scaler is None else scaler.scale(loss)).backward()
            losses.append(float(loss.detach()))
        return losses[0], losses[1]

    def owned_grad_diff(self) -> tuple[float, int]:
        """Largest gap between an owned gradient and DDP's mean, relative to the mean's
        largest element (at least 1: sums in another order round differently); number of
        owned gradients."""
        owners, rank = self.oss.param_to_rank, self.oss.rank
        diffs = [
            _relative_gap(p.grad, q.grad)
            for p, q in zip(self.model.parameters(), self.ref.parameters())
            if owners.get(p) == rank and p.grad is not None
        ]
        return max(diffs, default=0.0), len(diffs)

    def step(self, clip: float | None) -> float:
        """Clip (by the global norm) and step both; the gap between the two norms."""
        gap = 0.0
        if self.scaler is not None and self.ref_scaler is not None:
            self.scaler.unscale_(self.oss)
            self.ref_scaler.unscale_(self.ref_opt)
        if clip is not None:
            norm = self.oss.clip_grad_norm(clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(self.ref.parameters(), clip)
            gap = abs(float(norm) - float(ref_norm))
        for opt, scaler in ((self.oss, self.scaler), (self.ref_opt, self.ref_scaler)):
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad(set_to_none=True)
        return gap

    def param_diff(self) -> float:
        return max(
            max_abs_diff(p, q) for p, q in zip(self.model.parameters(), self.ref.parameters())
        )


def _train(cfg: dict[str, Any]) -> dict[str, Any]:
    pair, rank = Pair(cfg), dist.get_rank()
    out: dict[str, Any] = {
        "loss_gaps": [],
        "grad_gaps": [],
        "owned": [],
        "norm_gaps": [],
        "scales": [],
    }
    for step in range(cfg.get("steps", 3)):
        if cfg.get("freeze_at") == step:  # the largest parameter: every owner changes
            for m in (pair.model, pair.ref):
                m.conv.weight.requires_grad_(False)
        micro = 2 if step == cfg.get("accumulate_at") else 1
        inf_rank = dist.get_world_size() - 1
        inf_into = cfg.get("inf_into") if step == cfg.get("inf_at") and rank == inf_rank else None
        for k in range(micro):
            losses = pair.backward(*batch(pair.kind, step, k, rank), inf_into, sync=k == micro - 1)
            out["loss_gaps"].append(abs(losses[0] - losses[1]) if inf_into is None else 0.0)
        gap, owned = pair.owned_grad_diff()
        if inf_into is None and step != cfg.get("inf_at"):
            out["grad_gaps"].append(gap)
        out["owned"].append(owned)
        out["norm_gaps"].append(pair.step(cfg.get("clip")))
        if pair.scaler is not None and pair.ref_scaler is not None:
            out["scales"].append((pair.scaler.get_scale(), pair.ref_scaler.get_scale()))
    out["param_gap"] = pair.param_diff()
    return out


def _count(cfg: dict[str, Any]) -> dict[str, Any]:
    """Bytes the hooked model sends per step (counted), with psi its trainable elements."""
    counter = comm.install()
    try:
        pair, rank = Pair(cfg), dist.get_rank()
        steps = []
        for step in range(2):
            x, y = batch(pair.kind, step, 0, rank)
            counter.reset()
            with counter.counting():
                _, loss = pair.ddp(x, targets=y)
                loss.backward()
                pair.oss.step()
                pair.oss.zero_grad(set_to_none=True)
            steps.append(counter.snapshot())
    finally:
        comm.uninstall()
    psi = sum(p.numel() for p in pair.model.parameters() if p.requires_grad)
    return {"steps": steps, "psi": psi}


def run_configs(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every config on this rank, in order (``count`` configs measure traffic)."""
    BUCKET_OWNERS.clear()
    results = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="OSS: requires_grad")
        for cfg in configs:
            result = _count(cfg) if cfg.get("count") else _train(cfg)
            result["buckets"] = list(BUCKET_OWNERS)
            BUCKET_OWNERS.clear()
            results.append({"name": cfg["name"], **result})
    return results


def _raises(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except Exception as err:  # the test checks type and message
        return type(err).__name__, str(err)
    return "none", ""


def _backward(ddp: DDP) -> None:
    ddp(torch.randn(2, 4)).sum().backward()


def run_errors() -> dict[str, tuple[str, str]]:
    """Each refused use: (error type, message)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]  # a collective: every rank
    model = nn.Linear(4, 2)
    ddp, oss = DDP(model), OSS(model.parameters(), lr=0.1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = DDP(nn.Linear(4, 2))
    plain.register_comm_hook(sgd, reduce_to_owner_hook)
    m1, m2 = nn.Linear(4, 2), nn.Linear(4, 2)
    return {
        "module not DDP": _raises(lambda: register_reduce_to_owner_hook(model, oss)),  # type: ignore[arg-type]
        "state not OSS": _raises(lambda: register_reduce_to_owner_hook(ddp, sgd)),  # type: ignore[arg-type]
        "hook state not OSS": _raises(lambda: _backward(plain)),
        "OSS on a subgroup": _raises(
            lambda: register_reduce_to_owner_hook(
                DDP(m1), OSS(m1.parameters(), group=singles[rank], lr=0.1)
            )
        ),
        "DDP on a subgroup": _raises(
            lambda: register_reduce_to_owner_hook(
                DDP(m2, process_group=singles[rank]), OSS(m2.parameters(), lr=0.1)
            )
        ),
    }


def _hooked(seed: int) -> tuple[DDP, OSS]:
    torch.manual_seed(seed)
    ddp = DDP(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    oss = OSS(ddp.parameters(), lr=0.1)
    register_reduce_to_owner_hook(ddp, oss)
    return ddp, oss


def run_accumulation() -> dict[str, Any]:
    """Two synchronised backwards in one step (refused), the windows that end with step
    and zero_grad, and what non-owners' gradients hold after a backward."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    ddp, oss = _hooked(0)
    ref = DDP(copy.deepcopy(ddp.module))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    ddp(x).sum().backward()
    ref(x).sum().backward()
    owner = oss.param_to_rank
    pairs = list(zip(ddp.parameters(), ref.parameters()))
    out["owned_gap"] = max(max_abs_diff(p.grad, q.grad) for p, q in pairs if owner[p] == rank)
    out["unowned_abs_max"] = max(
        (float(p.grad.abs().max()) for p, _ in pairs if owner[p] != rank), default=-1.0
    )
    out["owned"] = sum(owner[p] == rank for p, _ in pairs)
    out["second"] = _raises(lambda: ddp(x).sum().backward())
    # a window ends with zero_grad (a skipped step) or step: no error afterwards
    ddp, oss = _hooked(1)
    ddp(x).sum().backward()
    oss.zero_grad()
    out["after_zero_grad"] = _raises(lambda: ddp(x).sum().backward())
    oss.step()
    out["after_step"] = _raises(lambda: ddp(x).sum().backward())
    return out
