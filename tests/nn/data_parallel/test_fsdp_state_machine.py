"""Stateful property test of FSDP against the plain model and torch DDP (issue 16).

A hypothesis ``RuleBasedStateMachine`` draws random sequences of: freeze / unfreeze a
block, forward + backward, a micro-batch accumulated under ``no_sync`` (forward and
backward inside), forward without backward (grad enabled), ``no_grad`` eval, a forward
inside ``summon_full_params``, ``step``, ``zero_grad``, ``state_dict`` (saved) and
``load_state_dict`` (of a saved state), optimizer rebuild, ``summon_full_params``
(read, or edit a parameter in it). Every rule runs on the tiny GPT wrapped with FSDP
(this rank's part of the batch) and on the plain model (the global batch) side by
side; each forward's loss (mean over ranks) agrees, and after every rule (invariant)
the full parameters and the gradients agree: a parameter the plain model has no
gradient for has none in FSDP (gradients are compared once no ``no_sync`` micro-batch
is pending). Configurations: nested (one unit per Block) and flat,
``reshard_after_forward`` on and off.

The ``bn-`` configurations use a BatchNorm model whose initial buffers differ per rank,
and torch DDP on the same rank's part of the batch as the reference: each forward's
loss agrees on every rank, and after every rule each rank's buffers equal DDP's on that
rank (bit for bit for the BatchNorm on the input and every ``num_batches_tracked``, to
fp32 rounding behind trained layers), besides parameters and gradients. DDP does not
follow ``requires_grad`` changes made after wrapping, so freezing is not drawn there.

[Note: one machine on two ranks]
Both ranks run the same machine inside one ``pool.run``: ``derandomize=True`` and no
database make hypothesis draw the same sequence on both, and every check is made on
values every rank holds alike (all-reduced or all-gathered), so a failure is raised
on both ranks at the same rule. Each rule starts with ``_agree``, an all-gather of the
rule's name and arguments: if the ranks ever drew different rules they fail there,
before any mismatched collective. Shrinking is off (a replay on one rank only would
hang the other); the report lists the steps drawn. Each configuration runs in its own
process group with a 30 s timeout, so an FSDP error raised on one rank only ends the
run within it.

``SHARDKIT_HYPOTHESIS_EXAMPLES`` sets the number of examples per configuration
(default 10, about 20 s on the 2-core CI box when they pass; 40 found the
stale-view bug of behaviour 2 alone in 23 s); ``SHARDKIT_HYPOTHESIS_STEPS`` the rules per
example (default 12).
"""

from __future__ import annotations

import contextlib
import copy
import os
import traceback
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy
from tests.nn.data_parallel.fsdp_workers import (
    agree,
    global_batch,
    local_part,
    tiny_gpt,
    wrap_model,
)
from tests.nn.data_parallel.machines import machine_pool, machine_settings

EXAMPLES = int(os.environ.get("SHARDKIT_HYPOTHESIS_EXAMPLES", "10"))
STEPS = int(os.environ.get("SHARDKIT_HYPOTHESIS_STEPS", "12"))
CONFIGS: dict[str, dict[str, Any]] = {
    "nested": {"nesting": "block", "raf": True},
    "nested-keep": {"nesting": "block", "raf": False},
    "flat": {"nesting": "flat", "raf": True},
    "flat-keep": {"nesting": "flat", "raf": False},
    "bn-nested": {"nesting": "block", "raf": True, "model": "bn"},
    "bn-flat": {"nesting": "flat", "raf": True, "model": "bn"},
}
LOSS_TOL = 1e-5
# fp32 rounding of large losses: the bn- models reach losses above 100 after some SGD
# steps, where a few fp32 steps exceed LOSS_TOL. 40 x 25 and 100 x 25 runs failed by
# 3.05e-05 and 6.10e-05 (loss 120, 8 fp32 steps) with LOSS_TOL alone; the same
# machines in float64 agree to 1e-12 over 200 x 25, so the gap is rounding, not a bug
LOSS_RTOL = 1e-6
PARAM_TOL = {"atol": 2e-5, "rtol": 1e-4}
BLOCKS = st.integers(0, 1)
SEEDS = st.integers(0, 7)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _blocks(block: int) -> tuple[str, ...]:
    return (f"blocks.{block}.",)


class BNBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.bn(self.fc(x)))


class BNModel(nn.Module):
    """BatchNorm on the input (statistics from data and buffers only), then two blocks
    with a BatchNorm behind a trained layer; ``(x, y) -> (output, MSE loss)``."""

    def __init__(self) -> None:
        super().__init__()
        self.bn0 = nn.BatchNorm1d(6)
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([BNBlock(), BNBlock()])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.inp(self.bn0(x))
        for block in self.blocks:
            h = block(h)
        out = self.head(h).squeeze(-1)
        return out, (out - y).square().mean()


def _bn_model(rank: int) -> BNModel:
    """The same parameters on every rank; buffers differ (rank 0's must win)."""
    torch.manual_seed(0)
    model = BNModel()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm1d):
            assert m.running_mean is not None and m.running_var is not None
            m.running_mean.fill_(0.5 * rank)
            m.running_var.fill_(1.0 + rank)
    return model


def _bn_batch(seed: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[8 r, 8 r + 8)`` are rank r's: shifted and scaled per rank, so each
    rank's BatchNorm statistics differ."""
    g = torch.Generator().manual_seed(2000 + seed)
    x = torch.randn(2 * world, 4, 6, generator=g)
    x = x * (1 + torch.arange(2 * world) // 2).view(-1, 1, 1) + (torch.arange(2 * world) // 2).view(
        -1, 1, 1
    )
    return x.reshape(-1, 6), torch.randn(8 * world, generator=g)


def _exact_buffer(name: str) -> bool:
    """Buffers that must equal DDP's bit for bit (see the module docstring)."""
    return name.startswith("bn0.") or name.endswith("num_batches_tracked")


class FSDPMachine(RuleBasedStateMachine):
    """FSDP and the plain model side by side (class attributes set per configuration)."""

    cfg: dict[str, Any] = {}  # noqa: RUF012 (set once per configuration)
    group: dist.ProcessGroup | None = None

    def __init__(self) -> None:
        super().__init__()
        self._agree("init")
        torch.manual_seed(0)
        self.bn = self.cfg.get("model") == "bn"
        kwargs = {"reshard_after_forward": self.cfg["raf"], "process_group": self.group}
        self.ddp: DDP | None = None
        if self.bn:
            self.ref: nn.Module = _bn_model(dist.get_rank(self.group))
            self.model = _wrap_bn(copy.deepcopy(self.ref), self.cfg["nesting"], kwargs)
            self.ddp = DDP(self.ref, process_group=self.group)
        else:
            self.ref = tiny_gpt()
            self.model = wrap_model(copy.deepcopy(self.ref), self.cfg["nesting"], **kwargs)
        self.opt, self.ref_opt = _sgd(self.model.parameters()), _sgd(self.ref.parameters())
        self.saved: dict[str, torch.Tensor] | None = None
        self.pending = False  # a no_sync micro-batch's gradient is not reduced yet

    # helpers (collectives over the configuration's group, same on every rank) ---------
    def _agree(self, *what: Any) -> None:
        """Every rank is at the same rule with the same arguments (see the module note)."""
        agree(self.group, *what)

    def _mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return float(t) / dist.get_world_size(self.group)

    def _max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t)

    def _batch(self, seed: int) -> tuple[torch.Tensor, ...]:
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        if self.bn:
            x, y = _bn_batch(seed, world)
            return x, y, x[8 * rank : 8 * (rank + 1)], y[8 * rank : 8 * (rank + 1)]
        x, y = global_batch(seed, world)
        return x, y, local_part(x, rank), local_part(y, rank)

    def _losses(
        self, seed: int, what: str, no_sync: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both models' losses; the plain model on the global batch, DDP (``bn-``) on
        this rank's part, inside ``no_sync`` with ``no_sync``."""
        x, y, lx, ly = self._batch(seed)
        if self.ddp is not None:
            with self.ddp.no_sync() if no_sync else contextlib.nullcontext():
                ref_loss = self.ddp(lx, ly)[1]
        else:
            ref_loss = self.ref(x, y)[1]
        with self.model.no_sync() if no_sync else contextlib.nullcontext():
            loss = self.model(lx, ly)[1]
        if self.ddp is not None:  # rank by rank, the worst on every rank
            diff = self._max(abs(loss.item() - ref_loss.item()) - LOSS_RTOL * abs(ref_loss.item()))
            assert diff < LOSS_TOL, (
                f"{what}: FSDP loss off DDP's by {diff:.3e} (beyond {LOSS_RTOL:g} of the "
                f"loss, up to {self._max(abs(ref_loss.item())):.6g}) on some rank"
            )
            return ref_loss, loss
        got, want = self._mean(loss.item()), ref_loss.item()
        tol = LOSS_TOL + LOSS_RTOL * abs(want)
        assert abs(got - want) < tol, f"{what}: FSDP loss {got:.7f} != plain {want:.7f}"
        return ref_loss, loss

    def _set_trainable(self, prefixes: tuple[str, ...], flag: bool) -> None:
        for model in (self.ref, self.model):
            for name, param in model.named_parameters():
                if name.startswith(prefixes):
                    param.requires_grad_(flag)

    def _gathered(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """The full parameters and gradients FSDP's ``named_parameters()`` shows, built
        from every rank's piece: pieces in rank order are the flattened parameter (FSDP's
        contiguous shards); a full-shape tensor on every rank is taken as it is."""
        local = {
            name: (p.detach().clone(), None if p.grad is None else p.grad.detach().clone())
            for name, p in self.model.named_parameters()
        }
        every: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, local, group=self.group)
        out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for name, ref_param in self.ref.named_parameters():
            shape = ref_param.shape
            assert all(name in r for r in every), f"{name} missing from named_parameters()"
            pieces = [r[name] for r in every]
            if all(p.shape == shape for p, _ in pieces):  # full on every rank
                for p, g in pieces[1:]:
                    assert torch.equal(p, pieces[0][0]), f"{name}: ranks hold different values"
                    assert (g is None) == (pieces[0][1] is None), f"{name}: grad on some ranks"
                out[name] = pieces[0]
                continue
            sizes = [p.numel() for p, _ in pieces]
            assert sum(sizes) == shape.numel(), (
                f"{name}: pieces of {sizes} elements over the ranks, the parameter has "
                f"{shape.numel()}"
            )
            param = torch.cat([p.reshape(-1) for p, _ in pieces]).reshape(shape)
            grads = [g for p, g in pieces if p.numel()]
            if all(g is None for g in grads):
                out[name] = (param, None)
                continue
            assert all(g is not None for g in grads), f"{name}: grad is None on some ranks only"
            grad = torch.cat([g.reshape(-1) for g in grads if g is not None]).reshape(shape)
            out[name] = (param, grad)
        return out

    # rules ----------------------------------------------------------------------------
    @precondition(lambda self: not self.bn and not self.pending)
    @rule(block=BLOCKS)
    def freeze(self, block: int) -> None:
        self._agree("freeze", block)
        self._set_trainable(_blocks(block), False)

    @precondition(lambda self: not self.bn and not self.pending)
    @rule(block=BLOCKS)
    def unfreeze(self, block: int) -> None:
        self._agree("unfreeze", block)
        self._set_trainable(_blocks(block), True)

    @rule(seed=SEEDS)
    def forward_backward(self, seed: int) -> None:
        self._agree("forward_backward", seed)
        ref_loss, loss = self._losses(seed, "forward_backward")
        ref_loss.backward()
        loss.backward()
        self.pending = False

    @rule(seed=SEEDS)
    def accumulate_no_sync(self, seed: int) -> None:
        """A micro-batch of gradient accumulation: forward and backward in ``no_sync``
        (the plain model just accumulates the global batch's gradient)."""
        self._agree("accumulate_no_sync", seed)
        ref_loss, loss = self._losses(seed, "accumulate_no_sync", no_sync=True)
        with self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext():
            ref_loss.backward()
        with self.model.no_sync():
            loss.backward()
        self.pending = True

    @rule(seed=SEEDS)
    def forward_without_backward(self, seed: int) -> None:
        """A sanity forward, an eval without no_grad, generation: the graph is dropped."""
        self._agree("forward_without_backward", seed)
        self._losses(seed, "forward_without_backward")

    @rule(seed=SEEDS)
    def forward_in_summon(self, seed: int) -> None:
        """``model(x)`` inside ``summon_full_params`` (grad enabled, no backward)."""
        self._agree("forward_in_summon", seed)
        with self.model.summon_full_params(writeback=False):
            self._losses(seed, "forward_in_summon")

    @rule(seed=SEEDS)
    def eval_no_grad(self, seed: int) -> None:
        self._agree("eval_no_grad", seed)
        self.ref.eval()
        self.model.eval()
        with torch.no_grad():
            self._losses(seed, "eval_no_grad")
        self.ref.train()
        self.model.train()

    @precondition(lambda self: self.bn)
    @rule(seed=SEEDS)
    def eval_with_grad(self, seed: int) -> None:
        """An eval-mode forward with grad enabled: the next forward broadcasts (DDP)."""
        self._agree("eval_with_grad", seed)
        self.ref.eval()
        self.model.eval()
        self._losses(seed, "eval_with_grad")
        self.ref.train()
        self.model.train()

    @precondition(lambda self: not self.pending)
    @rule()
    def step(self) -> None:
        self._agree("step")
        self.opt.step()
        self.ref_opt.step()

    @precondition(lambda self: not self.pending)
    @rule()
    def zero_grad(self) -> None:
        self._agree("zero_grad")
        self.opt.zero_grad()
        self.ref_opt.zero_grad()

    @rule()
    def rebuild_optimizer(self) -> None:
        self._agree("rebuild_optimizer")
        self.opt, self.ref_opt = _sgd(self.model.parameters()), _sgd(self.ref.parameters())

    @rule()
    def save_state_dict(self) -> None:
        """``state_dict()`` equals the plain model's; the plain one is kept for a load."""
        self._agree("save_state_dict")
        state = self.model.state_dict()
        ref_state = self.ref.state_dict()
        assert sorted(state) == sorted(ref_state)
        buffers = dict(self.ref.named_buffers())
        for key, want in ref_state.items():
            diff = self._max(float((state[key].double() - want.double()).abs().max()))
            tol = PARAM_TOL["atol"] + PARAM_TOL["rtol"] * float(want.double().abs().max())
            # bit for bit: the exact buffers only; bn0.weight and bn0.bias are trained
            # parameters (a 40 x 25 run failed on bn0.weight at 1.19e-07 with 0 here)
            if self.bn and key in buffers and _exact_buffer(key):
                tol = 0.0
            assert diff <= tol, f"state_dict()[{key}] off by {diff:.3e} on some rank"
        self.saved = {k: v.detach().clone() for k, v in ref_state.items()}

    @precondition(lambda self: self.saved is not None and not self.pending)
    @rule()
    def load_state_dict(self) -> None:
        """Both load the same saved state (the plain model's)."""
        self._agree("load_state_dict")
        assert self.saved is not None
        self.model.load_state_dict(self.saved)
        self.ref.load_state_dict(self.saved)

    @precondition(lambda self: not self.pending)
    @rule(edit=st.booleans())
    def summon_full_params(self, edit: bool) -> None:
        """Read the full parameters inside the context; with ``edit``, halve one in both."""
        self._agree("summon_full_params", edit)
        ref_params = dict(self.ref.named_parameters())
        with self.model.summon_full_params():
            for name, param in self.model.named_parameters():
                want = ref_params[name]
                assert param.shape == want.shape, f"{name}: {tuple(param.shape)} in summon"
                diff = float((param.detach() - want.detach()).abs().max())
                assert diff <= 1e-4, f"summon_full_params: {name} off by {diff:.3e}"
            if edit:
                with torch.no_grad():
                    name = "blocks.1.bn.weight" if self.bn else "blocks.1.ln_2.weight"
                    for model in (self.model, self.ref):
                        dict(model.named_parameters())[name].mul_(0.5)

    # invariant ------------------------------------------------------------------------
    @invariant()
    def parameters_and_gradients_agree(self) -> None:
        self._agree("invariant")
        gathered = self._gathered()
        for name, want in self.ref.named_parameters():
            got, got_grad = gathered[name]
            diff = float((got.double() - want.detach().double()).abs().max())
            tol = PARAM_TOL["atol"] + PARAM_TOL["rtol"] * float(want.detach().abs().max())
            assert diff <= tol, f"parameter {name} off by {diff:.3e}"
            if self.pending:  # accumulated in no_sync: reduced at the next backward
                continue
            if want.grad is None:
                assert got_grad is None, f"{name}: FSDP has a gradient, the plain model none"
                continue
            assert got_grad is not None, f"{name}: FSDP has no gradient, the plain model has"
            diff = float((got_grad.double() - want.grad.double()).abs().max())
            tol = PARAM_TOL["atol"] + PARAM_TOL["rtol"] * float(want.grad.abs().max())
            assert diff <= tol, f"gradient of {name} off by {diff:.3e}"

    @invariant()
    def buffers_equal_ddp_on_every_rank(self) -> None:
        """``bn-``: each rank's buffers equal torch DDP's on that rank."""
        if not self.bn:
            return
        self._agree("buffers")
        mine = dict(self.model.named_buffers())
        for name, want in self.ref.named_buffers():
            got = mine[name]
            diff = self._max(float((got.double() - want.double()).abs().max()))
            tol = 0.0 if _exact_buffer(name) else PARAM_TOL["atol"]
            tol += 0.0 if _exact_buffer(name) else PARAM_TOL["rtol"] * float(want.abs().max())
            assert diff <= tol, f"buffer {name} off torch DDP's by {diff:.3e} on some rank"


def _wrap_bn(model: BNModel, nesting: str, kwargs: dict[str, Any]) -> FSDP:
    """``flat``: one unit; ``block``: one unit per :class:`BNBlock` inside the root."""
    if nesting == "flat":
        return FSDP(model, **kwargs)
    with enable_wrap(wrapper_cls=FSDP, **kwargs):
        wrapped = auto_wrap(model, transformer_auto_wrap_policy({BNBlock}))
    return FSDP(wrapped, **kwargs)


def run_machines(configs: list[dict[str, Any]], examples: int, steps: int) -> list[Any]:
    """Rank-side: the machine for each configuration; ``None`` or the failure's report."""
    results = []
    for cfg in configs:
        FSDPMachine.cfg = cfg
        FSDPMachine.group = dist.new_group(timeout=timedelta(seconds=30))
        try:
            run_state_machine_as_test(
                FSDPMachine,
                settings=machine_settings(examples, steps),
            )
            results.append(None)
        except Exception:
            results.append(traceback.format_exc())
    return results


_CACHE: dict[str, list[Any]] = {}


@pytest.fixture(scope="module")
def machine_results(rank_pool: Any) -> dict[str, list[Any]]:
    if not _CACHE:
        # The shared pool's 120 s fits the default 10 x 12 rules; a larger setting gets
        # its own pool with the limit scaled by the rules drawn.
        scale = EXAMPLES * STEPS / (10 * 12)
        with contextlib.ExitStack() as stack:
            pool = machine_pool(stack, rank_pool, scale)
            per_rank = pool.run(run_machines, list(CONFIGS.values()), EXAMPLES, STEPS)
        for i, name in enumerate(CONFIGS):
            _CACHE[name] = [r[i] for r in per_rank]
    return _CACHE


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fsdp_state_machine(machine_results: dict[str, list[Any]], config: str) -> None:
    per_rank = machine_results[config]
    assert per_rank[0] is None, f"{config}: {CONFIGS[config]}\n{per_rank[0]}"
    assert per_rank[1] is None, f"{config}: rank 1 only:\n{per_rank[1]}"
