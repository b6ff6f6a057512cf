"""FSDP's shard store and gradient reducer are picked once, at construction, from the
options (the unit itself has no branch on them); the values they produce are checked
by the parity tests (test_fsdp_parity, test_fsdp_hybrid, test_fsdp_disk_tier,
distributed/test_compression)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.nn.data_parallel import policy_workers as w

EXPECTED = {  # option set -> (store, reducer, compress_scatter, replicas)
    "plain": ("MemoryStore", "ExactReducer", None, False),
    "bf16": ("MemoryStore", "CompressedReducer", True, False),
    "hybrid": ("MemoryStore", "ExactReducer", None, True),
    "hybrid-bf16": ("MemoryStore", "CompressedReducer", False, True),
    "disk": ("DiskUnit", "ExactReducer", None, False),
}


def test_policies_are_picked_from_the_options(rank_pool: Any, tmp_path: Path) -> None:
    per_rank = rank_pool(2).run(w.policies_picked, str(tmp_path))
    for rank, picked in enumerate(per_rank):
        assert sorted(picked) == sorted(EXPECTED)
        for options, units in picked.items():
            assert len(units) == 2, options  # the root and the nested unit
            for unit in units:
                got = (
                    unit["store"],
                    unit["reducer"],
                    unit["compress_scatter"],
                    unit["replicas"],
                )
                assert got == EXPECTED[options], f"rank {rank}, {options}: {got}"
                assert not unit["has_disk_attribute"], options
