"""The examples in docs/getting_started.md run, and are the files in examples/docs/.

Each ``examples/docs/<name>.py`` is shown verbatim in the getting-started page (a
``python title="examples/docs/<name>.py"`` block) and has a ``main()`` that the
``__main__`` block calls under torchrun. Here every ``main()`` runs on the 2 ranks of
the shared pool (one ``pool.run``): the loss must go down, and the model every rank
ends with must be the same (the wrapper kept the replicas in sync).
"""

from __future__ import annotations

import re
import runpy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardkit.testing import RankPool, assert_state_dicts_close

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "docs"
PAGE = ROOT / "docs" / "getting_started.md"
NAMES = ("oss", "sharded_ddp", "fsdp", "pipe", "offload")
_BLOCK = re.compile(r'```python title="(examples/docs/\w+\.py)"\n(.*?)```', re.DOTALL)


def run_examples(names: tuple[str, ...]) -> dict[str, Any]:
    """On every rank: each example's ``main()``, as ``torchrun`` would run it."""
    return {
        name: runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="docs_example")["main"]()
        for name in names
    }


@pytest.fixture(scope="module")
def results(rank_pool: Callable[[int], RankPool]) -> list[dict[str, Any]]:
    return rank_pool(2).run(run_examples, NAMES)


def test_page_shows_each_example_file_verbatim() -> None:
    shown = dict(_BLOCK.findall(PAGE.read_text()))
    assert sorted(shown) == sorted(f"examples/docs/{n}.py" for n in NAMES)
    for path, code in shown.items():
        assert code == (ROOT / path).read_text(), f"{path} differs from its block in {PAGE.name}"


@pytest.mark.parametrize("name", NAMES)
def test_example_learns_and_ranks_agree(results: list[dict[str, Any]], name: str) -> None:
    per_rank = [r[name] for r in results]
    losses = [loss for r_losses, _ in per_rank for loss in r_losses]  # pipe: last stage only
    assert losses, f"{name}: no loss reported"
    for r_losses, _ in per_rank:
        if r_losses:
            k = max(1, len(r_losses) // 4)
            first, last = sum(r_losses[:k]) / k, sum(r_losses[-k:]) / k
            assert last < 0.8 * first, f"{name}: loss {first:.3f} -> {last:.3f}"
    states = [state for _, state in per_rank if state is not None]
    assert states, f"{name}: no model state returned"
    if name == "pipe":  # consolidated on rank 0: the plain model's keys
        assert sorted(states[0]) == sorted(
            f"{i}.{p}" for i in (0, 2, 3) for p in ("weight", "bias")
        )
    for state in states[1:]:
        assert_state_dicts_close(state, states[0], atol=0.0)
