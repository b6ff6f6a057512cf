"""State-dict prefix hooks: a wrapper's child attribute hidden from state-dict keys.

A wrapper holding the user's module as an attribute (``CheckpointWrapper.module``,
FSDP's ``_fsdp_wrapped_module``) would put that attribute's name into every key. One
pair of hooks removes it on save and inserts it on load, and a third strips it from
the missing / unexpected key lists of a failed load, so checkpoints move freely between
the wrapped and the plain model and errors show the plain names.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

__all__ = ["hide_child_prefix"]


def hide_child_prefix(wrapper: nn.Module, child: str, *, on_save: bool = True) -> None:
    """Register the hooks that hide ``<prefix><child>.`` in ``wrapper``'s state dicts.

    Args:
        wrapper: the wrapping module.
        child: the attribute holding the wrapped module (e.g. ``"module"``).
        on_save: also strip the prefix in ``state_dict()`` (False for a wrapper whose
            ``state_dict`` calls the child's directly). Default True.
    """
    inner = child + "."
    if on_save:
        wrapper.register_state_dict_post_hook(partial(_strip_saved, inner))
    prefixes: list[str] = []  # the wrapper's prefix in the load under way
    wrapper.register_load_state_dict_pre_hook(partial(_insert_loaded, inner, prefixes))
    wrapper.register_load_state_dict_post_hook(partial(_strip_reported, inner, prefixes))


def _strip_saved(
    inner: str, module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any
) -> None:
    """State-dict post-hook: ``<prefix><child>.x`` -> ``<prefix>x``."""
    for key in [k for k in state_dict if k.startswith(prefix + inner)]:
        state_dict[prefix + key[len(prefix + inner) :]] = state_dict.pop(key)


def _insert_loaded(
    inner: str,
    prefixes: list[str],
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    *_: Any,
) -> None:
    """Load pre-hook: ``<prefix>x`` -> ``<prefix><child>.x``, in place."""
    prefixes[:] = [prefix]
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if not key.startswith(prefix + inner):
            state_dict[prefix + inner + key[len(prefix) :]] = state_dict.pop(key)


def _strip_reported(inner: str, prefixes: list[str], module: nn.Module, incompatible: Any) -> None:
    """Load post-hook: ``<prefix><child>.x`` -> ``<prefix>x`` in the missing / unexpected
    key lists (only under this wrapper: a user's own ``module.`` elsewhere stays)."""
    if not prefixes:
        return
    start = prefixes.pop() + inner
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = [
            k[: len(start) - len(inner)] + k[len(start) :] if k.startswith(start) else k
            for k in keys
        ]
