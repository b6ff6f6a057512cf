"""Every ``shardkit.`` name the user docs (``docs/`` and ``README.md``) show in code
(inline backticks or fenced blocks) exists: ``shardkit.a.b.C`` imports as a module
prefix, then resolves attribute by attribute; ``from shardkit.x import A, B`` in a code
block imports each name. A renamed or removed name fails here with its file, line and
name, instead of a user's ``AttributeError``. Run by ``make lint``."""

from __future__ import annotations

import importlib
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^\s*(```|~~~)")
# an inline code span may run over a line break, not over a blank line
_INLINE = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)\1", re.DOTALL)
# not a path (shardkit/nn), a file (x/shardkit.py) or a format id (shardkit.universal/1)
_DOTTED = re.compile(r"(?<![\w./-])shardkit(?:\.[A-Za-z_]\w*)+(?![\w/])")
_FROM_IMPORT = re.compile(
    r"^\s*from\s+(shardkit(?:\.\w+)*)\s+import\s+(\([^)]*\)?|[^#\n]+)", re.MULTILINE
)


def user_docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def code_spans(text: str) -> list[tuple[int, str]]:
    """(first line number, code) for each fenced block and each inline code span."""
    spans: list[tuple[int, str]] = []
    prose: list[str] = []  # the text outside fenced blocks, line numbers kept
    fence: str | None = None
    block: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        opened = _FENCE.match(line)
        if fence is None and opened:
            fence, block = opened.group(1), []
        elif fence is not None and line.strip().startswith(fence):
            spans.append((number - len(block), "\n".join(block)))
            fence = None
        elif fence is not None:
            block.append(line)
        prose.append(line if fence is None and not opened else "")
    outside = "\n".join(prose)
    spans.extend(
        (outside.count("\n", 0, m.start(2)) + 1, m.group(2)) for m in _INLINE.finditer(outside)
    )
    return spans


def names_in(text: str) -> list[tuple[int, str]]:
    """(line, dotted name) for every ``shardkit.`` name shown in code in ``text``."""
    found: list[tuple[int, str]] = []
    for first, code in code_spans(text):
        for m in _DOTTED.finditer(code):
            found.append((first + code.count("\n", 0, m.start()), m.group(0)))
        for m in _FROM_IMPORT.finditer(code):
            number = first + code.count("\n", 0, m.start())
            for item in re.split(r"[,\n]", m.group(2).strip("() \t")):
                name = item.split(" as ")[0].strip()
                if re.fullmatch(r"[A-Za-z_]\w*", name):
                    found.append((number, f"{m.group(1)}.{name}"))
    return found


@cache
def why_unresolved(name: str) -> str | None:
    """None when ``name`` resolves; else what is missing."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj: object = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and module_name.startswith(error.name):
                continue  # not a module: try a shorter prefix
            return f"importing {module_name} fails: {error}"
        for i, attr in enumerate(parts[split:], split):
            if not hasattr(obj, attr):
                return f"{'.'.join(parts[:i])} has no attribute {attr!r}"
            obj = getattr(obj, attr)
        return None
    return "no such module"


def broken_names(text: str, where: str) -> list[str]:
    """``<where>:<line>: `<name>`: <what is missing>`` for each name that does not resolve."""
    return [
        f"{where}:{number}: `{name}`: {why}"
        for number, name in names_in(text)
        if (why := why_unresolved(name)) is not None
    ]


def test_every_shardkit_name_in_the_docs_resolves() -> None:
    docs = user_docs()
    assert len(docs) > 10
    shown = sum(len(names_in(p.read_text(encoding="utf-8"))) for p in docs)
    assert shown > 200, shown  # the scan finds the names the docs show
    problems = [
        problem
        for path in docs
        for problem in broken_names(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("Use `shardkit.nn.FSDP(model)`.", ["shardkit.nn.FSDP"]),
        ("`x` then `shardkit.optim.OSS.step`", ["shardkit.optim.OSS.step"]),
        ("in prose shardkit.nn.Nothing is not code", []),
        (
            "a span `over a\nline: shardkit.memory.trim_heap()` counts",
            ["shardkit.memory.trim_heap"],
        ),
        ("`not over\n\na blank line shardkit.memory`", []),
        ("see `shardkit/nn/wrap.py` and `examples/shardkit.py`", []),
        (
            "```python\nfrom shardkit.nn import (\n    FSDP,\n    wrap as w,\n)\n"
            "import shardkit.memory\n```",
            ["shardkit.memory", "shardkit.nn", "shardkit.nn.FSDP", "shardkit.nn.wrap"],
        ),
        (
            "format `shardkit.universal/1`, `python -m shardkit.checkpoint inspect`",
            ["shardkit.checkpoint"],
        ),
    ],
)
def test_the_scan_finds_names_in_code_only(text: str, names: list[str]) -> None:
    assert sorted(name for _, name in names_in(text)) == sorted(names)


def test_a_broken_name_is_reported_with_file_line_and_name() -> None:
    assert why_unresolved("shardkit.nn.FullyShardedDataParallel.state_dict") is None
    assert why_unresolved("shardkit.checkpoint.universal") is None
    assert why_unresolved("shardkit.nn.NoSuchWrapper") == (
        "shardkit.nn has no attribute 'NoSuchWrapper'"
    )
    assert why_unresolved("shardkit.nosuch.thing") == "shardkit has no attribute 'nosuch'"
    text = (
        "# t\n\nfine: `shardkit.memory`\n\n```python\nfrom shardkit.optim import OSS, Nope\n```\n"
    )
    assert broken_names(text, "docs/x.md") == [
        "docs/x.md:6: `shardkit.optim.Nope`: shardkit.optim has no attribute 'Nope'"
    ]
