"""Every wrapper with compiled modules: compiled and eager training give the same
parameters, nothing inside a block breaks the graph, and nothing recompiles.

The order is the one users write (docs/compile.md): compile each transformer block in
place (``block.compile()``), then wrap it (FSDP flat and nested, reshard after forward
on and off, hybrid sharding, mixed precision, activation checkpointing, OSS under torch
DDP, ShardedDataParallel, tensor parallel, a 1F1B pipeline stage); and, for the
DDP-style wrappers and tensor parallel, the wrapped model compiled as a whole.

The correctness matrix compiles with ``backend="aot_eager"`` (dynamo's graph capture
and AOTAutograd's joint forward/backward graph, run by eager kernels): it exercises
everything compile changes in a wrapper's world (the captured graph, parameters lifted
to graph inputs, hooks around compiled code, guards and recompiles) at a fraction of
inductor's compile time, and is bitwise equal to eager. One case runs inductor (C++
kernels), within 1e-5 of eager after 3 AdamW steps.

All cases run in one spawned 2-rank group; cases sharing a block's shapes reuse the
graph the first one compiled (dynamo's cache keys on the backend object, shared).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.compile import compile_workers as w

# case -> (graphs compiled by this case, compiled-graph calls per step)
# The fp32 block graph is compiled once, by the first case; every other wrapper around
# the same blocks reuses it: wrapping a compiled block recompiles nothing.
CASES: dict[str, tuple[int, int]] = {
    "fsdp:flat-raf": (1, 2),  # one graph for both blocks, called once per block
    "fsdp:flat-keep": (0, 2),
    "fsdp:block-raf": (0, 2),
    "fsdp:block-keep": (0, 2),
    "fsdp:whole": (0, 2),  # FSDP's forward is never traced: the blocks still run compiled
    "hsdp": (0, 2),
    "ckpt:ddp": (0, 4),  # forward, then the recompute in backward
    "ckpt:fsdp": (0, 4),
    "oss": (0, 2),
    "sdp": (0, 2),
    "pipe": (0, 2),  # one block per stage, 2 micro-batches
    "fsdp_bf16": (1, 2),  # bf16 compute: a second graph (other dtypes)
    "tp": (1, 2),  # the block's local shards: other shapes
    "oss:whole": (1, 1),  # whole-model compiles: the GPT is one graph
    "sdp:whole": (1, 1),
    "tp:whole": (1, 1),
}
TOL = 1e-5


@pytest.fixture(scope="module")
def matrix(rank_pool: Any) -> list[dict[str, dict[str, Any]]]:
    result: list[dict[str, dict[str, Any]]] = rank_pool(2).run(
        w.compare, list(CASES), timeout_s=600
    )
    return result


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_trains_like_eager(matrix: Any, case: str) -> None:
    for rank, per_case in enumerate(matrix):
        r = per_case[case]
        assert "error" not in r, f"rank {rank} {case}: {r['error']}"
        assert r["moved"] > 5e-4, f"rank {rank} {case}: training did not move ({r['moved']})"
        assert r["diff"] <= TOL, f"rank {rank} {case}: compiled - eager = {r['diff']:.3e}"


@pytest.mark.parametrize("case", list(CASES))
def test_no_recompile_no_break_inside_blocks(matrix: Any, case: str) -> None:
    graphs, calls = CASES[case]
    for rank, per_case in enumerate(matrix):
        r = per_case[case]
        assert "error" not in r, f"rank {rank} {case}: {r['error']}"
        assert r["graphs"] == [graphs] * w.STEPS, f"rank {rank} {case}: graphs {r['graphs']}"
        assert r["calls"] == [calls * (i + 1) for i in range(w.STEPS)], (rank, case, r["calls"])
        if case == "oss:whole":
            # torch DDP's own forward is a graph break (torch skips DDP._inside_ddp_forward);
            # the GPT inside it is one graph.
            assert list(r["breaks"]) and all("_inside_ddp_forward" in k for k in r["breaks"])
        else:
            assert r["breaks"] == {}, f"rank {rank} {case}: graph breaks {r['breaks']}"


def test_inductor_fsdp_blocks_match_eager(rank_pool: Any) -> None:
    """Nested FSDP around blocks compiled by inductor (the default backend)."""
    case = "fsdp:block-raf"
    per_rank = rank_pool(2).run(w.compare, [case], "inductor", timeout_s=600)
    for rank, per_case in enumerate(per_rank):
        r = per_case[case]
        assert "error" not in r, f"rank {rank}: {r['error']}"
        assert r["moved"] > 5e-4
        assert r["diff"] <= TOL, f"rank {rank}: inductor - eager = {r['diff']:.3e}"
        assert r["graphs"] == [1] * w.STEPS and r["breaks"] == {}, r
        assert r["calls"] == [2, 4, 6], r["calls"]
