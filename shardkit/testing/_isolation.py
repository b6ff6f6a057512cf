"""Process-wide state a pool task may change, put back before the next task runs.

A :class:`~shardkit.testing.RankPool` runs many tasks in one process per rank, so a
task that changes process-wide state (sets an environment variable, changes directory,
sets the default dtype or the thread count, leaves grad mode off, registers a global
module hook, shortens the default group's timeout) would change what every later task
on that rank sees: one test could make another pass or fail. :func:`snapshot` records
that state once the rank has joined its group; :meth:`Snapshot.restore` puts it back
after every task (the rank's own process group is kept: it is the pool's).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.modules.module as module_mod

__all__ = ["Snapshot", "snapshot"]

# torch.nn.Module's process-wide hook registries (``register_module_forward_hook``...)
_HOOK_DICTS = [
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_buffer_registration_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
    "_global_forward_pre_hooks",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
]


@dataclass
class Snapshot:
    """What :func:`snapshot` recorded; :meth:`restore` puts it back."""

    environ: dict[str, str]
    cwd: str
    default_dtype: torch.dtype
    num_threads: int
    grad_enabled: bool
    deterministic: bool
    anomaly: bool
    hooks: dict[str, dict[Any, Any]] = field(default_factory=dict)
    full_backward_hook: Any = None
    extra: list[Callable[[], None]] = field(default_factory=list)

    def restore(self) -> None:
        """Put every recorded value back (each one only when it changed)."""
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        torch.set_default_dtype(self.default_dtype)
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        torch.set_grad_enabled(self.grad_enabled)
        if torch.are_deterministic_algorithms_enabled() != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic)
        if torch.is_anomaly_enabled() != self.anomaly:
            torch.autograd.set_detect_anomaly(self.anomaly)
        for name, saved in self.hooks.items():
            live = getattr(module_mod, name)
            if live != saved:
                live.clear()
                live.update(saved)
        module_mod._global_is_full_backward_hook = self.full_backward_hook
        for undo in self.extra:
            undo()


def snapshot(*extra: Callable[[], None]) -> Snapshot:
    """Record the process-wide state a task may change; ``extra`` callables run at
    every :meth:`Snapshot.restore` too (e.g. resetting the default group's timeout)."""
    return Snapshot(
        environ=dict(os.environ),
        cwd=os.getcwd(),
        default_dtype=torch.get_default_dtype(),
        num_threads=torch.get_num_threads(),
        grad_enabled=torch.is_grad_enabled(),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        anomaly=torch.is_anomaly_enabled(),
        hooks={
            name: dict(getattr(module_mod, name))
            for name in _HOOK_DICTS
            if isinstance(getattr(module_mod, name, None), dict)
        },
        full_backward_hook=getattr(module_mod, "_global_is_full_backward_hook", None),
        extra=list(extra),
    )
