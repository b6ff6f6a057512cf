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
