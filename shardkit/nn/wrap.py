"""Nesting wrappers (FSDP or any other) around submodules, by hand or by policy.

Usage (FairScale's API)::

    with enable_wrap(wrapper_cls=FullyShardedDataParallel, reshard_after_forward=True):
        model.head = wrap(model.head)                  # one module, by hand
        model = auto_wrap(model, transformer_auto_wrap_policy({Block}))  # by policy
    model = FullyShardedDataParallel(model)            # the root unit

A policy is called as ``policy(module=..., recurse=..., unwrapped_params=...,
module_is_root=...)`` (keywords, as FairScale calls it): with ``recurse=True`` it says
whether to look into ``module``'s children, with ``recurse=False`` whether to wrap
``module`` itself, ``unwrapped_params`` being its parameter elements not already inside
a wrapped child. :func:`auto_wrap` wraps inside-out (children first), as FSDP requires.

[Note: the root may be wrapped]
As in FairScale, :func:`auto_wrap` wraps the root itself when the policy says so for
its remainder (the parameters left after wrapping its children): with the size policy,
when that remainder reaches ``min_num_params`` (or always, with
``skip_params_check_for_root=True``). The FairScale pattern ``model = auto_wrap(model)``
inside the context followed by ``model = FSDP(model)`` outside then wraps a unit in an
outer unit that holds no parameters of its own. ``isinstance(model, FSDP)`` tells
whether the root was wrapped, if the outer call is to be skipped.

[Note: what counts as wrapped]
:func:`auto_wrap` neither enters nor re-wraps a module that is already a unit: an
instance of the context's ``wrapper_cls`` (when it is a class), or of any class that
marks itself with the class attribute ``_shardkit_wrapper_unit = True``
(:class:`~shardkit.nn.FullyShardedDataParallel` does). Its parameters do not count
towards its ancestors' ``unwrapped_params``. So a tree can be wrapped in several
passes, and by hand before the policy. This module knows no wrapper class.

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

from shardkit.nn.module_tree import walk_unit

__all__ = [
    "WRAPPER_UNIT_MARKER",
    "AutoWrapPolicy",
    "auto_wrap",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "enable_wrap",
    "is_wrapper_unit",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]

AutoWrapPolicy = Callable[..., bool]

WRAPPER_UNIT_MARKER = "_shardkit_wrapper_unit"
"""Class attribute that marks a wrapper class: ``_shardkit_wrapper_unit = True``."""


def is_wrapper_unit(module: nn.Module) -> bool:
    """True if ``module``'s class marks itself as a wrapper unit (see the module notes).

    The marker is read from the class, not the instance, so a wrapper that forwards
    unknown attributes to its inner module (``__getattr__``) is not mistaken for the
    unit it wraps.
    """
    return getattr(type(module), WRAPPER_UNIT_MARKER, False) is True


class _WrapContext:
    """The active ``enable_wrap`` configuration (None outside the context)."""

    wrapper_cls: Callable[..., nn.Module] | None = None
    kwargs: dict[str, Any] = {}  # noqa: RUF012 (replaced, never mutated)
    policy: AutoWrapPolicy | None = None
    move_module_cuda_half: bool = False


def default_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    unwrapped_params: int,
    module_is_root: bool = False,
    min_num_params: int = int(1e8),
    force_leaf_modules: Iterable[type[nn.Module]] | None = None,
    exclude_wrap_modules: Iterable[type[nn.Module]] | None = None,
    skip_params_check_for_root: bool = False,
) -> bool:
    """Wrap a module whose not-yet-wrapped parameters number at least ``min_num_params``.

    FairScale's policy, with its arguments and its two class sets, read at each call:
    ``default_auto_wrap_policy.FORCE_LEAF_MODULES`` (``{nn.MultiheadAttention}``) and
    ``default_auto_wrap_policy.EXCLUDE_WRAP_MODULES`` (``{nn.ModuleList, nn.ModuleDict}``).
    Extend them with ``default_auto_wrap_policy.FORCE_LEAF_MODULES | {MyLayer}``.

    Args:
        min_num_params: threshold in parameter elements; default 1e8 (FairScale's).
            Bind it with ``functools.partial``.
        force_leaf_modules: types never looked into (default ``FORCE_LEAF_MODULES``:
            ``nn.MultiheadAttention`` reads its parameters directly in forward). Such a
            module is not wrapped on its own either: it stays in its parent's unit.
        exclude_wrap_modules: types never wrapped (default ``EXCLUDE_WRAP_MODULES``:
            ``nn.ModuleList``, ``nn.ModuleDict``, which have no forward); their children
            still are.
        skip_params_check_for_root: wrap the root whatever its remainder (the size check
            still decides whether the root is looked into: a root smaller than
            ``min_num_params`` is left alone).
    """
    leaves = tuple(
        default_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
        if force_leaf_modules is None
        else force_leaf_modules
    )
    excluded = tuple(
        default_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]
        if exclude_wrap_modules is None
        else exclude_wrap_modules
    )
    is_large = unwrapped_params >= min_num_params
    if recurse:
        return is_large and not isinstance(module, leaves)
    return (is_large or (module_is_root and skip_params_check_for_root)) and not isinstance(
        module, excluded
    )


default_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]
default_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]


def size_based_auto_wrap_policy(min_num_params: int, **kwargs: Any) -> AutoWrapPolicy:
    """:func:`default_auto_wrap_policy` with ``min_num_params`` (elements) and any of its
    other keyword arguments bound."""
    return functools.partial(default_auto_wrap_policy, min_num_params=min_num_params, **kwargs)


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
    auto_wrap_policy: AutoWrapPolicy | None = None,
    *,
    wrapper_cls: Callable[..., nn.Module],
    move_module_cuda_half: bool = False,
    **wrapper_kwargs: Any,
) -> Iterator[None]:
    """Within the context, :func:`wrap` and :func:`auto_wrap` wrap with ``wrapper_cls``.

    Args:
        auto_wrap_policy: the default policy of :func:`auto_wrap`; default None:
            :func:`default_auto_wrap_policy`.
        wrapper_cls: called as ``wrapper_cls(module, **kwargs)``, e.g.
            ``FullyShardedDataParallel``; any callable returning a module.
        move_module_cuda_half: :func:`wrap` moves each module to CUDA in fp16
            (``module.cuda().half()``) before wrapping it (FairScale's option).
        **wrapper_kwargs: passed to every ``wrapper_cls`` call.

    Raises:
        RuntimeError: contexts nested.
    """
    if _WrapContext.wrapper_cls is not None:
        raise RuntimeError("enable_wrap contexts cannot be nested; leave the outer one first")
    _WrapContext.wrapper_cls, _WrapContext.kwargs = wrapper_cls, dict(wrapper_kwargs)
    _WrapContext.policy = auto_wrap_policy
    _WrapContext.move_module_cuda_half = move_module_cuda_half
    try:
        yield
    finally:
        _WrapContext.wrapper_cls, _WrapContext.kwargs, _WrapContext.policy = None, {}, None
        _WrapContext.move_module_cuda_half = False


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` with the ``enable_wrap`` wrapper; outside the context return it.

    Keyword arguments: the context's, then the module's ``wrapper_config``, then
    ``wrap_overrides`` (later ones win).
    """
    wrapper_cls = _WrapContext.wrapper_cls
    if wrapper_cls is None:
        return module
    kwargs = {**_WrapContext.kwargs, **getattr(module, "wrapper_config", {}), **wrap_overrides}
    if _WrapContext.move_module_cuda_half:
        module = module.cuda().half()
    return wrapper_cls(module, **kwargs)


def auto_wrap(
    module: nn.Module, auto_wrap_policy: AutoWrapPolicy | None = None, **wrap_overrides: Any
) -> nn.Module:
    """Wrap ``module``'s submodules (and ``module`` if the policy says so), inside-out.

    Outside ``enable_wrap`` returns ``module`` unchanged. Modules that are already units
    are left as they are (see [Note: what counts as wrapped]); tied parameters stay in
    their common ancestor's unit (see [Note: tied parameters]). The root is wrapped
    when the policy says so for its remainder, as in FairScale (see [Note: the root may
    be wrapped]).

    Args:
        module: the root of the tree to wrap (changed in place; children replaced).
        auto_wrap_policy: default None: the context's, else :func:`default_auto_wrap_policy`.
        **wrap_overrides: passed to every :func:`wrap` call (they win over the
            context's keyword arguments).

    Returns:
        ``module`` or its wrapper.
    """
    wrapper_cls = _WrapContext.wrapper_cls
    if wrapper_cls is None:
        return module
    policy = auto_wrap_policy or _WrapContext.policy or default_auto_wrap_policy
    walker = _Walker(policy, _is_wrapped_check(wrapper_cls), wrap_overrides)
    walker.counts = walker.locations(module)
    wrapped, _ = walker.recursive_wrap(module, module_is_root=True)
    return wrapped


def _is_wrapped_check(wrapper_cls: Any) -> Callable[[nn.Module], bool]:
    """The "already a unit" predicate for ``wrapper_cls`` (see [Note: what counts as
    wrapped])."""
    if isinstance(wrapper_cls, type):
        return lambda m: isinstance(m, wrapper_cls) or is_wrapper_unit(m)
    return is_wrapper_unit


class _Walker:
    """One :func:`auto_wrap` pass: the policy, the unit predicate and the tie counts."""

    def __init__(
        self,
        policy: AutoWrapPolicy,
        is_wrapped: Callable[[nn.Module], bool],
        wrap_overrides: dict[str, Any],
    ) -> None:
        self.policy, self.is_wrapped, self.wrap_overrides = policy, is_wrapped, wrap_overrides
        self.counts: dict[int, int] = {}  # id(parameter) -> places in the whole tree

    def locations(self, module: nn.Module) -> dict[int, int]:
        """id(parameter) -> places it is registered in ``module`` (not inside units)."""
        counts: dict[int, int] = {}
        for _, mod in walk_unit(module, self.is_wrapped):
            for param in mod._parameters.values():
                if param is not None:
                    counts[id(param)] = counts.get(id(param), 0) + 1
        return counts

    def unwrapped_numel(self, module: nn.Module) -> int:
        """Elements of ``module``'s unique parameters outside units."""
        seen: dict[int, int] = {}
        for _, mod in walk_unit(module, self.is_wrapped):
            for param in mod._parameters.values():
                if param is not None:
                    seen[id(param)] = param.numel()
        return sum(seen.values())

    def holds_outside_tie(self, module: nn.Module) -> bool:
        """True if a parameter of ``module`` is also registered outside it."""
        inside = self.locations(module)
        return any(n < self.counts.get(pid, n) for pid, n in inside.items())

    def ask(self, module: nn.Module, recurse: bool, numel: int, module_is_root: bool) -> bool:
        return bool(
            self.policy(
                module=module,
                recurse=recurse,
                unwrapped_params=numel,
                module_is_root=module_is_root,
            )
        )

    def recursive_wrap(self, module: nn.Module, module_is_root: bool) -> tuple[nn.Module, int]:
        """(module or its wrapper, parameter elements wrapped inside it)."""
        if self.is_wrapped(module):
            return module, 0
        total = self.unwrapped_numel(module)
        if not self.ask(module, True, total, module_is_root):
            return module, 0
        wrapped_numel = 0
        for name, child in list(module.named_children()):
            new_child, numel = self.recursive_wrap(child, module_is_root=False)
            if new_child is not child:
                setattr(module, name, new_child)
            wrapped_numel += numel
        remainder = total - wrapped_numel
        if self.ask(module, False, remainder, module_is_root) and (
            module_is_root or not self.holds_outside_tie(module)
        ):
            return wrap(module, **self.wrap_overrides), total
        return module, wrapped_numel
