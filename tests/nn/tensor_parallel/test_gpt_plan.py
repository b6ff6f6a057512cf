"""The GPT with the tensor-parallel plan (issue 18) against the plain GPT, tp = 1, 2, 4.

Loss, logits and every parameter's gradient (shards gathered back to the full
tensor) equal the plain model's on the same batch; with ``loss_parallel`` the logits
stay vocabulary-parallel and the loss comes from ``vocab_parallel_cross_entropy``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.nn.tensor_parallel import tp_workers as w

DEGREES = [1, 2, 4]
TOL = 1e-6


def _jobs() -> dict[str, tuple[str, dict[str, Any]]]:
    jobs: dict[str, tuple[str, dict[str, Any]]] = {}
    for t in DEGREES:
        for lp in (False, True):
            jobs[f"gpt-{t}-{lp}"] = ("gpt_parity", {"tp": t, "loss_parallel": lp})
    jobs["errors-4"] = ("plan_errors", {"tp": 4})
    return jobs


@pytest.fixture(scope="module")
def results(rank_pool: Any) -> dict[str, list[Any]]:
    jobs = _jobs()
    per_rank = rank_pool(4).run(w.run_jobs, list(jobs.values()))
    return {key: [r[i] for r in per_rank] for i, key in enumerate(jobs)}


@pytest.mark.parametrize("loss_parallel", [False, True])
@pytest.mark.parametrize("t", DEGREES)
def test_tp_gpt_equals_plain_gpt(results: Any, t: int, loss_parallel: bool) -> None:
    for rank, r in enumerate(results[f"gpt-{t}-{loss_parallel}"]):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert r["loss"] <= TOL, f"rank {rank}: loss differs by {r['loss']:.3e}"
        assert r["logits"] <= TOL, f"rank {rank}: logits differ by {r['logits']:.3e}"
        for name, d in r["grads"].items():
            assert d <= TOL, f"rank {rank}: grad of {name} differs by {d:.3e}"
        assert len(r["grads"]) == 2 + 2 + 2 * 12  # wte, wpe, ln_f x2, 12 per block
        assert r["tied"] == 1.0, "lm_head no longer tied to wte"
        assert r["n_head"] == 4 / t
        assert r["local_qkv_rows"] == 3 * 32 / t


def test_plan_errors_name_the_sizes(results: Any) -> None:
    r = results["errors-4"][0]
    assert "error" not in r, r.get("error")
    assert "'blocks.0.attn' has n_head=2 attention heads, not divisible by the " in r["heads"]
    assert "tensor-parallel degree 4" in r["heads"]
    assert "vocabulary size 66: 66 is not divisible" in r["vocab"] and "4" in r["vocab"]
    assert "plan patterns matched no module: ['blocks.*.mlp.9']" in r["typo"]
    assert r["type"].startswith("TypeError") and "'wte', a Embedding" in r["type"]
