"""verify_consistent: agreeing ranks pass; a different model raises on every rank."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from shardkit.distributed.consistency import (
    ConsistencyError,
    describe_parameters,
    verify_consistent,
)


def _check(case: str) -> str:
    rank = dist.get_rank()
    width = 5 if (case == "shape" and rank == 2) else 4
    model = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2))
    if case == "frozen" and rank == 1:
        model[1].bias.requires_grad_(False)
    if case == "extra" and rank == 3:
        model.append(nn.Linear(2, 2))
    options = {"reshard": case != "option" or rank != 0}
    try:
        verify_consistent(
            describe_parameters(model.named_parameters()), what="Wrapper", options=options
        )
    except ConsistencyError as err:
        return str(err)
    return "ok"


def _all_cases() -> dict[str, str]:
    return {case: _check(case) for case in ("same", "shape", "frozen", "extra", "option")}


def test_mismatches_are_named_on_every_rank(rank_pool) -> None:
    results = rank_pool(4).run(_all_cases)
    for case in ("same", "shape", "frozen", "extra", "option"):
        msgs = {r[case] for r in results}
        assert len(msgs) == 1, f"{case}: ranks saw different outcomes {msgs}"
    assert results[0]["same"] == "ok"
    assert results[0]["shape"].startswith(
        "Wrapper: ranks disagree at entry 1 of 5: ranks [0, 1, 3] have "
        "'0.weight shape=(4, 4) dtype=torch.float32 requires_grad=True'; "
        "ranks [2] have '0.weight shape=(5, 4)"
    )
    assert (
        "ranks [1] have '1.bias shape=(2,) dtype=torch.float32 requires_grad=False'"
        in (results[0]["frozen"])
    )
    assert (
        "entry 5 of 7: ranks [0, 1, 2] have '<missing>'; ranks [3] have '2.weight"
        in (results[0]["extra"])
    )
    assert "ranks [0] have 'option reshard=False'" in results[0]["option"]
    assert "Every rank must build the same model" in results[0]["option"]


def test_single_process_without_group_is_a_no_op() -> None:
    verify_consistent(["anything"], what="Wrapper")
