"""Tensor parallel with explicit groups and no registered mesh, in the universal checkpoint.

The tiny GPT split tensor-parallel 2 over explicit process groups (``parallelize(...,
process_group=tp)``; ``shardkit.distributed.mpu`` never initialised), alone (a plain
module over 4 ranks: two tensor-parallel groups, each a whole copy of the model) or
under DDP, OSS, ShardedDDP or FSDP over the data-parallel group, or hybrid FSDP (shard
groups of one rank replicated over the data-parallel group), saves and loads at another
tensor-parallel degree (1, or 2 from 1) and another wrapper. Who writes a tensor every
tensor-parallel rank holds whole, or a part several data-parallel ranks hold, comes
from the shard descriptors alone. Checked as in ``test_universal_strategies``: every
element written exactly once, the loaded state equal to the saved one exactly, both
equal to the plain twin (and after one more step) to fp32 rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.checkpoint.test_universal_strategies import check
from tests.checkpoint.universal_workers import run_pairs

PAIRS = {
    "tp2 plain over 4 ranks -> plain1": (("gpt", "tpg", 4), ("plain", 1)),
    "tp2xddp2 -> fsdp4": (("gpt", "tpg_ddp", 4), ("fsdp", 4)),
    "tp2xfsdp2 -> tp2 plain over 4 ranks": (("gpt", "tpg_fsdp", 4), ("tpg", 4)),
    "tp2xoss2 -> tp2xddp2": (("gpt", "tpg_oss", 4), ("tpg_ddp", 4)),
    "ddp4 -> tp2xfsdp2": (("gpt", "ddp", 4), ("tpg_fsdp", 4)),
    "tp2xsdp2 -> plain2": (("gpt", "tpg_sdp", 4), ("plain", 2)),
    "tp2 x hybrid 1x2 -> tp2xsdp2": (("gpt", "tpg_hsdp", 4), ("tpg_sdp", 4)),
}


@pytest.mark.timeout(300)
def test_tensor_parallel_without_registered_mesh(rank_pool: Any, tmp_path: Path) -> None:
    results = rank_pool(4).run(run_pairs, list(PAIRS.values()), str(tmp_path))
    for label, result in zip(PAIRS, results[0]):
        check(result, label)
