"""Nesting wrappers (FSDP or any other) around submodules, by hand or by policy.

Usage (FairScale's API)::

    with enable_wrap(wrapper_cls=FullyShardedDataParallel, reshard_after_forward=True):
        model.head = wrap(model.head)                  # one module, by hand
        model = auto_wrap(model, transformer_auto_wrap_policy({Block}))  # by policy
    model = FullyShardedDataParallel(model)            # the root unit

A policy is called as ``policy(module, recurse, unwrapped_params, module_is_root)``:
with ``recurse=True`` it says whether to look into ``module``'s children, with
``recurse=False`` whether to wrap ``module`` itself, ``unwrapped_params`` being its
parameter elements not already inside a wrapped child. :func:`auto_wrap` wraps
inside-out (children first), as FSDP requires.

[Note: tied parameters]
A parameter registered in two modules (an LM head tied to the token embedding) must
stay in one FSDP unit. :func:`auto_wrap` never wraps a module holding a parameter that
is also registered outside it, so tied parameters stay in the unit of their common
ancestor (the root for GPT's ``wte`` / ``lm_head``), whatever the policy says.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn

from shardkit.nn.data_parallel.fully_sharded.sharing import walk_unit

__all__ = [
    "AutoWrapPolicy",
    "auto_wrap",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "enable_wrap",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]

AutoWrapPolicy = Callable[..., bool]

_FORCE_LEAF_MODULES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)
_EXCLUDE_WRAP_MODULES: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.ModuleDict)


class _WrapContext:
    """The active ``enable_wrap`` configuration (None outside the context)."""

    wrapper_cls: Callable[..., nn.Module] | None = None
    kwargs: dict[str, Any] = {}  # noqa: RUF012 (replaced, never mutated)
    policy: AutoWrapPolicy | None = None


def default_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    unwrapped_params: int,
    module_is_root: bool = False,
    min_num_params: int = int(1e8),
    force_leaf_modules: Iterable[type[nn.Module]] | None = None,
    exclude_wrap_modules: Iterable[type[nn.Module]] | None = None,
) -> bool:
    """Wrap a module whose not-yet-wrapped parameters number at least ``min_num_params``.

    Args:
        min_num_params: threshold in parameter elements; default 1e8 (FairScale's).
            Bind it with ``functools.partial``.
        force_leaf_modules: types never looked into (default ``nn.MultiheadAttention``:
            its forward reads its parameters directly, so it is kept whole).
        exclude_wrap_modules: types never wrapped alone (default ``nn.ModuleList``,
            ``nn.ModuleDict``: they have no forward); their children still are.
    """
    leaves = tuple(force_leaf_modules) if force_leaf_modules is not None else _FORCE_LEAF_MODULES
    excluded = (
        tuple(exclude_wrap_modules) if exclude_wrap_modules is not None else _EXCLUDE_WRAP_MODULES
    )
    is_large = unwrapped_params >= min_num_params
    if recurse:
        return is_large and not isinstance(module, leaves)
    return is_large and not isinstance(module, excluded)


def size_based_auto_wrap_policy(min_num_params: int) -> AutoWrapPolicy:
    """:func:`default_auto_wrap_policy` with ``min_num_params`` bound (elements)."""
    return functools.partial(default_auto_wrap_policy, min_num_params=min_num_params)


def _transformer_policy(
    module: nn.Module,
    recurse: bool,
    unwrapped_params: int,
    module_is_root: bool = False,
    *,
    layer_classes: tuple[type[nn.Module], ...],
) -> bool:
    return True if recurse else isinstance(module, layer_classes)


def transformer_auto_wrap_policy(layer_classes: Iterable[type[nn.Module]]) -> AutoWrapPolicy:
    """Wrap every instance of ``layer_classes`` (e.g. ``{Block}``), one unit each.

    Raises:
        ValueError: ``layer_classes`` is empty.
    """
    classes = tuple(layer_classes)
    if not classes:
        raise ValueError("transformer_auto_wrap_policy needs at least one layer class")
    return functools.partial(_transformer_policy, layer_classes=classes)


def config_auto_wrap_policy(
    module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool = False
) -> bool:
    """Wrap the modules that carry a ``wrapper_config`` dict (its items override kwargs)."""
    return True if recurse else hasattr(module, "wrapper_config")


@contextlib.contextmanager
def enable_wrap(
    *,
    wrapper_cls: Callable[..., nn.Module],
    auto_wrap_policy: AutoWrapPolicy | None = None,
    **wrapper_kwargs: Any,
) -> Iterator[None]:
    """Within the context, :func:`wrap` and :func:`auto_wrap` wrap with ``wrapper_cls``.

    Args:
        wrapper_cls: called as ``wrapper_cls(module, **kwargs)``, e.g.
            ``FullyShardedDataParallel``.
        auto_wrap_policy: the default policy of :func:`auto_wrap`; default None:
            :func:`default_auto_wrap_policy`.
        **wrapper_kwargs: passed to every ``wrapper_cls`` call.

    Raises:
        RuntimeError: contexts nested.
    """
    if _WrapContext.wrapper_cls is not None:
        raise RuntimeError("enable_wrap contexts cannot be nested; leave the outer one first")
    _WrapContext.wrapper_cls, _WrapContext.kwargs = wrapper_cls, dict(wrapper_kwargs)
    _WrapContext.policy = auto_wrap_policy
    try:
        yield
    finally:
        _WrapContext.wrapper_cls, _WrapContext.kwargs, _WrapContext.policy = None, {}, None


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` with the ``enable_wrap`` wrapper; outside the context return it.

    Keyword arguments: the context's, then the module's ``wrapper_config``, then
    ``wrap_overrides`` (later ones win).
    """
    wrapper_cls = _WrapContext.wrapper_cls
    if wrapper_cls is None:
        return module
    kwargs = {**_WrapContext.kwargs, **getattr(module, "wrapper_config", {}), **wrap_overrides}
    return wrapper_cls(module, **kwargs)


def auto_wrap(module: nn.Module, auto_wrap_policy: AutoWrapPolicy | None = None) -> nn.Module:
    """Wrap ``module``'s submodules (and ``module`` if the policy says so), inside-out.

    Outside ``enable_wrap`` returns ``module`` unchanged. Tied parameters stay in their
    common ancestor's unit (see [Note: tied parameters]).

    Args:
        module: the root of the tree to wrap (changed in place; children replaced).
        auto_wrap_policy: default None: the context's, else :func:`default_auto_wrap_policy`.

    Returns:
        ``module`` or its wrapper.
    """
    wrapper_cls = _WrapContext.wrapper_cls
    if wrapper_cls is None:
        return module
    policy = auto_wrap_policy or _WrapContext.policy or default_auto_wrap_policy
    is_wrapped = _is_wrapped_check(wrapper_cls)
    counts = _location_counts(module, is_wrapped)
    wrapped, _ = _recursive_wrap(module, policy, counts, is_wrapped, module_is_root=True)
    return wrapped


def _is_wrapped_check(wrapper_cls: Any) -> Callable[[nn.Module], bool]:
    from shardkit.nn.data_parallel.fully_sharded.api import FullyShardedDataParallel

    kinds: tuple[type, ...] = (FullyShardedDataParallel,)
    if isinstance(wrapper_cls, type):
        kinds = (*kinds, wrapper_cls)
    return lambda m: isinstance(m, kinds)


def _locations(module: nn.Module, is_wrapped: Callable[[nn.Module], bool]) -> dict[int, int]:
    """id(parameter) -> number of places it is registered in ``module`` (not in units)."""
    counts: dict[int, int] = {}
    for _, mod in walk_unit(module, is_wrapped):
        for param in mod._parameters.values():
            if param is not None:
                counts[id(param)] = counts.get(id(param), 0) + 1
    return counts


def _location_counts(module: nn.Module, is_wrapped: Callable[[nn.Module], bool]) -> dict[int, int]:
    return _locations(module, is_wrapped)


def _unwrapped_numel(module: nn.Module, is_wrapped: Callable[[nn.Module], bool]) -> int:
    seen: dict[int, int] = {}
    for _, mod in walk_unit(module, is_wrapped):
        for param in mod._parameters.values():
            if param is not None:
                seen[id(param)] = param.numel()
    return sum(seen.values())


def _holds_outside_tie(
    module: nn.Module, counts: dict[int, int], is_wrapped: Callable[[nn.Module], bool]
) -> bool:
    inside = _locations(module, is_wrapped)
    return any(n < counts.get(pid, n) for pid, n in inside.items())


def _recursive_wrap(
    module: nn.Module,
    policy: AutoWrapPolicy,
    counts: dict[int, int],
    is_wrapped: Callable[[nn.Module], bool],
    module_is_root: bool,
) -> tuple[nn.Module, int]:
    """(module or its wrapper, parameter elements wrapped inside it)."""
    if is_wrapped(module):
        return module, 0
    total = _unwrapped_numel(module, is_wrapped)
    if not policy(module, True, total, module_is_root):
        return module, 0
    wrapped_numel = 0
    for name, child in list(module.named_children()):
        new_child, numel = _recursive_wrap(child, policy, counts, is_wrapped, False)
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped_numel += numel
    remainder = total - wrapped_numel
    if policy(module, False, remainder, module_is_root) and (
        module_is_root or not _holds_outside_tie(module, counts, is_wrapped)
    ):
        return wrap(module), total
    return module, wrapped_numel
