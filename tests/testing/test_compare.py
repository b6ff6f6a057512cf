"""Comparison helpers name the first differing tensor and the size of the difference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.testing import (
    assert_same_across_ranks,
    assert_state_dicts_close,
    assert_tensors_close,
    max_abs_diff,
)


def test_max_abs_diff() -> None:
    assert max_abs_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 0.0])) == 2.0
    assert max_abs_diff(torch.empty(0), torch.empty(0)) == 0.0


def test_tensors_close_reports_shape_and_difference() -> None:
    assert_tensors_close(torch.ones(3), torch.ones(3) + 1e-7)
    with pytest.raises(AssertionError, match=r"w: max \|diff\| 1.000e-02"):
        assert_tensors_close(torch.zeros(2), torch.tensor([0.0, 0.01]), name="w")
    with pytest.raises(AssertionError, match=r"shape \(2,\) != expected \(3,\)"):
        assert_tensors_close(torch.zeros(2), torch.zeros(3))


def test_state_dicts_name_first_differing_key() -> None:
    a = torch.nn.Linear(3, 2)
    b = torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    assert_state_dicts_close(a, b)
    with torch.no_grad():
        b.bias[1] += 0.5
    with pytest.raises(AssertionError, match=r"bias: max \|diff\| 5.000e-01"):
        assert_state_dicts_close(a, b)
    with pytest.raises(AssertionError, match=r"missing \['bias'\]"):
        assert_state_dicts_close({"weight": a.weight}, a)


def _check_across_ranks(perturb: bool) -> str:
    model = torch.nn.Linear(2, 2)
    if perturb and dist.get_rank() == 2:
        with torch.no_grad():
            model.weight[0, 0] += 0.25
    try:
        assert_same_across_ranks(model)
    except AssertionError as err:
        return str(err)
    return "same"


def test_same_across_ranks(rank_pool) -> None:
    pool = rank_pool(3)
    assert pool.run(_check_across_ranks, False) == ["same"] * 3
    msgs = pool.run(_check_across_ranks, True)
    assert all(m == msgs[0] for m in msgs)
    assert msgs[0].startswith("weight: group ranks [2] differ from rank 0 (max |diff| 2.500e-01")
