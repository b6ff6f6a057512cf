"""Shims keeping a moved name importable where it was: warn once, then forward.

An old import path users may still type (``shardkit.checkpoint.fsdp``,
``shardkit.testing.models``) stays a module with no code of its own: its names resolve
on first access to the canonical module, through :func:`moved_names`. The first access
in a process raises one ``DeprecationWarning`` naming the canonical path; later accesses
are silent. The shim imports its target lazily, when a user touches a name, so an old
path in a lower layer (``shardkit.checkpoint``) imports nothing from an upper one
(``shardkit.nn``) when the package loads: this is a deprecation shim resolving a user's
name, not a function-local import dodging a cycle (nothing in shardkit imports a
shim; ``tools/check_imports.py`` checks it).

Standard library only, so any layer can use it.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping

__all__ = ["moved_names"]

_warned: set[str] = set()


def moved_names(old_module: str, targets: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for the deprecated module ``old_module``.

    Example (the whole body of a shim module, after its docstring)::

        from shardkit.deprecation import moved_names

        __all__ = ["save_fsdp_sharded"]
        __getattr__ = moved_names(__name__, {"save_fsdp_sharded": "shardkit.nn"})

    Args:
        old_module: the deprecated module's dotted name (its ``__name__``).
        targets: each name the old path still serves -> the canonical module to import
            it from (``"shardkit.nn.data_parallel.fully_sharded"``); the object is
            ``getattr(import_module(target), name)``, the same object, not a copy.

    Returns:
        ``__getattr__(name)``: the object, after one ``DeprecationWarning`` per process
        and old module ("``old_module`` is a deprecated import path: write
        ``from target import name``").

    Raises:
        AttributeError: (from the returned function) for a name not in ``targets``,
            naming the module and listing the names it serves.
    """
    served = dict(targets)

    def __getattr__(name: str) -> object:
        target = served.get(name)
        if target is None:
            raise AttributeError(
                f"module {old_module!r} has no attribute {name!r}; this deprecated path "
                f"serves only {sorted(served)}"
            )
        if old_module not in _warned:
            _warned.add(old_module)
            warnings.warn(
                f"{old_module} is a deprecated import path: write "
                f"`from {target} import {name}` (the old path will be removed)",
                DeprecationWarning,
                stacklevel=2,
            )
        return getattr(importlib.import_module(target), name)

    return __getattr__
