"""Hugging Face GPT-2 (``GPT2LMHeadModel``, Conv1D projections) with ``hf_gpt2_plan``
(issue 18) against the plain model at tp = 1 and 2: loss, logits and every gradient
within 1e-6 (Conv1D weights compared transposed), gathered and vocabulary-parallel
logits. On the 2-rank pool: importing transformers costs seconds per rank (degree 4
is covered by the GPT's plan, test_gpt_plan.py, whose layers are the same)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.nn.tensor_parallel import tp_workers as w

pytest.importorskip("transformers")

DEGREES = [1, 2]
TOL = 1e-6


@pytest.fixture(scope="module")
def results(rank_pool: Any) -> dict[str, list[Any]]:
    jobs = {
        f"hf-{t}-{lp}": ("hf_gpt2_parity", {"tp": t, "loss_parallel": lp})
        for t in DEGREES
        for lp in (False, True)
    }
    per_rank = rank_pool(2).run(w.run_jobs, list(jobs.values()))
    return {key: [r[i] for r in per_rank] for i, key in enumerate(jobs)}


@pytest.mark.parametrize("loss_parallel", [False, True])
@pytest.mark.parametrize("t", DEGREES)
def test_tp_hf_gpt2_equals_plain(results: Any, t: int, loss_parallel: bool) -> None:
    for rank, r in enumerate(results[f"hf-{t}-{loss_parallel}"]):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert r["loss"] <= TOL, f"rank {rank}: loss differs by {r['loss']:.3e}"
        assert r["logits"] <= TOL, f"rank {rank}: logits differ by {r['logits']:.3e}"
        for name, d in r["grads"].items():
            assert d <= TOL, f"rank {rank}: grad of {name} differs by {d:.3e}"
        assert len(r["grads"]) == 2 + 2 + 2 * 12
        assert r["tied"] == 1.0
