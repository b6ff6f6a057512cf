"""Import discipline that import-linter cannot express, checked by ``make lint``.

Run from the repository root: ``python tools/check_imports.py`` (no argument: every
check; it reads source files only and imports nothing, well under a second). It exits
1 and prints each problem with its file, line and fix.

- **No import cycles** in ``shardkit/``, ``benchmarks/`` and ``examples/``, counting
  function-local and ``TYPE_CHECKING`` imports (how an import becomes an edge:
  ``tools/import_graph.py``). A cycle is a strongly connected component of more than
  one module; it is reported with every import line inside it. ``ALLOWED_CYCLES``
  lists the cycles known today, each with the part of the work that removes it; an
  entry that no longer matches a cycle fails too, so the list only shrinks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from import_graph import Edge, build_graph, collect_modules, strongly_connected

ROOT = Path(__file__).resolve().parents[1]
TREES = ("shardkit", "benchmarks", "examples")


@dataclass(frozen=True)
class AllowedCycle:
    """A cycle known today: exactly these modules, removed by ``owner``."""

    modules: frozenset[str]
    owner: str
    reason: str


# Each entry is a cycle that exists today and is being removed; the check fails if the
# cycle grows (another module joins it), splits or disappears (then delete the entry).
ALLOWED_CYCLES: tuple[AllowedCycle, ...] = (
    AllowedCycle(
        frozenset(
            {
                "shardkit.checkpoint.universal.adapters",
                "shardkit.checkpoint.universal.layout",
                "shardkit.checkpoint.universal.tensor_views",
            }
        ),
        owner="descriptor (the shard descriptor moves to shardkit.distributed)",
        reason="layout.layout_of imports adapters.PlainLayout inside the function; "
        "adapters and tensor_views import layout at module level",
    ),
)


def cycle_problems(
    modules: dict[str, Path],
    edges: list[Edge],
    allowed: tuple[AllowedCycle, ...] = ALLOWED_CYCLES,
    root: Path = ROOT,
) -> list[str]:
    """One problem per cycle not in ``allowed`` and per ``allowed`` entry matching no cycle."""
    problems: list[str] = []
    components = [frozenset(c) for c in strongly_connected(modules, edges)]
    known = {entry.modules for entry in allowed}
    for component in components:
        if component in known:
            continue
        lines = [
            f"    {edge.src} -> {edge.dst}   {edge.where(root)}"
            for edge in edges
            if edge.src in component and edge.dst in component
        ]
        problems.append(
            f"import cycle between {len(component)} modules: {', '.join(sorted(component))}\n"
            + "\n".join(lines)
            + "\n  fix: move what both sides need into a lower module that imports neither "
            "(a function-local import is still an edge of the cycle)"
        )
    for entry in allowed:
        if entry.modules not in components:
            problems.append(
                f"ALLOWED_CYCLES entry ({entry.owner}) matches no cycle today: "
                f"{', '.join(sorted(entry.modules))}; delete it from tools/check_imports.py "
                "(or, if the cycle changed shape, it is a new cycle: fix it)"
            )
    return problems


def check_cycles() -> list[str]:
    modules = collect_modules(ROOT, TREES)
    return cycle_problems(modules, build_graph(modules))


CHECKS: dict[str, Callable[[], list[str]]] = {
    "cycles": check_cycles,
}


def main(argv: list[str]) -> int:
    names = argv or list(CHECKS)
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        print(f"unknown check(s) {unknown}; the checks are {list(CHECKS)}", file=sys.stderr)
        return 2
    failed = 0
    for name in names:
        problems = CHECKS[name]()
        for problem in problems:
            print(f"[{name}] {problem}", file=sys.stderr)
        failed += len(problems)
    if failed:
        print(f"check_imports: {failed} problem(s)", file=sys.stderr)
        return 1
    print(f"check_imports: {', '.join(names)}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
