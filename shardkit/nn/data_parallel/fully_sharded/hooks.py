"""The phase hooks of FSDP: pre/post forward, pre/post backward, finalize backward.

One training step of a root unit R with nested units U1, U2 (forward order), with
``reshard_after_forward=True`` (``ag`` = all-gather, ``rs`` = reduce-scatter)::

    phase           R            U1               U2
    forward         ag, run ...  ag (prefetched   ag (prefetched in U1's pre_forward),
                                 in R's),  run,   run, free
                                 free
    backward        (kept)                        ag in pre_backward (U1 prefetched),
                                                  grads -> rs, free
                                 ag, grads -> rs,
                                 free
                    grads -> rs, free
    finalize        wait every rs; every unit sharded, IDLE

[Note: when is a unit's backward done]
Its pre-backward hook is a tensor hook on each forward output: it fires when the
gradient of an output is computed, before the unit's own backward ops run. Its
post-backward is driven by ``register_post_accumulate_grad_hook`` on every trainable
unsharded parameter: autograd accumulates a leaf's gradient once per backward, after
every use of it (several forwards, a unit used twice), so when all of a unit's
trainable parameters have reported, its gradient is complete. Parameters that receive
no gradient (unused) are handled by ``finalize_backward``, a callback queued on
autograd's engine that runs when the whole backward pass ends.

[Note: frozen parameters]
A frozen parameter has no gradient to report, yet a later backward op may read it (a
frozen ``Linear`` early in the unit needs its weight for the input's gradient after
every trainable parameter of the unit is done). A unit holding frozen parameters
therefore reduce-scatters on time but stays unsharded until ``finalize_backward``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd import Variable
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten

from shardkit.nn.data_parallel.fully_sharded.collectives import Pending, reduce_scatter_flat
from shardkit.nn.data_parallel.fully_sharded.state import ShardedState, TrainingState

if TYPE_CHECKING:
    from shardkit.nn.data_parallel.fully_sharded.api import FullyShardedDataParallel

__all__ = [
    "RootState",
    "finalize_backward",
    "post_accumulate_grad",
    "post_backward",
    "post_forward",
    "pre_backward",
    "pre_forward",
]


@dataclass
class RootState:
    """Shared by every unit under one root: the units, their order, pending reductions.

    Attributes:
        units: every unit, root first, in module order.
        forward_order: units in the order their first forward ran (recorded once).
        order_frozen: True after the root's first forward: prefetching uses the order.
        pending: issued gradient reduce-scatters, oldest first.
        finalize_queued: a ``finalize_backward`` callback waits on the engine.
    """

    units: list[FullyShardedDataParallel]
    forward_order: list[FullyShardedDataParallel] = field(default_factory=list)
    order_frozen: bool = False
    pending: deque[Pending] = field(default_factory=deque)
    finalize_queued: bool = False

    def neighbour(self, unit: FullyShardedDataParallel, step: int) -> Any:
        """The unit ``step`` places after ``unit`` in forward order, or None."""
        if not self.order_frozen or unit not in self.forward_order:
            return None
        index = self.forward_order.index(unit) + step
        return self.forward_order[index] if 0 <= index < len(self.forward_order) else None


def _prefetch(unit: FullyShardedDataParallel | None) -> None:
    if unit is not None and unit._sharded_state is ShardedState.SHARDED:
        unit._unshard(async_op=True)


def pre_forward(unit: FullyShardedDataParallel) -> None:
    """Before the wrapped module's forward: all-gather (or wait for the prefetch)."""
    with record_function("FSDP::pre_forward"):
        root = unit._root()
        unit._training_state = TrainingState.FORWARD
        unit._unshard()
        if not root.order_frozen and unit not in root.forward_order:
            root.forward_order.append(unit)
        _prefetch(root.neighbour(unit, +1))


def _tensors_needing_grad(output: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def post_forward(unit: FullyShardedDataParallel, output: Any) -> None:
    """After the forward: reshard (unless kept) and hook the outputs for backward."""
    with record_function("FSDP::post_forward"):
        needing_grad = _tensors_needing_grad(output) if torch.is_grad_enabled() else []
        keep = unit._is_root and unit._config.disable_reshard_on_root
        if not needing_grad or (unit._config.reshard_after_forward and not keep):
            unit._reshard()
        for tensor in needing_grad:
            tensor.register_hook(_pre_backward_hook(unit))
        unit._training_state = TrainingState.IDLE
        if unit._is_root:
            _end_root_forward(unit._root(), backward_expected=bool(needing_grad))


def _end_root_forward(root: RootState, backward_expected: bool) -> None:
    root.order_frozen = True
    for other in root.units:
        if other._sharded_state is ShardedState.UNSHARDING or not backward_expected:
            other._reshard()  # an unused prefetch, or inference: nothing to keep


def _pre_backward_hook(unit: FullyShardedDataParallel) -> Any:
    def hook(grad: torch.Tensor) -> None:
        pre_backward(unit)

    return hook


def _queue_finalize(root: RootState) -> None:
    if not root.finalize_queued:
        root.finalize_queued = True
        Variable._execution_engine.queue_callback(lambda: finalize_backward(root))


def pre_backward(unit: FullyShardedDataParallel) -> None:
    """An output's gradient arrived: all-gather the parameters for the unit's backward."""
    if unit._training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
        return
    with record_function("FSDP::pre_backward"):
        root = unit._root()
        _queue_finalize(root)
        unit._training_state = TrainingState.PRE_BACKWARD
        unit._unshard()
        _prefetch(root.neighbour(unit, -1))


def post_accumulate_grad(unit: FullyShardedDataParallel, index: int) -> None:
    """Autograd accumulated trainable parameter ``index``; the last one ends the backward."""
    _queue_finalize(unit._root())
    unit._grads_ready.add(index)
    if unit._grads_ready >= unit._grads_expected:
        post_backward(unit)


def post_backward(unit: FullyShardedDataParallel) -> None:
    """The unit's gradient is complete: reduce-scatter it (unless in no_sync), reshard."""
    with record_function("FSDP::post_backward"):
        unit._training_state = TrainingState.POST_BACKWARD
        if unit._sync_gradients and unit._grads_ready:
            _reduce_grads(unit)
        unit._grads_ready.clear()
        if not unit._handle.has_frozen:  # see [Note: frozen parameters]
            unit._reshard()


def _reduce_grads(unit: FullyShardedDataParallel) -> None:
    """Reduce-scatter the flat gradient in the reduce dtype; the reduced shard is cast to
    the master dtype, moved to the shard device and accumulated into the sharded grads."""
    handle, root = unit._handle, unit._root()
    pre, post = unit._config.divide_factors(unit._world_size)
    flat = handle.take_flat_grad()
    if pre != 1.0:
        flat.div_(pre)
    distributed = handle.layout.world_size > 1
    shard = flat.new_empty(handle.layout.shard_numel) if distributed else flat

    def then() -> None:
        handle.accumulate_grad_shard(shard, divide_by=post)

    if distributed:
        pending = reduce_scatter_flat(shard, flat, unit._process_group, async_op=True)
    else:
        pending = Pending(nbytes=0)
    pending.then = then
    root.pending.append(pending)
    _bound_pending(root, unit._config.bucket_cap_mb * 2**20)


def _bound_pending(root: RootState, cap_bytes: float) -> None:
    while len(root.pending) > 1 and sum(p.nbytes for p in root.pending) > cap_bytes:
        root.pending.popleft().wait()


def finalize_backward(root: RootState) -> None:
    """End of the backward pass: reduce what is left, wait for every reduction, reshard."""
    with record_function("FSDP::finalize_backward"):
        for unit in root.units:
            if unit._grads_ready:
                post_backward(unit)  # some trainable parameters got no gradient
        while root.pending:
            root.pending.popleft().wait()
        for unit in root.units:
            unit._reshard()
            unit._training_state = TrainingState.IDLE
        root.finalize_queued = False
