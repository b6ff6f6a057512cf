"""Universal load into FSDP: a rank that holds no element of a parameter gets its
optimizer state too.

A small bias or norm weight can lie wholly outside a rank's flat shard. Before, the
FSDP adapter listed no piece of it on that rank, so a load neither created nor
overwrote its optimizer state there: ``step`` stayed stale (a run that had stepped
before loading) or the state was missing (a fresh optimizer), and
``gather_full_optim_state_dict`` on that rank reported the stale ``step`` or dropped
the parameter; reloading that consolidated state stepped with a wrong Adam bias
correction.

Cases: ShardedDataParallel at 3 ranks -> FSDP at 2 (the target stepped once before
loading: stale state), tensor parallel 2 -> FSDP at 2 (fresh target: no state). The
target's hyperparameters are changed before loading. Checked: some parameter is an
empty piece on some rank; on every rank every parameter has the saved state names,
the saved ``step`` exactly and the saved hyperparameters; the gathered full state
equals the saving run's exactly; a plain model loading that full state steps like
the plain twin continuing from the saved state.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardkit.checkpoint.manifest import find_valid_checkpoint, read_manifest
from shardkit.checkpoint.universal import load_universal, save_universal
from shardkit.nn import FSDP
from tests.checkpoint.universal_workers import (
    OTHER_HYPER,
    TRAIN_STEPS,
    adamw,
    batch,
    loss_of,
    make_model,
    run_empty_pieces,
    run_state_owners,
)

TOL = {"atol": 1e-5, "rtol": 1e-4}


def _check(results: list[Any], family: str, label: str) -> None:
    members = [r for r in results if r is not None]
    first = members[0]
    saved, twin_opt = first["saved"], first["twin_opt"]
    assert any(r["empty"] for r in members), f"{label}: no empty piece on any rank"
    want_hyper = [{k: g[k] for k in OTHER_HYPER} for g in twin_opt["param_groups"]]
    for rank, r in enumerate(members):
        assert r["loaded"]["groups"] == want_hyper, f"{label} rank {rank}: hyperparameters"
        for name, state in r["loaded"]["state"].items():
            what = f"{label} rank {rank} {name}" + (" (empty piece)" if name in r["empty"] else "")
            want_names = set(saved["state"][name]) | set(saved["scalars"][name])
            assert state is not None, f"{what}: no optimizer state"
            assert set(state) == want_names, f"{what}: state {sorted(state)}"
            assert float(state["step"]) == saved["scalars"][name]["step"] == TRAIN_STEPS, (
                f"{what}: step {float(state['step'])}, saved {saved['scalars'][name]['step']}"
            )
    full, names = first["full"], first["names"]
    assert sorted(full["state"]) == list(range(len(names))), f"{label}: gathered parameters"
    for index, name in enumerate(names):
        got = full["state"][index]
        assert float(got["step"]) == TRAIN_STEPS, f"{label} gathered {name}: step {got['step']}"
        for state_name, value in saved["state"][name].items():
            assert torch.equal(got[state_name].reshape(-1), value), f"{label} {name} {state_name}"
    # the gathered state reloaded into a plain model steps like the twin
    plain = make_model(family)
    plain.load_state_dict(first["params"])
    plain_opt = adamw(plain.parameters())
    plain_opt.load_state_dict(full)
    twin = make_model(family)
    twin.load_state_dict(first["twin"])
    twin_opt_again = adamw(twin.parameters())
    twin_opt_again.load_state_dict(copy.deepcopy(twin_opt))
    for model, opt in ((plain, plain_opt), (twin, twin_opt_again)):
        x, y = batch(family, TRAIN_STEPS)
        opt.zero_grad()
        loss_of(family, model, x, y).backward()
        opt.step()
    want = twin.state_dict()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(value, want[key], **TOL, msg=f"{label} reloaded step {key}")
    for key, value in first["stepped"]["params"].items():
        torch.testing.assert_close(
            value, want[key].reshape(-1), **TOL, msg=f"{label} loaded step {key}"
        )


@pytest.mark.timeout(300)
def test_sdp3_to_fsdp2_stale_state(rank_pool: Any, tmp_path: Path) -> None:
    results = rank_pool(3).run(
        run_empty_pieces, ("seq", "sdp", 3), ("fsdp", 2), str(tmp_path), True
    )
    _check(results, "seq", "sdp3->fsdp2")


@pytest.mark.timeout(300)
def test_tp2_to_fsdp2_fresh_state(rank_pool: Any, tmp_path: Path) -> None:
    results = rank_pool(2).run(
        run_empty_pieces, ("gpt", "tp", 2), ("fsdp", 2), str(tmp_path), False
    )
    _check(results, "gpt", "tp2->fsdp2")


class _WithEmpty(nn.Module):
    """A parameter of no element (no rank holds any of it) beside a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.e = nn.Parameter(torch.zeros(0, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.e.sum()


def _zero_element_worker(root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = FSDP(_WithEmpty())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    save_universal(root, 1, model, optimizer)
    target = FSDP(_WithEmpty())
    target_opt = torch.optim.Adam(target.parameters())
    load_universal(root, target, target_opt)
    steps = {n: float(target_opt.state[p]["step"]) for n, p in target.named_parameters()}
    return {
        "keys": sorted(read_manifest(find_valid_checkpoint(root)).layout["keys"]),
        "steps": steps,
    }


@pytest.mark.timeout(180)
def test_zero_element_parameter_is_saved_and_loaded(rank_pool: Any, tmp_path: Path) -> None:
    """Before, an FSDP parameter of no element was left out of the checkpoint (no rank
    held a piece; a plain model would not load it: missing key ``e``) and a load into
    FSDP gave it no optimizer state (``KeyError: 'step'``)."""
    for got in rank_pool(2).run(_zero_element_worker, str(tmp_path)):
        assert got["keys"] == ["a.bias", "a.weight", "e"], got
        assert got["steps"] == {"a.weight": 1.0, "a.bias": 1.0, "e": 1.0}, got


@pytest.mark.timeout(300)
def test_state_on_its_owner_rank_oss_sdp_offload(rank_pool: Any, tmp_path: Path) -> None:
    """Siblings: a parameter's state lives on its OSS owner only (the others hold none)
    or in the one OffloadModel process. After loading sdp@3 into sdp@2, oss@2 (both
    stepped once before) and offload@1: every parameter's state is held exactly once
    with the saved names and ``step``, the hyperparameters are the saved ones, and the
    consolidated OSS state equals the saving run's exactly."""
    results = rank_pool(3).run(run_state_owners, str(tmp_path))
    saved = results[0]["saved"]
    want_hyper = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-4, "weight_decay": 0.01}
    for kind, world in (("sdp", 2), ("oss", 2), ("offload", 1)):
        per_rank = [r[kind] for r in results[:world]]
        held: dict[str, Any] = {}
        for got in per_rank:
            assert got["groups"] == [want_hyper], (kind, got["groups"])
            for name, value in got["state"].items():
                assert name not in held, f"{kind}: {name} held twice"
                held[name] = value
        assert len(held) == len(saved["state"]), (kind, sorted(held))
        for name, (state_names, step) in held.items():
            key = name if name in saved["state"] else None
            want_names = (
                sorted(set(saved["state"][key]) | set(saved["scalars"][key]))
                if key
                else ["exp_avg", "exp_avg_sq", "step"]
            )
            assert state_names == want_names and step == TRAIN_STEPS, (kind, name, step)
        if kind == "offload":
            continue
        full, order = per_rank[0]["full"], per_rank[0]["order"]
        assert sorted(full["state"]) == list(range(len(order))), kind
        for index, name in enumerate(order):
            got_state = full["state"][index]
            assert float(got_state["step"]) == TRAIN_STEPS, (kind, name)
            for state_name, value in saved["state"][name].items():
                assert torch.equal(got_state[state_name].reshape(-1), value), (kind, name)
