"""benchmarks.fairscale_suite on a miniature FairScale checkout (no FairScale needed):
``fairscale.*`` imports resolve to shardkit, in spawned ranks too; a missing name fails
only the test that uses it; the counts are printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

HELPERS = """
class DummyProcessGroup:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size
    def rank(self):
        return self._rank
    def size(self):
        return self._size
"""

TESTS = """
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fairscale.fair_dev.testing.testing import DummyProcessGroup
from fairscale.nn import FullyShardedDataParallel as FSDP
from fairscale.nn.misc import FlattenParamsWrapper
from fairscale.nn.model_parallel import initialize_model_parallel
from fairscale.optim import OSS
import shardkit


def test_alias_is_shardkit():
    assert FSDP is shardkit.nn.FullyShardedDataParallel
    assert OSS is shardkit.optim.OSS
    layer = FSDP(torch.nn.Linear(2, 2), process_group=DummyProcessGroup(0, 1))
    assert layer(torch.ones(1, 2)).shape == (1, 2)


def test_missing_name_fails_here_only():
    FlattenParamsWrapper(torch.nn.Linear(2, 2))


def _rank(rank, world_size, path):
    dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=world_size)
    from fairscale.optim import OSS as SpawnedOSS  # imported in the spawned process

    assert SpawnedOSS.__module__ == "shardkit.optim.oss"
    initialize_model_parallel(1, world_size)
    dist.destroy_process_group()


def test_spawned_ranks_see_the_alias():
    mp.spawn(_rank, args=(2, tempfile.mkstemp()[1]), nprocs=2, join=True)


@pytest.mark.skip("skipped on purpose")
def test_skipped():
    pass
"""


def test_suite_runs_a_checkout_through_the_alias(tmp_path: Path) -> None:
    testing = tmp_path / "fairscale" / "fair_dev" / "testing"
    testing.mkdir(parents=True)
    for folder in (testing.parent, testing):
        (folder / "__init__.py").write_text("")
    (testing / "testing.py").write_text(HELPERS)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / "test_mini.py").write_text(TESTS)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.fairscale_suite", str(tmp_path)]
        + ["--files", "tests/test_mini.py", "--out", str(tmp_path / "out.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "FAILED   tests/test_mini.py::test_missing_name_fails_here_only" in lines
    assert "SKIPPED  tests/test_mini.py::test_skipped" in lines
    assert lines[-1].startswith(
        "fairscale suite on shardkit: 2 of 3 run passed (4 collected, 1 skipped)"
    )
    assert "fairscale.nn.misc.FlattenParamsWrapper has no shardkit equivalent" in done.stdout
