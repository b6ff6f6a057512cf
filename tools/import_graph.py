"""The import graph of a source tree, read from the AST (nothing is imported).

Every ``import`` and ``from ... import`` statement counts, wherever it stands: at
module level, inside a function or method, under ``if TYPE_CHECKING:``, inside
``try``. A function-local import runs later than a module-level one, but it still
makes the two modules depend on each other, so a cycle it closes is a cycle.

How a statement becomes edges (``src -> dst``, both module names):

- ``import a.b.c`` -> ``a.b.c`` (the longest prefix that is a module of the tree).
- ``from a.b import x`` -> ``a.b.x`` when that is a module (a submodule import),
  else ``a.b`` (a name from the package ``__init__`` or module ``a.b``).
- Relative imports are resolved against the importing module's package.
- Imports of modules outside the tree (torch, the standard library) are dropped.
- The parent packages that Python runs on the way to a module (``a/__init__.py`` and
  ``a/b/__init__.py`` for ``import a.b.c``) are not edges. So a package ``__init__``
  that imports its own submodules is no cycle by itself, but a submodule that imports
  a name from its package's ``__init__`` (``from a.b import X``), where that
  ``__init__`` imports a sibling that imports the submodule back, is one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Edge:
    """One import statement's dependency: ``src`` imports ``dst`` at ``path:line``."""

    src: str
    dst: str
    path: Path
    line: int
    text: str  # the import statement, first line, stripped

    def where(self, root: Path) -> str:
        try:
            shown = self.path.relative_to(root)
        except ValueError:
            shown = self.path
        return f"{shown}:{self.line}: {self.text}"


def module_name(path: Path, root: Path) -> str:
    """``root/a/b/c.py`` -> ``a.b.c``; ``root/a/b/__init__.py`` -> ``a.b``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def collect_modules(root: Path, tops: Iterable[str]) -> dict[str, Path]:
    """Every module under ``root/<top>`` for each top (a package directory or a
    directory of scripts), by dotted name. A script directory without ``__init__.py``
    (``examples/``) gives its files as top-level modules (``train_gpt``), as Python
    sees them when the script runs from that directory."""
    modules: dict[str, Path] = {}
    for top in tops:
        base = root / top
        files = [base] if base.suffix == ".py" else sorted(base.rglob("*.py"))
        is_package = (base / "__init__.py").exists()
        for path in files:
            if is_package or base.suffix == ".py":
                modules[module_name(path, root)] = path
            else:
                modules[module_name(path, base)] = path
    return modules


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve_relative(src: str, src_path: Path, level: int, module: str | None) -> str:
    package = src if _is_package(src_path) else src.rpartition(".")[0]
    parts = package.split(".") if package else []
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    base = ".".join(parts)
    if module:
        return f"{base}.{module}" if base else module
    return base


def _longest_module(name: str, modules: dict[str, Path]) -> str | None:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imports_of(src: str, path: Path, modules: dict[str, Path]) -> Iterator[Edge]:
    """The edges of one module's import statements, in source order."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source, filename=str(path))
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            for alias in node.names:
                found = _longest_module(alias.name, modules)
                if found is not None:
                    targets.append(found)
        elif isinstance(node, ast.ImportFrom):
            base = (
                _resolve_relative(src, path, node.level, node.module)
                if node.level
                else (node.module or "")
            )
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    targets.append(sub)
                else:
                    found = _longest_module(base, modules)
                    if found is not None:
                        targets.append(found)
        else:
            continue
        text = lines[node.lineno - 1].strip()
        for dst in dict.fromkeys(targets):
            if dst != src:
                yield Edge(src, dst, path, node.lineno, text)


def build_graph(modules: dict[str, Path]) -> list[Edge]:
    """Every edge of every module, sorted by file and line."""
    edges = [edge for name, path in modules.items() for edge in imports_of(name, path, modules)]
    return sorted(edges, key=lambda e: (str(e.path), e.line, e.dst))


def strongly_connected(nodes: Iterable[str], edges: Iterable[Edge]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components with more than one module (a
    module importing itself is no edge here), each sorted, the list sorted."""
    graph: dict[str, list[str]] = {node: [] for node in nodes}
    for edge in edges:
        graph.setdefault(edge.src, []).append(edge.dst)
        graph.setdefault(edge.dst, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)
