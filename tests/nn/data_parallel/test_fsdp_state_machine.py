"""Stateful property test of FSDP against the plain model (issue 16).

A hypothesis ``RuleBasedStateMachine`` draws random sequences of: freeze / unfreeze a
block, forward + backward, forward without backward (grad enabled), ``no_grad`` eval,
``step``, ``zero_grad``, ``state_dict`` (saved) and ``load_state_dict`` (of a saved
state), optimizer rebuild, ``summon_full_params`` (read, or edit a parameter in it).
Every rule runs on the tiny GPT wrapped with FSDP (this rank's part of the batch)
and on the plain model (the global batch) side by side; each forward's loss (mean
over ranks) agrees, and after every rule (invariant) the full parameters and the
gradients agree: a parameter the plain model has no gradient for has none in FSDP.
Configurations: nested (one unit per Block) and flat, ``reshard_after_forward`` on
and off.

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

import copy
import os
import traceback
import zlib
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.nn.data_parallel.fsdp_workers import global_batch, local_part, tiny_gpt, wrap_model

EXAMPLES = int(os.environ.get("SHARDKIT_HYPOTHESIS_EXAMPLES", "10"))
STEPS = int(os.environ.get("SHARDKIT_HYPOTHESIS_STEPS", "12"))
CONFIGS: dict[str, dict[str, Any]] = {
    "nested": {"nesting": "block", "raf": True},
    "nested-keep": {"nesting": "block", "raf": False},
    "flat": {"nesting": "flat", "raf": True},
    "flat-keep": {"nesting": "flat", "raf": False},
}
LOSS_TOL = 1e-5
PARAM_TOL = {"atol": 2e-5, "rtol": 1e-4}
BLOCKS = st.integers(0, 1)
SEEDS = st.integers(0, 7)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _blocks(block: int) -> tuple[str, ...]:
    return (f"blocks.{block}.",)


class FSDPMachine(RuleBasedStateMachine):
    """FSDP and the plain model side by side (class attributes set per configuration)."""

    cfg: dict[str, Any] = {}  # noqa: RUF012 (set once per configuration)
    group: dist.ProcessGroup | None = None

    def __init__(self) -> None:
        super().__init__()
        self._agree("init")
        torch.manual_seed(0)
        self.ref = tiny_gpt()
        self.model = wrap_model(
            copy.deepcopy(self.ref),
            self.cfg["nesting"],
            reshard_after_forward=self.cfg["raf"],
            process_group=self.group,
        )
        self.opt, self.ref_opt = _sgd(self.model.parameters()), _sgd(self.ref.parameters())
        self.saved: dict[str, torch.Tensor] | None = None

    # helpers (collectives over the configuration's group, same on every rank) ---------
    def _agree(self, *what: Any) -> None:
        """Every rank is at the same rule with the same arguments (see the module note)."""
        mine = torch.tensor([zlib.crc32(repr(what).encode())], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(every, mine, group=self.group)
        if len({int(t) for t in every}) != 1:
            raise AssertionError(f"ranks diverged: this rank is at {what}")

    def _mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return float(t) / dist.get_world_size(self.group)

    def _batch(self, seed: int) -> tuple[torch.Tensor, ...]:
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        x, y = global_batch(seed, world)
        return x, y, local_part(x, rank), local_part(y, rank)

    def _losses(self, seed: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, lx, ly = self._batch(seed)
        ref_loss, loss = self.ref(x, y)[1], self.model(lx, ly)[1]
        got, want = self._mean(loss.item()), ref_loss.item()
        assert abs(got - want) < LOSS_TOL, f"{what}: FSDP loss {got:.7f} != plain {want:.7f}"
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
    @rule(block=BLOCKS)
    def freeze(self, block: int) -> None:
        self._agree("freeze", block)
        self._set_trainable(_blocks(block), False)

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

    @rule(seed=SEEDS)
    def forward_without_backward(self, seed: int) -> None:
        """A sanity forward, an eval without no_grad, generation: the graph is dropped."""
        self._agree("forward_without_backward", seed)
        self._losses(seed, "forward_without_backward")

    @rule(seed=SEEDS)
    def eval_no_grad(self, seed: int) -> None:
        self._agree("eval_no_grad", seed)
        self.ref.eval()
        self.model.eval()
        with torch.no_grad():
            self._losses(seed, "eval_no_grad")
        self.ref.train()
        self.model.train()

    @rule()
    def step(self) -> None:
        self._agree("step")
        self.opt.step()
        self.ref_opt.step()

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
        for key, want in ref_state.items():
            diff = float((state[key].double() - want.double()).abs().max())
            tol = PARAM_TOL["atol"] + PARAM_TOL["rtol"] * float(want.abs().max())
            assert diff <= tol, f"state_dict()[{key}] off by {diff:.3e}"
        self.saved = {k: v.detach().clone() for k, v in ref_state.items()}

    @precondition(lambda self: self.saved is not None)
    @rule()
    def load_state_dict(self) -> None:
        """Both load the same saved state (the plain model's)."""
        self._agree("load_state_dict")
        assert self.saved is not None
        self.model.load_state_dict(self.saved)
        self.ref.load_state_dict(self.saved)

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
                    for model in (self.model, self.ref):
                        dict(model.named_parameters())["blocks.1.ln_2.weight"].mul_(0.5)

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
            if want.grad is None:
                assert got_grad is None, f"{name}: FSDP has a gradient, the plain model none"
                continue
            assert got_grad is not None, f"{name}: FSDP has no gradient, the plain model has"
            diff = float((got_grad.double() - want.grad.double()).abs().max())
            tol = PARAM_TOL["atol"] + PARAM_TOL["rtol"] * float(want.grad.abs().max())
            assert diff <= tol, f"gradient of {name} off by {diff:.3e}"


def run_machines(configs: list[dict[str, Any]], examples: int, steps: int) -> list[Any]:
    """Rank-side: the machine for each configuration; ``None`` or the failure's report."""
    results = []
    for cfg in configs:
        FSDPMachine.cfg = cfg
        FSDPMachine.group = dist.new_group(timeout=timedelta(seconds=30))
        try:
            run_state_machine_as_test(
                FSDPMachine,
                settings=settings(
                    max_examples=examples,
                    stateful_step_count=steps,
                    derandomize=True,
                    database=None,
                    deadline=None,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck),
                    report_multiple_bugs=False,
                    print_blob=False,
                ),
            )
            results.append(None)
        except Exception:
            results.append(traceback.format_exc())
    return results


_CACHE: dict[str, list[Any]] = {}


@pytest.fixture(scope="module")
def machine_results(rank_pool: Any) -> dict[str, list[Any]]:
    if not _CACHE:
        per_rank = rank_pool(2).run(run_machines, list(CONFIGS.values()), EXAMPLES, STEPS)
        for i, name in enumerate(CONFIGS):
            _CACHE[name] = [r[i] for r in per_rank]
    return _CACHE


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fsdp_state_machine(machine_results: dict[str, list[Any]], config: str) -> None:
    per_rank = machine_results[config]
    assert per_rank[0] is None, f"{config}: {CONFIGS[config]}\n{per_rank[0]}"
    assert per_rank[1] is None, f"{config}: rank 1 only:\n{per_rank[1]}"
