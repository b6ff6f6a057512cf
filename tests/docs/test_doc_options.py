"""Each wrapper's guide lists the constructor's arguments as its code has them: the
options table (``| option | default | meaning |`` or ``| argument | ...``) names every
argument and no other, and a signature line ``Wrapper(a, b=1, ...)`` shown above it has
the code's argument names. A new argument without a row, or a row for a removed one,
fails here with the page and the names."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardkit.compose import parallelize_model
from shardkit.nn import FullyShardedDataParallel, OffloadModel, Pipe, ShardedDataParallel
from shardkit.nn.moe import MoE
from shardkit.optim import OSS

ROOT = Path(__file__).resolve().parents[2]

# (page, the documented callable, arguments the table need not list: the wrapped object)
PAGES: list[tuple[str, Callable[..., Any], set[str]]] = [
    ("docs/fsdp.md", FullyShardedDataParallel, {"module"}),
    ("docs/oss.md", OSS, set()),
    ("docs/sharded_ddp.md", ShardedDataParallel, {"module"}),
    ("docs/offload.md", OffloadModel, set()),
    ("docs/pipe.md", Pipe, set()),
    ("docs/moe.md", MoE, set()),
    ("docs/compose.md", parallelize_model, set()),
]
_HEADER = re.compile(r"^\| (?:option|argument) \|", re.MULTILINE)
_ROW_NAME = re.compile(r"^\| `(\*\*)?(\w+)` \|")


def code_arguments(func: Callable[..., Any]) -> set[str]:
    """The argument names of ``func`` (``__init__`` for a class), ``self`` left out."""
    target = func.__init__ if inspect.isclass(func) else func  # type: ignore[misc]
    return {name for name in inspect.signature(target).parameters if name != "self"}


def table_arguments(text: str) -> list[str]:
    """The names in the first column of the page's options table."""
    header = _HEADER.search(text)
    assert header is not None, "no `| option |` / `| argument |` table"
    names = []
    for line in text[header.start() :].splitlines()[2:]:
        if not line.startswith("|"):
            break
        match = _ROW_NAME.match(line)
        assert match is not None, f"a row of the options table names no argument: {line!r}"
        names.append(match.group(2))
    return names


def signature_line_arguments(text: str, name: str) -> set[str] | None:
    """The argument names of a ``Name(...)`` line shown in backticks, if the page has one."""
    match = re.search(rf"^`{name}\((.*)\)`$", text, re.MULTILINE)
    if match is None:
        return None
    return {m.group(1) for m in re.finditer(r"(?:^|,)\s*(?:\*\*)?(\w+)", match.group(1))}


@pytest.mark.parametrize(("page", "func", "exempt"), PAGES, ids=[p for p, _, _ in PAGES])
def test_options_table_matches_the_signature(
    page: str, func: Callable[..., Any], exempt: set[str]
) -> None:
    text = (ROOT / page).read_text(encoding="utf-8")
    code = code_arguments(func)
    rows = table_arguments(text)
    assert not set(rows) - code, f"{page}: rows for arguments the code lacks: {set(rows) - code}"
    missing = code - set(rows) - exempt
    assert not missing, f"{page}: arguments without a row: {sorted(missing)}"
    shown = signature_line_arguments(text, func.__name__)
    if shown is not None:
        assert shown == code, f"{page}: `{func.__name__}(...)` line: {shown ^ code} differ"


def test_the_check_sees_a_missing_row() -> None:
    text = "| option | default | meaning |\n|---|---|---|\n| `a` | 1 | x |\n\nprose\n"
    assert table_arguments(text) == ["a"]
    assert signature_line_arguments("`F(a, b=1, *, c=None, **kw)`\n", "F") == {
        "a",
        "b",
        "c",
        "kw",
    }
