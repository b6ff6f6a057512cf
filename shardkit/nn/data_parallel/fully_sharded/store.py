"""Where a unit's local shard lives between its runs: the shard-store policy.

A :class:`~.unit.UnitRuntime` holds one :class:`ShardStore`, picked once when the unit
is built (``api.py``), and calls its hooks at fixed points of its lifecycle; the unit
itself has no branch on where the shard lives (as torch FSDP2 takes an
``OffloadPolicy`` at ``fully_shard`` and its parameter group never asks again).

[Note: the shard-store hooks]
In the order a step calls them::

    before_gather          SHARDED -> UNSHARDING: the local shard must be resident
    after_gather           the all-gather was waited (forward or backward)
    prefetch               the unit runs next: bring the shard in ahead of time (and,
                           in a forward, what the backward's first steps read)
    check_backward_allowed an output's gradient arrived, before any state changes
    accept_grad_shard      the reduced gradient shard (S,) is complete
    end_backward           the whole backward pass ended (every reduction waited)
    end_summon             leaving summon_full_params, after the reshard

The stores:

- :class:`MemoryStore`: the shard stays in memory (on the compute device, or in CPU
  memory with ``move_params_to_cpu``: :mod:`.placement` decides, the store does not
  care); the gradient shard is accumulated into the sharded parameters' ``.grad`` for
  the user's optimizer. Every other hook does nothing.
- :class:`~.disk_tier.DiskUnit`: the shard and optimizer state live in files; the
  gradient shard steps the unit at once (see :mod:`.disk_tier`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from shardkit.nn.data_parallel.fully_sharded.flat_param import FlatParamHandle

__all__ = ["MemoryStore", "ShardStore"]


class ShardStore(Protocol):
    """The hooks a unit calls on its shard store (see [Note: the shard-store hooks]).

    Attributes:
        in_memory: True when the local shard, its gradient and the optimizer state are
            ordinary tensors between the unit's runs (state dicts, optimizer-state
            gathering and checkpoints may read them); False for a file-backed store.
    """

    in_memory: bool

    def before_gather(self) -> None:
        """The unit leaves SHARDED: make the local shard resident (wait for a prefetch)."""

    def after_gather(self, in_forward: bool) -> None:
        """The all-gather was waited; ``in_forward``: the unit is in its forward."""

    def prefetch(self, steps: bool) -> bool:
        """The unit runs next. ``steps``: a backward that reduces gradients (and so steps
        a file-backed store's units) is to come: grad enabled, not inside ``no_sync``.
        Returns True when the caller may issue the all-gather now (the shard is
        resident); False when the store started bringing the shard in and the
        all-gather waits for ``before_gather``."""

    def check_backward_allowed(self, label: str, steps: bool) -> None:
        """Called when the unit's backward starts, before any state change; ``steps``:
        its gradient is reduced in this backward (False inside ``no_sync``).

        Raises:
            RuntimeError: the store refuses this backward (naming ``label`` and the fix).
        """

    def accept_grad_shard(self, grad_shard: torch.Tensor, divide_by: float) -> None:
        """The reduced gradient shard ``(S,)`` of this rank, to be divided by ``divide_by``."""

    def end_backward(self) -> None:
        """The backward pass ended; every unit's reduction is done."""

    def abort_backward(self) -> None:
        """A backward raised (autograd dropped its ``finalize_backward``), before the
        unit forgets it.

        Raises:
            RuntimeError: the store cannot go on (naming the fix).
        """

    def end_summon(self) -> None:
        """Leaving ``summon_full_params`` (the unit is SHARDED again).

        Raises:
            RuntimeError: the store cannot keep a change made inside.
        """


class MemoryStore:
    """The local shard stays in memory; the gradient goes to the sharded ``.grad``.

    Args:
        handle: the unit's flat parameter.
    """

    in_memory = True

    def __init__(self, handle: FlatParamHandle) -> None:
        self.handle = handle

    def before_gather(self) -> None:
        """Nothing to do: the shard is in memory."""

    def after_gather(self, in_forward: bool) -> None:
        """Nothing to do: the shard stays."""

    def prefetch(self, steps: bool) -> bool:
        """The shard is resident: the all-gather may be issued now (True)."""
        return True

    def check_backward_allowed(self, label: str, steps: bool) -> None:
        """Every backward is allowed (gradients accumulate in ``.grad``)."""

    def accept_grad_shard(self, grad_shard: torch.Tensor, divide_by: float) -> None:
        """Accumulate ``grad_shard / divide_by`` into the sharded parameters' ``.grad``."""
        self.handle.accumulate_grad_shard(grad_shard, divide_by=divide_by)

    def end_backward(self) -> None:
        """Nothing to do: the user's optimizer steps."""

    def abort_backward(self) -> None:
        """Nothing to do: the reduced gradients are in ``.grad``, as the plain model's."""

    def end_summon(self) -> None:
        """Nothing to do: a change written back is in the shard already."""
