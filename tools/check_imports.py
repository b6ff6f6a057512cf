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
- **Scripts use the public API.** ``benchmarks/`` and ``examples/`` are users: every
  ``shardkit`` import they make (function-local ones too) names a public module or a
  public name of one (the definition: ``tools/public_api.py``). ``ALLOWED_INTERNAL``
  lists the exceptions, each with its owner and reason.
- **Nothing imports through a shim.** A shim is a deprecated import path kept for
  users: a module whose ``__getattr__`` is ``shardkit.deprecation.moved_names(...)``
  (it warns once per process). No module of the three trees imports one; and a module
  whose docstring calls it a deprecated alias / location / old import path must be such
  a shim (so it warns).
- **Long modules say why.** A module of ``shardkit/`` over ``LONG_MODULE_LINES`` lines
  has a line starting ``Why this module is long:`` in its docstring, with the reason.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from import_graph import Edge, build_graph, collect_modules, strongly_connected
from public_api import PublicAPI, public_api, shim_targets

ROOT = Path(__file__).resolve().parents[1]
TREES = ("shardkit", "benchmarks", "examples")
SCRIPTS = ("benchmarks", "examples")


@dataclass(frozen=True)
class AllowedCycle:
    """A cycle known today: exactly these modules, removed by ``owner``."""

    modules: frozenset[str]
    owner: str
    reason: str


# Each entry is a cycle that exists today and is being removed; the check fails if the
# cycle grows (another module joins it), splits or disappears (then delete the entry).
ALLOWED_CYCLES: tuple[AllowedCycle, ...] = ()


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


@cache
def repository_graph() -> tuple[dict[str, Path], list[Edge]]:
    """The modules of ``TREES`` and their import edges, read once per run."""
    modules = collect_modules(ROOT, TREES)
    return modules, build_graph(modules)


def check_cycles() -> list[str]:
    return cycle_problems(*repository_graph())


# (script file, internal module) pairs allowed, with the owner and the reason. An entry
# that matches no import fails, so the list only shrinks.
ALLOWED_INTERNAL: dict[tuple[str, str], str] = {
    # benchmarks that measure an internal on purpose
    ("benchmarks/runners.py", "shardkit.memory"): "memory._count_new: the torch DDP / FSDP2 "
    "runners count their bytes with the exact storage-dedup rule of model_state_bytes, "
    "which needs a module and an optimizer the runners do not have in that form",
    ("benchmarks/step_floor.py", "shardkit.nn.data_parallel.fully_sharded.collectives"): (
        "the floor of one FSDP step is the time of FSDP's own all_gather_flat / "
        "reduce_scatter_flat; the policies part owns collectives.py"
    ),
    ("benchmarks/two_nodes/rows.py", "shardkit.distributed.hybrid"): "hybrid_groups for "
    "the HSDP rows; the descriptor part owns distributed/hybrid.py and the compose part "
    "builds HSDP from the mesh: import it from there when it lands",
    # the main job's checkpoint files: the manifest's names and atomic writes
    ("examples/gpt_checkpoint.py", "shardkit.checkpoint.manifest"): "compose: the "
    "manifest module and its errors; moves to save_universal / load_universal",
    ("examples/train_gpt.py", "shardkit.checkpoint.atomic"): "compose: atomic_save, "
    "atomic_write (public as shardkit.checkpoint.atomic_save / atomic_write)",
    ("examples/train_gpt.py", "shardkit.checkpoint.manifest"): "compose: MANIFEST_NAME",
}


def internal_imports(path: Path, api: PublicAPI, root: Path = ROOT) -> list[tuple[int, str, str]]:
    """(line, statement, internal target) of each ``shardkit`` import in ``path`` that
    is not public: ``import M`` of an internal module, ``from M import n`` where ``n``
    is not a public name of ``M`` (nor ``M.n`` a public module)."""
    source = path.read_text()
    lines = source.splitlines()
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            bad = [
                a.name
                for a in node.names
                if a.name.split(".")[0] == "shardkit" and not api.is_public_module(a.name)
            ]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] != "shardkit":
                continue
            bad = [
                f"{node.module}.{a.name}"
                for a in node.names
                if not api.is_public(node.module, a.name)
            ]
        else:
            continue
        found.extend((node.lineno, lines[node.lineno - 1].strip(), target) for target in bad)
    return found


def public_api_problems(
    scripts: dict[str, Path],
    api: PublicAPI,
    allowed: dict[tuple[str, str], str],
    root: Path = ROOT,
) -> list[str]:
    """One problem per internal import of a script not in ``allowed``, and per stale entry."""
    problems: list[str] = []
    used: set[tuple[str, str]] = set()
    for path in scripts.values():
        shown = str(path.relative_to(root))
        statements: dict[tuple[int, str], list[str]] = {}
        for line, text, target in internal_imports(path, api, root):
            module = target if api.is_public_module(target) else target.rpartition(".")[0]
            for key in ((shown, target), (shown, module)):
                if key in allowed:
                    used.add(key)
                    break
            else:
                statements.setdefault((line, text), []).append(target)
        for (line, text), targets in statements.items():
            problems.append(
                f"{shown}:{line}: {text}\n  {', '.join(targets)}: not shardkit's public API "
                "(tools/public_api.py): import the name from the public package that "
                "exports it (see docs/api/index.md), or, if the script truly needs an "
                "internal, add (file, module) to ALLOWED_INTERNAL with the reason"
            )
    for key in sorted(set(allowed) - used):
        problems.append(
            f"ALLOWED_INTERNAL entry {key} matches no import today: delete it "
            "from tools/check_imports.py"
        )
    return problems


def library_import_problems(
    library: set[str], scripts: set[str], edges: list[Edge], root: Path = ROOT
) -> list[str]:
    """Imports of a script module (``scripts``) by a library module (``library``)."""
    return [
        f"{edge.where(root)}\n  the library imports the script module {edge.dst}: scripts "
        "use shardkit, never the reverse; move what both need into shardkit"
        for edge in edges
        if edge.src in library and edge.dst in scripts
    ]


def check_public_api() -> list[str]:
    modules, edges = repository_graph()
    library = {name for name in modules if name.split(".")[0] == "shardkit"}
    scripts = collect_modules(ROOT, SCRIPTS)
    api = public_api({name: modules[name] for name in library}, ROOT / "docs" / "api")
    return public_api_problems(scripts, api, ALLOWED_INTERNAL) + library_import_problems(
        library, set(scripts), edges
    )


_SHIM_DOC = re.compile(r"deprecated (?:alias|location|import path)|old import path", re.IGNORECASE)


def is_shim(path: Path) -> bool:
    """The module sets ``__getattr__ = moved_names(__name__, {...})`` at top level."""
    return shim_targets(path) is not None


def shim_problems(modules: dict[str, Path], edges: list[Edge], root: Path = ROOT) -> list[str]:
    """Imports of a shim, and modules documented as deprecated paths that are no shim."""
    shims = {name for name, path in modules.items() if is_shim(path)}
    problems = [
        f"{edge.where(root)}\n  {edge.dst} is a deprecated shim (it warns users): import "
        "the name from the canonical path its docstring names (docs/api/index.md)"
        for edge in edges
        if edge.dst in shims
    ]
    for name, path in sorted(modules.items()):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = doc.split("\n\n")[0]
        if name not in shims and _SHIM_DOC.search(first):
            problems.append(
                f"{path.relative_to(root)}: its docstring calls it a deprecated path, but "
                "it is no shim: make its names resolve through "
                "`__getattr__ = shardkit.deprecation.moved_names(__name__, {...})`, so "
                "users are warned once"
            )
    return problems


def check_shims() -> list[str]:
    return shim_problems(*repository_graph())


LONG_MODULE_LINES = 500
_LONG_REASON = re.compile(r"^Why this module is long: \S", re.MULTILINE)


def long_module_problems(modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Modules over ``LONG_MODULE_LINES`` lines whose docstring gives no reason."""
    problems: list[str] = []
    for _, path in sorted(modules.items()):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines <= LONG_MODULE_LINES:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if not _LONG_REASON.search(doc):
            problems.append(
                f"{path.relative_to(root)}: {lines} lines (over {LONG_MODULE_LINES}) and its "
                "docstring gives no reason: split it by concept, or add a line "
                "`Why this module is long: <the reason>` to the module docstring"
            )
    return problems


def check_long_modules() -> list[str]:
    modules, _ = repository_graph()
    return long_module_problems({n: p for n, p in modules.items() if n.startswith("shardkit")})


CHECKS: dict[str, Callable[[], list[str]]] = {
    "cycles": check_cycles,
    "public-api": check_public_api,
    "shims": check_shims,
    "long-modules": check_long_modules,
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
