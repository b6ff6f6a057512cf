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

from tests.checkpoint.universal_workers import (
    OTHER_HYPER,
    TRAIN_STEPS,
    adamw,
    batch,
    loss_of,
    make_model,
    run_empty_pieces,
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
