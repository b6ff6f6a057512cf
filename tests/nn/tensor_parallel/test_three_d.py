"""3-D parallelism (issue 18): pipeline 2 x data parallel 2 x tensor parallel 2 on 8
ranks (oversubscribed on CPU, tiny GPT), 3 SGD steps against the plain GPT on the
global batch: losses (last stage) within 1e-5, every parameter of every stage within
2e-5 (tensor-parallel shards gathered back)."""

from __future__ import annotations

from typing import Any

from tests.nn.tensor_parallel import tp_workers as w


def test_pipeline_x_data_x_tensor_parallel(rank_pool: Any) -> None:
    per_rank = rank_pool(8).run(w.run_jobs, [("three_d", {})])
    seen: set[str] = set()
    for rank, (r,) in enumerate(per_rank):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert r["stage"] == rank // 4  # pp outermost
        if r["stage"] == 1:
            assert len(r["losses"]) == w.STEPS
            for step, (got, want) in enumerate(zip(r["losses"], r["ref_losses"], strict=True)):
                assert abs(got - want) < 1e-5, f"rank {rank} step {step}: {got} != {want}"
            assert r["losses"][-1] < r["losses"][0] - 1e-3
        for name, d in r["params"].items():
            assert d < 2e-5, f"rank {rank}: {name} differs by {d:.3e}"
        seen |= set(r["params"])
    assert len(seen) == 2 + 2 + 2 * 12 + 1  # every parameter, lm_head untied
