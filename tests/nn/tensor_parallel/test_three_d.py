"""3-D meshes on 8 ranks (oversubscribed on CPU, tiny GPT), 3 SGD steps against the
plain GPT on the global batch (issue 18):

- pipeline 2 x data parallel 2 x tensor parallel 2: losses (last stage) within 1e-5,
  every parameter of every stage within 2e-5 (tensor-parallel shards gathered back);
- data parallel replicate 2 x shard 2 x tensor parallel 2: FSDP's hybrid sharding over
  the mesh's ``dp_shard`` and ``dp_replicate`` groups, one unit per block, same
  tolerances."""

from __future__ import annotations

from typing import Any

from tests.nn.tensor_parallel import tp_workers as w

HSDP = {"tp": 2, "dp_replicate": 2, "wrapper": "hsdp", "nested": True}


def _check_hybrid(rank: int, r: dict[str, Any]) -> None:
    assert "error" not in r, f"hsdp, rank {rank}:\n{r['error']}"
    for step, (got, want) in enumerate(zip(r["losses"], r["ref_losses"], strict=True)):
        assert abs(got - want) < 1e-5, f"hsdp, rank {rank} step {step}: {got} != {want}"
    for name, d in r["params"].items():
        assert d < 2e-5, f"hsdp, rank {rank}: {name} differs by {d:.3e}"
    assert r["losses"][-1] < r["losses"][0] - 1e-3


def test_three_d_meshes(rank_pool: Any) -> None:
    per_rank = rank_pool(8).run(w.run_jobs, [("three_d", {}), ("tp_with_data_parallel", HSDP)])
    seen: set[str] = set()
    for rank, (r, hybrid) in enumerate(per_rank):
        _check_hybrid(rank, hybrid)
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
