"""shardkit's public API, defined from the source and the API docs (read, never imported).

A **public module** is one of

- the packages in ``PUBLIC_PACKAGES`` (the ones a user imports from), or
- a module the API docs (``docs/api/*.md``) render whole (``::: shardkit.x.y``), or
- the module of an object the API docs render (``::: shardkit.x.y.Name``).

A **public name** is a name in a public module's ``__all__`` (every name it binds at
top level without a leading underscore when it has no ``__all__``), or the object a
``:::`` directive names, or a public module itself (``from shardkit.nn import pipe``).
Everything else (``shardkit.checkpoint.manifest``, ``fully_sharded.unit``, ...) is
internal: its names may move between releases without a deprecation.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

PUBLIC_PACKAGES: tuple[str, ...] = (
    "shardkit",
    "shardkit.nn",
    "shardkit.nn.data_parallel",  # FairScale's fairscale.nn.data_parallel
    "shardkit.nn.data_parallel.fully_sharded",  # MixedPrecision, DiskOffload, ...
    "shardkit.nn.offload",
    "shardkit.nn.pipe",
    "shardkit.nn.moe",
    "shardkit.nn.context_parallel",
    "shardkit.nn.tensor_parallel",
    "shardkit.nn.wrap",
    "shardkit.nn.checkpoint",
    "shardkit.optim",
    "shardkit.optim.grad_scaler",  # FairScale's fairscale.optim.grad_scaler
    "shardkit.distributed",
    "shardkit.distributed.compression",
    "shardkit.distributed.mesh",
    "shardkit.distributed.mpu",
    "shardkit.checkpoint",
    "shardkit.checkpoint.universal",
    "shardkit.models",
    "shardkit.memory",
    "shardkit.testing",
    "shardkit.extras",
    "shardkit.integrations.hf",
    "shardkit.compose",
)

_DIRECTIVE = re.compile(r"^:::\s+(shardkit(?:\.\w+)+|shardkit)\s*$", re.MULTILINE)


def exported_names(path: Path) -> frozenset[str]:
    """A module's ``__all__`` (a literal list or tuple of strings), else every name it
    binds at top level (def, class, assignment, import) without a leading underscore."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bound: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id == "__all__":
                    value = node.value
                    if isinstance(value, ast.List | ast.Tuple):
                        return frozenset(
                            e.value
                            for e in value.elts
                            if isinstance(e, ast.Constant) and isinstance(e.value, str)
                        )
                if isinstance(target, ast.Name):
                    bound.add(target.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                bound.add((alias.asname or alias.name).split(".")[0])
    return frozenset(name for name in bound if not name.startswith("_"))


def documented_paths(docs_api: Path) -> list[str]:
    """Every ``::: shardkit....`` target of the API pages, in page order."""
    found: list[str] = []
    for page in sorted(docs_api.glob("*.md")):
        found.extend(_DIRECTIVE.findall(page.read_text()))
    return found


@dataclass
class PublicAPI:
    """The public modules and, per module, the names importable from it."""

    names: dict[str, set[str]] = field(default_factory=dict)

    def is_public_module(self, module: str) -> bool:
        return module in self.names

    def is_public(self, module: str, name: str) -> bool:
        """``from module import name`` uses the public API."""
        return name in self.names.get(module, set()) or f"{module}.{name}" in self.names


def public_api(modules: dict[str, Path], docs_api: Path) -> PublicAPI:
    """The public API of the tree ``modules`` (dotted name -> file) as defined above."""
    api = PublicAPI()
    for package in PUBLIC_PACKAGES:
        if package in modules:
            api.names.setdefault(package, set()).update(exported_names(modules[package]))
    for target in documented_paths(docs_api):
        if target in modules:
            api.names.setdefault(target, set()).update(exported_names(modules[target]))
        else:
            owner, _, name = target.rpartition(".")
            if owner in modules:
                api.names.setdefault(owner, set()).add(name)
    return api


# [Note: where a name comes from, statically]
# The table of aliases groups the paths that reach the same object. Importing shardkit
# to compare objects costs seconds (torch, transformers); following the bindings in
# the source costs milliseconds. A module's top-level binding of a name (the last one,
# searching into top-level ``if`` / ``try`` blocks, as Python runs them) is one of:
# a def or class, or an assignment of anything but a bare name: the name originates
# here; ``X = Y``: the origin of ``Y`` here (``FSDP = FullyShardedDataParallel``);
# ``from M import Y as X``: the origin of ``Y`` in ``M`` when ``M`` binds it (a package
# ``__init__`` rebinding ``wrap``), else the submodule ``M.Y`` (no origin: a module);
# ``import M``: a module.
Origin = tuple[str, str]


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    flat: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            flat += _top_level(node.body) + _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            flat += _top_level(node.body)
            for handler in node.handlers:
                flat += _top_level(handler.body)
            flat += _top_level(node.orelse) + _top_level(node.finalbody)
        else:
            flat.append(node)
    return flat


def _binding(tree: ast.Module, name: str) -> ast.stmt | ast.alias | None:
    """The last top-level statement binding ``name`` (an ``ast.alias`` for imports)."""
    found: ast.stmt | ast.alias | None = None
    for node in _top_level(tree.body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == name:
                found = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                if bound == name:
                    found = alias
    return found


class Resolver:
    """Origins of names in the modules of one tree, read from their source (cached)."""

    def __init__(self, modules: dict[str, Path]) -> None:
        self.modules = modules
        self._trees: dict[str, ast.Module] = {}
        self._parents: dict[int, ast.ImportFrom] = {}

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            tree = ast.parse(self.modules[module].read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    for alias in node.names:
                        self._parents[id(alias)] = node
            self._trees[module] = tree
        return self._trees[module]

    def _base(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = (
            module if self.modules[module].name == "__init__.py" else module.rpartition(".")[0]
        )
        parts = package.split(".")
        parts = parts[: len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    def origin(self, module: str, name: str, depth: int = 0) -> Origin | None:
        """Where ``module.name`` is defined; None when it is a module. Names bound
        outside the tree (``torch``) originate where they were imported from."""
        if module not in self.modules or depth > 50:
            return (module, name)
        node = _binding(self.tree(module), name)
        if node is None:
            return None if f"{module}.{name}" in self.modules else (module, name)
        if isinstance(node, ast.alias):
            parent = self._parents.get(id(node))
            if parent is None:  # import a.b [as c]: a module
                return None
            base = self._base(module, parent)
            if base in self.modules and _binding(self.tree(base), node.name) is not None:
                return self.origin(base, node.name, depth + 1)
            if f"{base}.{node.name}" in self.modules:
                return None
            return self.origin(base, node.name, depth + 1)
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Name):
            return self.origin(module, node.value.id, depth + 1)
        return (module, name)


def shim_targets(path: Path) -> dict[str, str] | None:
    """A shim's ``{name: canonical module}``: the literal dict (or the name of a
    module-level literal dict) given to ``__getattr__ = moved_names(__name__, ...)``;
    None when the module is no shim."""
    tree = ast.parse(path.read_text(), filename=str(path))
    dicts: dict[str, ast.expr] = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target = node.targets[0]
        if not isinstance(target, ast.Name):
            continue
        dicts[target.id] = node.value
        call = node.value
        if (
            target.id == "__getattr__"
            and isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id == "moved_names"
            and len(call.args) == 2
        ):
            arg = call.args[1]
            value = dicts.get(arg.id) if isinstance(arg, ast.Name) else arg
            pairs = (
                list(zip(value.keys, value.values, strict=True))
                if isinstance(value, ast.Dict)
                else []
            )
            found = {
                k.value: v.value
                for k, v in pairs
                if isinstance(k, ast.Constant)
                and isinstance(k.value, str)
                and isinstance(v, ast.Constant)
                and isinstance(v.value, str)
            }
            if not isinstance(value, ast.Dict) or len(found) != len(pairs):
                raise ValueError(
                    f"{path}: moved_names' targets must be a literal dict of strings "
                    "(or the name of one), so the tools can read them without importing"
                )
            return found
    return None
