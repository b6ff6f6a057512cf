"""Workers of tests/optim/test_whole_tensor.py: whole-tensor optimizers (Muon + AdamW,
Adafactor, a LAMB written here) under FSDP (flat, nested, hybrid), ShardedDataParallel
and OSS, against the plain model on one process."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.optim._muon as muon_module
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.checkpoint.universal import load_universal, save_universal
from shardkit.distributed.hybrid import hybrid_groups
from shardkit.nn import ShardedDataParallel
from shardkit.optim import OSS, WholeTensorOptimizer
from tests.nn.data_parallel.fsdp_workers import SEQ, TINY, tiny_gpt, wrap_model

GLOBAL_BATCH = 12  # divisible by 2, 3 and 4
LR = {"muon": 0.02, "adamw": 1e-3, "adafactor": 1e-2, "lamb": 1e-2}


def _newton_schulz_fp32(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """torch's Muon orthogonalisation in fp32 instead of bf16 (same coefficients)."""
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


@contextlib.contextmanager
def fp32_muon() -> Iterator[None]:
    """torch's Muon runs Newton-Schulz in bf16: fp32 gradients differing in the last
    bits (a sum over ranks in another order) round to other bf16 values, about 1e-3
    apart after 3 steps, on OSS as on FSDP. Parity at 2e-5 is checked with fp32."""
    real = muon_module._zeropower_via_newtonschulz
    muon_module._zeropower_via_newtonschulz = _newton_schulz_fp32
    try:
        yield
    finally:
        muon_module._zeropower_via_newtonschulz = real


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020, algorithm 2): Adam's update scaled per tensor by the trust
    ratio ``||w|| / ||update||``; exact only on whole tensors."""

    needs_whole_tensors = True

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
                t = st["step"].item()
                st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m = st["exp_avg"] / (1 - b1**t)
                v = st["exp_avg_sq"] / (1 - b2**t)
                update = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), update.norm()
                trust = (w_norm / u_norm) if w_norm > 0 and u_norm > 0 else torch.tensor(1.0)
                p.add_(update, alpha=-group["lr"] * float(trust))


def _groups(
    named: list[tuple[str, nn.Parameter]], kind: str, shapes: dict[str, Any]
) -> list[dict[str, Any]]:
    if kind == "muon":
        mat = [p for n, p in named if len(shapes[n]) == 2]
        rest = [p for n, p in named if len(shapes[n]) != 2]
        return [
            {"params": mat, "optim": torch.optim.Muon, "lr": LR["muon"]},
            {"params": rest, "optim": torch.optim.AdamW, "lr": LR["adamw"]},
        ]
    optim = {"adafactor": torch.optim.Adafactor, "lamb": Lamb}[kind]
    return [{"params": [p for _, p in named], "optim": optim, "lr": LR[kind]}]


def plain_optimizers(
    named: list[tuple[str, nn.Parameter]], kind: str, shapes: dict[str, Any]
) -> list[torch.optim.Optimizer]:
    """One plain optimizer per group (the reference)."""
    out = []
    for g in _groups(named, kind, shapes):
        optim = g.pop("optim")
        out.append(optim(g.pop("params"), **g))
    return out


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randint(0, TINY.vocab_size, (GLOBAL_BATCH, SEQ), generator=g)
    y = torch.randint(0, TINY.vocab_size, (GLOBAL_BATCH, SEQ), generator=g)
    return x, y


def local(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = GLOBAL_BATCH // world
    return t[rank * n : (rank + 1) * n]


def reference(kind: str, steps: int) -> dict[str, torch.Tensor]:
    model = tiny_gpt()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    opts = plain_optimizers(list(model.named_parameters()), kind, shapes)
    for step in range(steps):
        x, y = batch(step)
        model(x, y)[1].backward()
        for o in opts:
            o.step()
            o.zero_grad()
            schedule(o, step)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def schedule(optimizer: torch.optim.Optimizer, step: int) -> None:
    """An LR schedule: every group's lr halves after step 1 (a resumed run gets the
    halved lr from the checkpoint's hyperparameters)."""
    if step == 1:
        for group in optimizer.param_groups:
            group["lr"] *= 0.5


class Run:
    """A wrapped model, its optimizers and how to read its full parameters."""

    def __init__(self, strategy: str, kind: str) -> None:
        plain = tiny_gpt()
        shapes = {n: p.shape for n, p in plain.named_parameters()}
        self.strategy, self.kind = strategy, kind
        self.optimizers: list[torch.optim.Optimizer]
        if strategy == "plain":  # one process, no wrapper: the resume of a checkpoint
            named = list(plain.named_parameters())
            model = plain
            self.optimizers = (
                [WholeTensorOptimizer(plain, _groups(named, kind, shapes))]
                if kind == "muon"  # two classes: one optimizer to load into
                else plain_optimizers(named, kind, shapes)
            )
        elif strategy.startswith("fsdp") or strategy == "hybrid":
            pg: Any = None
            self.group: Any = None
            if strategy == "hybrid":
                groups = hybrid_groups(1 if dist.get_world_size() < 4 else 2)
                pg, self.group = (groups.shard, groups.replicate), groups.shard
                model = wrap_model(
                    plain, "block", process_group=pg, sharding_strategy="HYBRID_SHARD"
                )
            else:
                model = wrap_model(plain, "flat" if strategy == "fsdp-flat" else "block")
            named = list(model.named_parameters())
            self.optimizers = [
                WholeTensorOptimizer(model, _groups(named, kind, shapes), process_group=self.group)
            ]
        elif strategy.startswith("ddp"):  # torch DDP, each rank holds all: plain optimizers
            named = list(plain.named_parameters())  # ("+one": one WholeTensorOptimizer)
            self.optimizers = (
                [WholeTensorOptimizer(_groups(named, kind, shapes))]
                if strategy.endswith("+one")
                else plain_optimizers(named, kind, shapes)
            )
            model = DDP(plain)
        elif strategy.startswith("sdp"):
            named = list(plain.named_parameters())
            self.optimizers = _oss(named, kind, shapes, strategy.endswith("+one"))
            model = ShardedDataParallel(plain, self.optimizers)  # type: ignore[arg-type]
        else:  # oss under torch DDP
            named = list(plain.named_parameters())
            self.optimizers = _oss(named, kind, shapes, strategy.endswith("+one"))
            model = DDP(plain)
        self.model = model

    def train(self, steps: range) -> None:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        for step in steps:
            x, y = batch(step)
            self.model(local(x, rank, world), local(y, rank, world))[1].backward()
            for o in self.optimizers:
                o.step()
            for o in self.optimizers:
                o.zero_grad()
                schedule(o, step)

    def full_state(self) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        if self.strategy.split("+")[0] in ("ddp", "sdp", "oss"):
            inner = self.model.module
            state = inner.state_dict()
        return {k: v.detach().clone() for k, v in state.items()}


def _oss(
    named: list[tuple[str, nn.Parameter]], kind: str, shapes: dict[str, Any], one: bool = False
) -> list[Any]:
    """One OSS per param group, or (``one``) one OSS of a WholeTensorOptimizer over all."""
    if one:
        return [OSS(_groups(named, kind, shapes), optim=WholeTensorOptimizer)]
    out = []
    for g in _groups(named, kind, shapes):
        optim = g.pop("optim")
        out.append(OSS(g.pop("params"), optim=optim, **g))
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].numel())


def parity(configs: list[tuple[str, str]], steps: int = 3) -> list[dict[str, Any]]:
    """Per (strategy, kind): max |param - plain param| after ``steps`` and how far the
    plain parameters moved (so a run that trains nothing cannot pass)."""
    out = []
    refs: dict[str, dict[str, torch.Tensor]] = {}
    start = {k: v.detach().clone() for k, v in tiny_gpt().state_dict().items()}
    for strategy, kind in configs:
        if kind not in refs:
            refs[kind] = reference(kind, steps)
        run = Run(strategy, kind)
        run.train(range(steps))
        state = run.full_state()
        out.append(
            {
                "strategy": strategy,
                "kind": kind,
                "diff": max_diff(state, refs[kind]),
                "moved": max_diff(start, refs[kind]),
            }
        )
    return out


def save_after(configs: list[tuple[str, str]], root: str, steps: int) -> list[str]:
    """Train each config ``steps`` steps and save a universal checkpoint under ``root``."""
    names = []
    for strategy, kind in configs:
        run = Run(strategy, kind)
        run.train(range(steps))
        assert len(run.optimizers) == 1
        model = run.model
        save_universal(f"{root}/{strategy}-{kind}", steps, model, run.optimizers[0])
        names.append(f"{strategy}-{kind}")
    return names


def resume(
    configs: list[tuple[str, str, str]], root: str, at: int, steps: int
) -> list[dict[str, Any]]:
    """Load each saved checkpoint (saved by ``saved`` at another world size) into a new
    run of ``strategy``, train to ``steps`` and compare with the plain model."""
    out = []
    refs: dict[str, dict[str, torch.Tensor]] = {}
    for saved, strategy, kind in configs:
        if kind not in refs:
            refs[kind] = reference(kind, steps)
        run = Run(strategy, kind)
        load_universal(
            f"{root}/{saved}-{kind}", run.model, run.optimizers[0], require_optimizer_state=True
        )
        run.train(range(at, steps))
        out.append(
            {
                "saved": saved,
                "strategy": strategy,
                "kind": kind,
                "diff": max_diff(run.full_state(), refs[kind]),
            }
        )
    return out


def local_state_roundtrip(strategy: str, kind: str) -> float:
    """``optimizer.state_dict()`` and the model's state dict after 3 steps, loaded into a
    new run at the same world size, which trains 2 more: max |diff| to the plain model."""
    first = Run(strategy, kind)
    first.train(range(3))
    model_state = first.model.state_dict()
    optim_state = first.optimizers[0].state_dict()
    second = Run(strategy, kind)
    second.model.load_state_dict(model_state)
    second.optimizers[0].load_state_dict(optim_state)
    second.train(range(3, 5))
    return max_diff(second.full_state(), reference(kind, 5))


def per_tensor_state_refused(root: str, saved: str) -> dict[str, str]:
    """Adafactor's factored moments (per-tensor state) into a plain Adafactor over FSDP's
    flat shards: refused before anything is written, naming the state."""
    model = wrap_model(tiny_gpt(), "block")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.Adafactor(model.parameters(), lr=0.1)
    error = _raises(lambda: load_universal(f"{root}/{saved}", model, opt))
    after = model.state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before) and not opt.state
    return {"error": error, "unchanged": str(unchanged)}


def _raises(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def refusals() -> dict[str, str]:
    """A plain whole-tensor optimizer over FSDP's shards is refused before any update."""
    out = {}
    for name, optim in (("adafactor", torch.optim.Adafactor), ("lamb", Lamb)):
        model = wrap_model(tiny_gpt(), "block")
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt = optim(model.parameters(), lr=0.1)
        x, y = batch(0)
        model(
            local(x, dist.get_rank(), dist.get_world_size()),
            local(y, dist.get_rank(), dist.get_world_size()),
        )[1].backward()
        out[name] = _raises(opt.step)
        after = model.state_dict()
        out[name + "-unchanged"] = str(all(torch.equal(before[k], after[k]) for k in before))
    model = wrap_model(tiny_gpt(), "block")
    out["muon"] = _raises(lambda: torch.optim.Muon(model.parameters(), lr=0.1))
    held_whole = tiny_gpt()  # every rank holds every parameter whole: OSS's case
    out["ddp-whole"] = _raises(
        lambda: WholeTensorOptimizer(
            DDP(held_whole), [{"params": list(held_whole.parameters()), "optim": Lamb}]
        )
    )
    return out


def run_all(fns: list[tuple[str, tuple[Any, ...]]]) -> dict[str, Any]:
    """Run several workers in one ``pool.run``."""
    table: dict[str, Callable[..., Any]] = {
        "parity": parity,
        "per_tensor_state_refused": per_tensor_state_refused,
        "local_state_roundtrip": local_state_roundtrip,
        "save_after": save_after,
        "resume": resume,
        "refusals": refusals,
    }
    with fp32_muon():
        return {name: table[name](*args) for name, args in fns}
