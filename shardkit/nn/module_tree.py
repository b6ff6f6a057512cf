"""Walking a module tree without entering wrapped units (knows no wrapper class).

A *unit* is whatever the caller's ``is_unit`` predicate says: an FSDP unit for FSDP's
own parameter collection, any wrapper instance (or a module marked as a wrapper unit)
for :mod:`shardkit.nn.wrap`. The walk is generic so that neither needs the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import nn

__all__ = ["walk_unit"]


def walk_unit(
    module: nn.Module, is_unit: Callable[[nn.Module], bool], prefix: str = ""
) -> Iterator[tuple[str, nn.Module]]:
    """``(prefix, module)`` for ``module`` and its submodules, not entering nested units.

    ``module`` itself is always yielded (even if ``is_unit(module)``); a child for which
    ``is_unit`` is True is neither yielded nor entered. Each module is yielded once (a
    submodule registered twice appears under its first name), in ``named_modules``
    order. The prefix ends with a dot (``"blocks.0."``), ready for an attribute name:
    ``f"{prefix}{attr}"`` is the dotted name of a parameter registered on that module.

    Args:
        module: the root of the walk.
        is_unit: True for a module that starts another unit (not entered).
        prefix: the root's prefix; default ``""``.
    """
    seen: set[int] = set()
    stack = [(prefix, module)]
    while stack:
        name, mod = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        yield name, mod
        children = [(n, c) for n, c in mod._modules.items() if c is not None]
        for child_name, child in reversed(children):
            if not is_unit(child):
                stack.append((f"{name}{child_name}.", child))
