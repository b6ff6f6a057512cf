"""Stateful property test of FSDP's disk tier against the plain model.

A hypothesis ``RuleBasedStateMachine`` draws random sequences of: a training step
(forward, backward, ``optimizer.step()``, ``optimizer.zero_grad()``); a backward alone
(with the disk tier the backward *is* the step: the plain model steps there too) and
``optimizer.step()`` later, acknowledging it; a second backward before that
``optimizer.step()`` (refused with ``RuntimeError``, inside ``no_sync`` or not, and
training goes on); ``optimizer.step()`` without a backward (refused); a micro-batch
accumulated inside ``model.no_sync()`` (forward and backward; the next backward steps
with the sum, the plain model accumulates too); a forward without backward (eval
under ``torch.no_grad()``, or grad enabled and the output dropped); a forward whose
losses are kept and whose backward comes rules later (a step, or refused as stale when
a step came between);
``optimizer.zero_grad()`` alone (between a ``no_sync`` micro-batch and the step it
drops the micro-batch, as the plain model's); freezing or unfreezing a block
(``requires_grad`` on the parameters ``named_parameters()`` gives, in both models, not
while a ``no_sync`` gradient is pending); ``state_dict()`` read; and a reopen: the
``DiskOffload`` closed and the model rebuilt on meta with ``DiskOffload(directory,
resume=True)`` and a new ``disk.optimizer(...)``, the frozen blocks frozen again (only
between steps: the step acknowledged and no ``no_sync`` gradient pending, which lives in
memory only). Every rule runs on the tiny GPT wrapped with FSDP on a disk tier (this rank's
part of the batch, AdamW) and on the plain model (the global batch, torch AdamW).
Each example draws the tier's options first (``initialize``): ``generations`` "step"
or "unit", ``write_behind_bytes`` 0 or the default, ``prefetch`` on or off, nesting
(one unit per block under the root, 7 units by size, or one unit) and
``reshard_after_forward``.

Checks: each forward's loss (mean over ranks) equals the plain model's (1e-5); after
every rule that steps (and at a ``state_dict`` rule) the full ``model.state_dict()``
equals the plain model's (atol 2e-5, rtol 1e-4); after every rule (invariant) the
tier holds nothing in memory (``disk.resident_bytes() == 0``) and its committed
generation counts the steps taken.

[Note: one machine on two ranks]
As in ``test_fsdp_state_machine.py``: both ranks run the same machine inside one
``pool.run`` (``derandomize=True``, no database: the same draws on both ranks), every
check is made on values all ranks hold alike (all-reduced), and each rule starts with
``agree`` (an all-gather of its name and arguments). Shrinking is off (a replay on one
rank only would hang the other); the report lists the rules drawn. The run has its own
process group with a 30 s timeout, passed to every unit. Each example has its own
directory under the test's ``tmp_path`` (the same on both ranks: examples are counted).

Hypothesis switches rules off in some examples, so ``test_every_rule_in_one_sequence``
replays one fixed sequence holding every rule. The machine found two bugs (regression
tests in ``test_fsdp_disk_tier.py``): an ``optimizer.zero_grad()`` after a ``no_sync``
micro-batch did not drop its gradient
(``test_zero_grad_drops_gradients_accumulated_in_no_sync``), and a unit frozen after
training held the optimizer state read ahead for a step it never took
(``test_a_frozen_unit_holds_no_optimizer_state``).

``SHARDKIT_HYPOTHESIS_EXAMPLES`` sets the number of examples (default 8: 4 to 6 s on
the 2-core box, up to 12 s while it runs other tests); ``SHARDKIT_HYPOTHESIS_STEPS`` the
rules per example (default 15). Longer runs, all passing: 200 x 20 (3,281 rules, 57 s),
200 x 30 (5,263 rules, 260 s on a busy box), 300 x 12 (3,241 rules).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from shardkit.nn.data_parallel.fully_sharded import DiskOffload
from tests.nn.data_parallel.fsdp_disk_workers import HYPER, _disk_model
from tests.nn.data_parallel.fsdp_workers import (
    agree,
    global_batch,
    local_part,
    tiny_gpt,
)
from tests.nn.data_parallel.machines import machine_pool, machine_settings

EXAMPLES = int(os.environ.get("SHARDKIT_HYPOTHESIS_EXAMPLES", "8"))
STEPS = int(os.environ.get("SHARDKIT_HYPOTHESIS_STEPS", "15"))
LOSS_TOL = 1e-5
STATE_TOL = {"atol": 2e-5, "rtol": 1e-4}
SEEDS = st.integers(0, 7)
WRITE_BEHIND_DEFAULT = 512 * 2**20  # DiskOffload's default
SECOND_BACKWARD = "a second backward before optimizer.step()"
STEP_WITHOUT_BACKWARD = "without a backward since the last one"
Rules = list[tuple[str, dict[str, Any]]]  # a replay: (rule, its arguments), start first


class DiskFSDPMachine(RuleBasedStateMachine):
    """FSDP on a disk tier and the plain model side by side (class attributes set by
    :func:`run_machine`)."""

    group: dist.ProcessGroup | None = None
    root = Path()
    examples = 0
    drawn: dict[str, int] = {}  # noqa: RUF012 (rules and options drawn, for the report)

    def __init__(self) -> None:
        super().__init__()
        agree(self.group, "init")
        type(self).examples += 1
        self.directory = self.root / f"example{self.examples}"
        self.ref = tiny_gpt()
        self.ref_opt = torch.optim.AdamW(self.ref.parameters(), **HYPER["adamw"])
        self.model: Any = None
        self.opt: Any = None
        self.cfg: dict[str, Any] = {}
        self.steps = 0  # backward passes that stepped: the tier's generation
        self.unacknowledged = False  # a backward stepped, optimizer.step() not called yet
        self.pending = False  # a no_sync micro-batch's gradient waits for the next backward
        # a forward with grad enabled since the last step: it may have read optimizer
        # state ahead for the next step's backward (at most read_ahead_bytes), held until then
        self.read_ahead = False
        self.frozen: set[int] = set()  # blocks whose parameters do not require grad
        # losses of a forward kept for a later backward, and the steps taken before it
        self.kept: tuple[torch.Tensor, torch.Tensor, int] | None = None

    # helpers (collectives over the run's group, the same on every rank) ---------------
    def _at(self, *what: Any) -> None:
        """A rule starts: count it (and the tier's options), and check that every rank
        is at it with the same arguments (see the module note)."""
        counted = "-".join(map(str, what)) if what[0] == "start" else what[0]
        self.drawn[counted] = self.drawn.get(counted, 0) + 1
        agree(self.group, *what)

    def _disk(self) -> DiskOffload:
        tier = self.opt.tier
        assert isinstance(tier, DiskOffload)
        return tier

    def _open(self, resume: bool) -> None:
        self.model, self.opt = _disk_model(
            str(self.directory), self.cfg, resume=resume, process_group=self.group
        )
        self._set_trainable(self.model)  # a reopened model: the user freezes again
        self.read_ahead = False  # a new tier holds nothing

    def _set_trainable(self, model: torch.nn.Module) -> None:
        """``requires_grad`` False on the frozen blocks' parameters, True elsewhere."""
        frozen = tuple(f"blocks.{block}." for block in sorted(self.frozen))
        for name, param in model.named_parameters():
            param.requires_grad_(not name.startswith(frozen) if frozen else True)

    def _max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t)

    def _losses(self, seed: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Both losses on batch ``seed`` (the plain model on the global batch, FSDP on
        this rank's part); their values agree."""
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        x, y = global_batch(seed, world)
        ref_loss = self.ref(x, y)[1]
        loss = self.model(local_part(x, rank), local_part(y, rank))[1]
        self.read_ahead = self.read_ahead or torch.is_grad_enabled()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        got, want = float(t) / world, ref_loss.item()
        assert abs(got - want) < LOSS_TOL, f"{what}: FSDP loss {got:.7f} != plain {want:.7f}"
        return ref_loss, loss

    def _ref_step(self) -> None:
        self.ref_opt.step()
        self.ref_opt.zero_grad()

    def _check_state(self, what: str) -> None:
        """``model.state_dict()`` (the full weights) equals the plain model's."""
        state, ref_state = self.model.state_dict(), self.ref.state_dict()
        assert sorted(state) == sorted(ref_state), f"{what}: other state_dict() keys"
        diffs = torch.tensor(
            [float((state[k].double() - v.double()).abs().max()) for k, v in ref_state.items()],
            dtype=torch.float64,
        )
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX, group=self.group)  # the worst rank's
        for (key, want), diff in zip(ref_state.items(), diffs.tolist()):
            tol = STATE_TOL["atol"] + STATE_TOL["rtol"] * float(want.double().abs().max())
            assert diff <= tol, f"{what}: state_dict()[{key}] off by {diff:.3e} on some rank"

    def _refused(self, action: Any, match: str, what: str) -> None:
        """``action()`` raises ``RuntimeError`` saying ``match``, on every rank (checked
        on all of them together, so a rank that was not refused fails them all here)."""
        problem = f"{what}: not refused"
        try:
            action()
        except RuntimeError as exc:
            problem = "" if match in str(exc) else f"{what}: refused for another reason: {exc}"
        if self._max(float(bool(problem))):
            raise AssertionError(problem or f"{what}: refused here, not on another rank")

    # rules ----------------------------------------------------------------------------
    @initialize(
        generations=st.sampled_from(["step", "unit"]),
        write_behind=st.sampled_from([0, WRITE_BEHIND_DEFAULT]),
        prefetch=st.booleans(),
        nesting=st.sampled_from(["block", "size", "flat"]),
        raf=st.booleans(),
    )
    def start(
        self, generations: str, write_behind: int, prefetch: bool, nesting: str, raf: bool
    ) -> None:
        self._at("start", generations, write_behind, prefetch, nesting, raf)
        self.cfg = {
            "nesting": nesting,
            "optim": "adamw",
            "raf": raf,
            "prefetch": prefetch,
            "write_behind": write_behind,
            "generations": generations,
        }
        self._open(resume=False)

    @precondition(lambda self: not self.unacknowledged)
    @rule(seed=SEEDS)
    def step(self, seed: int) -> None:
        """forward, backward (the units step), ``optimizer.step()``, ``zero_grad()``."""
        self._at("step", seed)
        ref_loss, loss = self._losses(seed, "step")
        ref_loss.backward()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self._ref_step()
        self.steps, self.pending, self.read_ahead = self.steps + 1, False, False
        self._check_state("step")

    @precondition(lambda self: not self.unacknowledged)
    @rule(seed=SEEDS)
    def backward(self, seed: int) -> None:
        """forward and backward only: the units stepped, ``optimizer.step()`` follows."""
        self._at("backward", seed)
        ref_loss, loss = self._losses(seed, "backward")
        ref_loss.backward()
        loss.backward()
        self._ref_step()
        self.steps, self.pending, self.unacknowledged = self.steps + 1, False, True
        self.read_ahead = False  # the backward used the states read ahead
        self._check_state("backward")

    @precondition(lambda self: self.unacknowledged)
    @rule()
    def optimizer_step(self) -> None:
        """Acknowledge the backward's step."""
        self._at("optimizer_step")
        self.opt.step()
        self.opt.zero_grad()
        self.unacknowledged = False
        self._check_state("optimizer_step")

    @precondition(lambda self: self.unacknowledged)
    @rule(seed=SEEDS, no_sync=st.booleans())
    def second_backward(self, seed: int, no_sync: bool) -> None:
        """A backward before ``optimizer.step()`` acknowledged the previous one: refused
        before anything changes (the forward ran; its graph is dropped)."""
        self._at("second_backward", seed, no_sync)
        with self.model.no_sync() if no_sync else contextlib.nullcontext():
            _, loss = self._losses(seed, "second_backward")
            self._refused(loss.backward, SECOND_BACKWARD, "second_backward")

    @precondition(lambda self: not self.unacknowledged)
    @rule()
    def step_without_backward(self) -> None:
        self._at("step_without_backward")
        self._refused(self.opt.step, STEP_WITHOUT_BACKWARD, "step_without_backward")

    @precondition(lambda self: not self.unacknowledged)
    @rule(seed=SEEDS)
    def accumulate(self, seed: int) -> None:
        """A micro-batch inside ``no_sync``: forward and backward, nothing steps."""
        self._at("accumulate", seed)
        with self.model.no_sync():
            ref_loss, loss = self._losses(seed, "accumulate")
            loss.backward()
        ref_loss.backward()
        self.pending = True

    @rule()
    def zero_grad(self) -> None:
        """``optimizer.zero_grad()`` alone: drops a ``no_sync`` micro-batch's gradient
        (a skipped step), as the plain model's."""
        self._at("zero_grad")
        self.opt.zero_grad()
        self.ref_opt.zero_grad()
        self.pending = False

    @precondition(lambda self: not self.pending)
    @rule(block=st.integers(0, 1), frozen=st.booleans())
    def freeze(self, block: int, frozen: bool) -> None:
        """Freeze a block (``requires_grad`` False on the parameters ``named_parameters()``
        gives), or unfreeze it."""
        self._at("freeze", block, frozen)
        self.kept = None  # a backward after freezing: not the plain model's semantics
        (self.frozen.add if frozen else self.frozen.discard)(block)
        self._set_trainable(self.ref)
        self._set_trainable(self.model)

    @rule(seed=SEEDS, grad=st.booleans())
    def forward_only(self, seed: int, grad: bool) -> None:
        """An eval under ``no_grad`` (``grad`` False) or a forward with grad enabled
        whose output is dropped (a sanity check, generation)."""
        self._at("forward_only", seed, grad)
        if grad:
            self._losses(seed, "forward_only")
            return
        self.model.eval()
        self.ref.eval()
        with torch.no_grad():
            self._losses(seed, "eval")
        self.model.train()
        self.ref.train()

    @rule(seed=SEEDS)
    def forward_kept(self, seed: int) -> None:
        """A forward with grad enabled whose losses are kept for a later backward
        (replacing those kept before: their graphs dropped)."""
        self._at("forward_kept", seed)
        self.kept = (*self._losses(seed, "forward_kept"), self.steps)

    @precondition(lambda self: self.kept is not None and not self.unacknowledged)
    @rule()
    def late_backward(self) -> None:
        """The backward of the kept forward, rules later: with no step since, a step as
        ``backward`` (after evals, ``state_dict()``, other forwards); after a step, refused
        (the parameters changed since that forward) before anything changes."""
        assert self.kept is not None
        ref_loss, loss, steps = self.kept
        self._at("late_backward", steps == self.steps)
        self.kept = None
        if steps != self.steps:
            self._refused(loss.backward, "were changed", "late_backward")
            return
        ref_loss.backward()
        loss.backward()
        self._ref_step()
        self.steps, self.pending, self.unacknowledged = self.steps + 1, False, True
        self.read_ahead = False  # the backward used the states read ahead
        self._check_state("late_backward")

    @rule()
    def read_state_dict(self) -> None:
        self._at("read_state_dict")
        self._check_state("read_state_dict")

    @precondition(lambda self: not self.unacknowledged and not self.pending)
    @rule()
    def reopen(self) -> None:
        """Close the tier, rebuild the model on meta from its directory, a new optimizer."""
        self._at("reopen")
        self.kept = None  # the old model's graph
        self._disk().close()
        self.model = self.opt = None
        self._open(resume=True)
        self._check_state("reopen")

    # invariant ------------------------------------------------------------------------
    @invariant()
    def nothing_resident_and_generation_counts_steps(self) -> None:
        if self.opt is None:  # before start
            return
        agree(self.group, "invariant")
        disk = self._disk()
        held = self._max(float(disk.resident_bytes()))
        limit = disk.read_ahead_bytes if self.read_ahead else 0
        assert held <= limit, f"the disk tier holds {held:.0f} bytes between rules on some rank"
        assert disk.generation == self.steps, f"generation {disk.generation}, {self.steps} steps"

    def teardown(self) -> None:
        if self.opt is not None:
            self._disk().close()
            shutil.rmtree(self._disk().directory, ignore_errors=True)
        self.model = self.opt = self.kept = None


RULES = (
    "step",
    "backward",
    "optimizer_step",
    "second_backward",
    "step_without_backward",
    "accumulate",
    "zero_grad",
    "freeze",
    "forward_only",
    "forward_kept",
    "late_backward",
    "read_state_dict",
    "reopen",
)


def run_machine(root: str, examples: int, steps: int) -> dict[str, Any]:
    """Rank-side: the machine; ``error`` (None, or the failure's report) and ``drawn``
    (how often each rule and each set of tier options was drawn)."""
    DiskFSDPMachine.group = dist.new_group(timeout=timedelta(seconds=30))
    DiskFSDPMachine.root = Path(root)
    DiskFSDPMachine.examples = 0
    DiskFSDPMachine.drawn = {}
    error = None
    try:
        run_state_machine_as_test(
            DiskFSDPMachine,
            settings=machine_settings(examples, steps),
        )
    except Exception:
        error = traceback.format_exc()
    return {"error": error, "drawn": dict(sorted(DiskFSDPMachine.drawn.items()))}


def test_fsdp_disk_state_machine(rank_pool: Any, tmp_path: Path) -> None:
    # the shared pool's 120 s fits the default 8 x 15 rules; a larger setting gets its
    # own pool with the limit scaled by the rules drawn
    scale = EXAMPLES * STEPS / (8 * 15)
    with contextlib.ExitStack() as stack:
        pool = machine_pool(stack, rank_pool, scale)
        per_rank = pool.run(run_machine, str(tmp_path), EXAMPLES, STEPS)
    drawn = per_rank[0]["drawn"]
    print(drawn)  # with -s: what the run covered
    assert per_rank[0]["error"] is None, f"{drawn}\n{per_rank[0]['error']}"
    assert per_rank[1]["error"] is None, f"rank 1 only:\n{per_rank[1]['error']}"


def replay(root: str, rules: Rules) -> str | None:
    """Rank-side: ``rules`` (``start`` first) on a fresh machine, the invariant after
    each, as hypothesis runs them; None, or the failure's report."""
    DiskFSDPMachine.group = dist.new_group(timeout=timedelta(seconds=30))
    DiskFSDPMachine.root = Path(root)
    machine = DiskFSDPMachine()
    try:
        for name, kwargs in rules:
            getattr(machine, name)(**kwargs)
            machine.nothing_resident_and_generation_counts_steps()
    except Exception:
        return traceback.format_exc()
    finally:
        machine.teardown()
    return None


def _replayed(rank_pool: Any, tmp_path: Path, rules: Rules) -> None:
    per_rank = rank_pool(2).run(replay, str(tmp_path), rules)
    assert per_rank[0] is None, per_rank[0]
    assert per_rank[1] is None, f"rank 1 only:\n{per_rank[1]}"


EVERY_RULE: Rules = [
    ("step", {"seed": 0}),
    ("freeze", {"block": 1, "frozen": True}),
    ("accumulate", {"seed": 1}),
    ("read_state_dict", {}),
    ("zero_grad", {}),
    ("accumulate", {"seed": 2}),
    ("forward_only", {"seed": 3, "grad": True}),
    ("read_state_dict", {}),
    ("backward", {"seed": 4}),
    ("second_backward", {"seed": 5, "no_sync": True}),
    ("forward_only", {"seed": 5, "grad": False}),
    ("second_backward", {"seed": 5, "no_sync": False}),
    ("optimizer_step", {}),
    ("step_without_backward", {}),
    ("reopen", {}),
    ("step", {"seed": 6}),
    ("freeze", {"block": 1, "frozen": False}),
    ("forward_kept", {"seed": 7}),
    ("forward_only", {"seed": 0, "grad": True}),
    ("read_state_dict", {}),
    ("late_backward", {}),
    ("optimizer_step", {}),
    ("forward_kept", {"seed": 1}),
    ("step", {"seed": 2}),
    ("late_backward", {}),
    ("step", {"seed": 3}),
]


def test_every_rule_in_one_sequence(rank_pool: Any, tmp_path: Path) -> None:
    """Every rule at least once, whatever the draws (hypothesis switches rules off in
    some examples): one unit per block, per-unit generations, no write-behind."""
    start = {"generations": "unit", "write_behind": 0, "prefetch": True}
    rules: Rules = [("start", {**start, "nesting": "block", "raf": False}), *EVERY_RULE]
    assert {name for name, _ in rules} >= set(RULES)
    _replayed(rank_pool, tmp_path, rules)
