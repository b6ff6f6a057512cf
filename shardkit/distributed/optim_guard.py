"""One optimizer-step guard: refuse to step a parameter that a wrapper replaced.

A wrapper that takes over a parameter (FSDP replaces the originals by shards; an
``OffloadModel`` on the disk tier leaves empty placeholders that only its sliced
optimizer may step) records it with :func:`mark_replaced`. One global optimizer step
pre-hook, registered once for the process, then refuses any optimizer holding such a
parameter, with a :class:`ReplacedParameterError` naming the parameter, the wrapper
and the fix, instead of silently stepping nothing.

[Note: cost per step]
The hook walks an optimizer's parameters only when something changed since its last
walk: it caches, per optimizer, the number of parameters it holds and the registry's
generation (bumped by every :func:`mark_replaced`). A steady training loop costs one
sum over the parameter groups per step. (Replacing a parameter inside
``param_groups`` by hand, keeping the count, is not noticed until the next mark.)

[Note: weak tables]
Every table is a ``torch.utils.weak.WeakIdKeyDictionary``: nothing is stamped onto
torch objects, and a parameter or optimizer that is garbage collected leaves the tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "ReplacedParameterError",
    "Replacement",
    "add_step_check",
    "check_optimizer",
    "exempt_optimizer",
    "is_replaced",
    "mark_replaced",
]


class ReplacedParameterError(ValueError, RuntimeError):
    """An optimizer is asked to step a parameter a wrapper replaced.

    A ``ValueError`` (the optimizer was built from the wrong parameters) and, for code
    written against OffloadModel's earlier guard, a ``RuntimeError``.
    """


@dataclass(frozen=True)
class Replacement:
    """Why a parameter must not be stepped by a plain optimizer.

    Attributes:
        name: the parameter as the user knows it, e.g. ``"`0.weight` of FSDP unit (root)"``.
        wrapper: what replaced it, e.g. ``"FullyShardedDataParallel"``.
        fix: what to do instead, one or more sentences.
    """

    name: str
    wrapper: str
    fix: str

    def message(self, optimizer: torch.optim.Optimizer) -> str:
        """The error text for ``optimizer`` holding this parameter."""
        return (
            f"{type(optimizer).__name__} holds the parameter {self.name}, which "
            f"{self.wrapper} replaced: {self.fix}"
        )


_REPLACED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> Replacement
_EXEMPT: WeakIdKeyDictionary = WeakIdKeyDictionary()  # optimizer -> None
_CHECKED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # optimizer -> (generation, count)
_STEP_CHECKS: list[Callable[[torch.optim.Optimizer], None]] = []  # see add_step_check
_generation = 0
_handle: RemovableHandle | None = None


def _install() -> None:
    """Register :func:`check_optimizer` as the global step pre-hook, once per process."""
    global _handle
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(check_optimizer)


def add_step_check(check: Callable[[torch.optim.Optimizer], None]) -> None:
    """Run ``check(optimizer)`` before every optimizer step, from the one global hook
    (a wrapper's other refusal, e.g. FSDP's step over gradients still deferred); it
    raises to refuse the step. Added once however often it is passed; it must be cheap
    when it has nothing to check (it runs on every step of every optimizer)."""
    if check not in _STEP_CHECKS:
        _STEP_CHECKS.append(check)
    _install()


def mark_replaced(param: torch.Tensor, *, name: str, wrapper: str, fix: str) -> None:
    """Record that ``wrapper`` replaced ``param``: optimizers stepping it will raise.

    Installs the global step pre-hook on first use (once per process). Marking a
    parameter again overwrites its :class:`Replacement`.

    Args:
        param: the replaced parameter (held weakly).
        name: how the error names it (include backquotes and where it lives).
        wrapper: what replaced it (``"FullyShardedDataParallel"``).
        fix: what the user should do instead.
    """
    global _generation
    _REPLACED[param] = Replacement(name, wrapper, fix)
    _generation += 1
    _install()


def is_replaced(param: torch.Tensor) -> bool:
    """True if :func:`mark_replaced` recorded ``param`` (and it is still alive)."""
    return param in _REPLACED


def exempt_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Let ``optimizer`` step replaced parameters (a wrapper's own optimizer; held weakly)."""
    _EXEMPT[optimizer] = None


def check_optimizer(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """The step pre-hook: the checks of :func:`add_step_check`, then raise if
    ``optimizer`` holds a replaced parameter.

    Callable directly (e.g. right after building an optimizer). Args beyond the
    optimizer (the hook's ``args, kwargs``) are ignored.

    Raises:
        ReplacedParameterError: naming the first replaced parameter found, the wrapper
            that replaced it and the fix.
        Exception: whatever an added step check raises.
    """
    for check in _STEP_CHECKS:
        check(optimizer)
    if optimizer in _EXEMPT:
        return
    key = (_generation, sum(len(group["params"]) for group in optimizer.param_groups))
    if _CHECKED.get(optimizer) == key:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            replacement = _REPLACED.get(param)
            if replacement is not None:
                raise ReplacedParameterError(replacement.message(optimizer))
    _CHECKED[optimizer] = key
