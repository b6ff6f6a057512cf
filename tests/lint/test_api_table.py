"""docs/api/index.md's table of public names, canonical paths and aliases is current
(tools/api_table.py regenerates it), and its canonical paths follow the rule the page
states: FairScale's path where FairScale has the name."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import api_table  # noqa: E402


def test_the_api_page_table_is_current() -> None:
    current = api_table.PAGE.read_text()
    assert api_table.render(current) == current, (
        "docs/api/index.md is stale: run `python tools/api_table.py` and commit the page"
    )


def test_canonical_paths_and_aliases() -> None:
    rows = api_table.rows()
    by_name = {row.canonical(): row for row in rows}
    fsdp = by_name[("shardkit.nn", "FullyShardedDataParallel")]
    assert "`shardkit.nn.FSDP`" in fsdp.aliases()
    assert "`shardkit.nn.data_parallel.FullyShardedDataParallel`" in fsdp.aliases()
    assert "`shardkit.nn.ShardedDDP`" in by_name[("shardkit.nn", "ShardedDataParallel")].aliases()
    assert by_name[("shardkit.optim", "OSS")].aliases() == []
    assert ("shardkit.optim.grad_scaler", "ShardedGradScaler") in by_name
    assert "`shardkit.nn.pipe.Pipe`" in by_name[("shardkit.nn", "Pipe")].aliases()
    assert (
        "`shardkit.testing.models.GPT` (deprecated)"
        in by_name[("shardkit.models", "GPT")].aliases()
    )
    # every canonical path is unique: one row per object
    assert len(by_name) == len(rows)
