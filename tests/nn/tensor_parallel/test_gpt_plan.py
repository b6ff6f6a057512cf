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


@pytest.mark.parametrize("loss_parallel", [False, True])
def test_communication_is_megatrons_count(rank_pool: Any, loss_parallel: bool) -> None:
    """Counted elements per collective, one step of the TP GPT at tp 2 and 4, against
    Megatron-LM's exact count (Shoeybi et al. 2019, section 3): per transformer layer 2
    all-reduces of b x s x h in forward and 2 in backward; plus the vocabulary-parallel
    embedding (1 in forward) and the LM head's input (1 in backward); the logits are
    all-gathered (b x s x V/T per rank) or, with loss_parallel, never: 3 all-reduces of
    b x s for the cross-entropy instead."""
    jobs = [("communication_count", {"tp": t, "loss_parallel": loss_parallel}) for t in (2, 4)]
    per_rank = rank_pool(4).run(w.run_jobs, jobs)
    b, s, h, layers, vocab = (
        w.BATCH,
        w.SEQ,
        w.TINY["n_embd"],
        w.TINY["n_layer"],
        w.TINY["vocab_size"],
    )
    bsh = b * s * h
    for t, counts in zip((2, 4), per_rank[0], strict=True):
        assert "error" not in counts, counts.get("error")
        want = {
            "forward all_reduce": [bsh] * (2 * layers + 1),
            "backward all_reduce": [bsh] * (2 * layers + 1),
        }
        if loss_parallel:
            want["forward all_reduce"] += [b * s] * 3
        else:
            want["forward all_gather"] = [b * s * vocab // t]
        assert counts == want, f"tp {t}: {counts}"
