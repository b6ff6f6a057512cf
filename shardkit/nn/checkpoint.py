"""Activation checkpointing that composes with the sharding wrappers.

``checkpoint_wrapper(module)`` makes ``module`` keep none of its intermediate
activations during forward; backward re-runs its forward to recompute them
(re-materialization: Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost"; GPipe, Huang et al. 2019, section 2.3). Memory for activations drops from
O(layers) to O(checkpointed regions), at the cost of one extra forward.

Built on ``torch.utils.checkpoint`` in its non-reentrant mode, so keyword arguments,
non-tensor outputs, inputs that do not require grad, and nesting all work.

[Note: BatchNorm and recomputation]
A BatchNorm in training mode updates its running statistics on every forward, so
the recomputation in backward would update them a second time (FairScale patches
momentum to 0 for this). Here the recompute pass runs inside :func:`recomputing`,
which snapshots the buffers of every training-mode BatchNorm (any ``_BatchNorm``
subclass, so Pipe's ``DeferredBatchNorm`` too) on entry and restores them on exit: the
statistics are updated exactly once, whatever the momentum mode (including
``momentum=None``, the cumulative average, which a zero-momentum patch would get
wrong through ``num_batches_tracked``). :func:`is_recomputing` is True meanwhile, for
layers with bookkeeping of their own.

[Note: one primitive]
:func:`run_checkpointed` is the only activation recomputation in shardkit:
:class:`CheckpointWrapper`, Pipe's checkpointed micro-batches
(``shardkit.nn.pipe.checkpoint``) and ``OffloadModel(checkpoint_activation=True)``
(``shardkit.nn.offload.function``) all call it. The random number generators (CPU and
the inputs' device) are replayed by ``torch.utils.checkpoint`` (``preserve_rng_state``),
so dropout draws the same mask twice.

[Note: other state replayed in the recompute]
State of another kind that a region's forward reads and advances (the tensor-parallel
RNG tracker's named generator states, ``shardkit.nn.tensor_parallel.random``) goes
through :func:`replayed`: in a checkpointed region's forward, ``replayed(value)``
records ``value`` and returns it; in that region's recompute, its n-th call returns
what the n-th call of the forward recorded; outside any region it returns ``value``.
Regions nest: a value passes through every open region, outermost first, so the
recompute of an outer region hands an inner region the values of the first forward.

[Note: the wrapper and the wrapped module]
FairScale's ``checkpoint_wrapper`` patches ``forward`` on the module it is given and
returns that same module, so ``isinstance(wrapped, MyBlock)`` holds. Here the wrapper
is a module of its own, :class:`CheckpointWrapper` (so that it can be recognised:
``isinstance(m, CheckpointWrapper)``, ``transformer_auto_wrap_policy({CheckpointWrapper})``,
and unwrapped: ``m.module``), and it is transparent otherwise: reading or setting an
attribute the wrapper does not have reaches the wrapped module (``wrapped.cnt``,
``wrapped.cnt = 0``), and its state-dict keys are the wrapped module's. Code that tests
the type of a block writes ``isinstance(getattr(m, "module", m), MyBlock)``.
:func:`disable_checkpointing` turns every ``CheckpointWrapper`` into a plain call within
a ``with`` block (this thread), as FairScale's does.

[Note: offload_to_cpu]
With ``offload_to_cpu=True`` the tensors the checkpoint keeps (the region's inputs)
are copied to CPU memory in forward and back to their device in the recompute; on a
CPU-only machine the copy is a no-op and the code path is the same.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardkit.nn.forwarding import ForwardingMixin
from shardkit.nn.prefix_hooks import hide_child_prefix

__all__ = [
    "CheckpointWrapper",
    "checkpoint_wrapper",
    "disable_checkpointing",
    "is_checkpointing_disabled",
    "is_recomputing",
    "recomputing",
    "replayed",
    "run_checkpointed",
]

_NORM_TYPES = (nn.modules.batchnorm._BatchNorm,)
_state = threading.local()


def is_recomputing() -> bool:
    """True while a checkpointed region runs its second (backward-time) forward."""
    return bool(getattr(_state, "recomputing", False))


def is_checkpointing_disabled() -> bool:
    """True inside :func:`disable_checkpointing` (this thread)."""
    return bool(getattr(_state, "checkpointing_disabled", False))


@contextlib.contextmanager
def disable_checkpointing() -> Iterator[None]:
    """Within the block, every :class:`CheckpointWrapper` runs its module plainly.

    The activations are kept, so backward does not run the forward again (FairScale's
    ``fairscale.nn.checkpoint.checkpoint_activations.disable_checkpointing``). Applies to
    this thread; nests. Pipe's and OffloadModel's own checkpointing are not affected
    (their ``checkpoint=`` / ``checkpoint_activation=`` arguments choose it).

    Example:
        >>> block = checkpoint_wrapper(nn.Linear(2, 2))
        >>> with disable_checkpointing():
        ...     block(torch.ones(1, 2)).sum().backward()  # one forward only
    """
    previous, _state.checkpointing_disabled = is_checkpointing_disabled(), True
    try:
        yield
    finally:
        _state.checkpointing_disabled = previous


class _Frame:
    """One open region for :func:`replayed`: recording its forward's values, or
    replaying them in order (``[Note: other state replayed in the recompute]``)."""

    def __init__(self, values: list[object], replay: bool) -> None:
        self.values, self.replay, self.next = values, replay, 0

    def pass_value(self, value: object) -> object:
        if not self.replay:
            self.values.append(value)
            return value
        if self.next >= len(self.values):
            raise RuntimeError(
                f"the recompute of a checkpointed region called replayed() more often than "
                f"its forward ({len(self.values)} times): the region's forward must make "
                "the same calls both times"
            )
        self.next += 1
        return self.values[self.next - 1]


def _frames() -> list[_Frame]:
    if not hasattr(_state, "frames"):
        _state.frames = []
    frames: list[_Frame] = _state.frames
    return frames


def replayed(value: object) -> object:
    """``value``, or in a checkpointed region's recompute what the forward passed here
    (the n-th call of the recompute gets the n-th value of the forward; see ``[Note:
    other state replayed in the recompute]``).

    Example:
        >>> start = replayed(my_generator_state)  # doctest: +SKIP

    Raises:
        RuntimeError: a recompute calls it more often than its forward did.
    """
    for frame in _frames():  # outermost first
        value = frame.pass_value(value)
    return value


class _Recording:
    """The forward context of one checkpointed call: :func:`replayed` records into
    ``values``."""

    def __init__(self, values: list[object]) -> None:
        self.values = values

    def __enter__(self) -> None:
        _frames().append(_Frame(self.values, replay=False))

    def __exit__(self, *exc: object) -> None:
        _frames().pop()


class _Recomputing:
    """The reusable context manager :func:`recomputing` returns (torch enters the one
    ``context_fn`` gave once per recompute, so a ``retain_graph`` backward enters it
    again: a generator-based one would fail the second time). With ``values`` (what
    the forward recorded), :func:`replayed` replays them inside."""

    def __init__(self, module: nn.Module, values: list[object] | None = None) -> None:
        self.module, self.values = module, values
        self._entries: list[tuple[bool, list[tuple[torch.Tensor, torch.Tensor]]]] = []

    def __enter__(self) -> None:
        saved = [
            (buf, buf.detach().clone())
            for sub in self.module.modules()
            if isinstance(sub, _NORM_TYPES) and sub.training
            for buf in sub.buffers(recurse=False)
        ]
        self._entries.append((is_recomputing(), saved))
        _state.recomputing = True
        if self.values is not None:
            _frames().append(_Frame(self.values, replay=True))

    def __exit__(self, *exc: object) -> None:
        if self.values is not None:
            _frames().pop()
        previous, saved = self._entries.pop()
        _state.recomputing = previous
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)


def recomputing(module: nn.Module) -> contextlib.AbstractContextManager[None]:
    """The context of a recompute pass over ``module``: side effects undone on exit.

    Snapshots the buffers of every training-mode BatchNorm in ``module`` (running mean
    and variance, ``num_batches_tracked``, any extra buffers of a subclass) when entered
    and restores them when the block exits; :func:`is_recomputing` is True inside (this
    thread). The returned object can be entered again (each backward of a
    ``retain_graph=True`` graph recomputes once).
    """
    return _Recomputing(module)


def run_checkpointed(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    fn: Callable[..., Any] | None = None,
) -> Any:
    """``fn(*args, **kwargs)`` (default ``module``) keeping only its inputs for backward.

    The one activation-recompute primitive (see the module notes): non-reentrant
    ``torch.utils.checkpoint``, so keyword arguments, non-tensor outputs, inputs that do
    not require grad and nesting work; the recomputation autograd runs in backward
    happens inside :func:`recomputing` (``module``'s BatchNorm statistics restored) with
    the forward's random number generator states, and :func:`replayed` giving back the
    forward's values.

    Args:
        module: the module whose state the call may change (its BatchNorm statistics
            are protected during the recompute).
        args: positional arguments of the call.
        kwargs: keyword arguments of the call; default none.
        fn: what to call; default ``module`` itself.

    Returns:
        The call's result; tensors in it require grad where the call's would.
    """

    def contexts() -> tuple[
        contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]
    ]:
        values: list[object] = []  # what replayed() sees in this call's forward
        return _Recording(values), _Recomputing(module, values)

    return checkpoint(
        module if fn is None else fn,
        *args,
        use_reentrant=False,
        context_fn=contexts,
        **(kwargs or {}),
    )


class CheckpointWrapper(ForwardingMixin, nn.Module):
    """A module whose forward is checkpointed (see :func:`checkpoint_wrapper`).

    Attributes:
        module: the wrapped module (parameter names appear under ``module.``;
            state-dict keys do not carry that prefix).
        offload_to_cpu: whether the region's inputs are kept in CPU memory.

    Any other attribute is the wrapped module's: ``wrapped.cnt`` reads and
    ``wrapped.cnt = 0`` writes ``module.cnt`` (see the module notes).
    """

    def __init__(self, module: nn.Module, offload_to_cpu: bool = False) -> None:
        super().__init__()
        self.offload_to_cpu = offload_to_cpu  # before `module`: stays the wrapper's own
        self.module = module
        # State dicts keep the wrapped module's own keys (no "module." prefix), so a
        # checkpoint of a wrapped model loads into the plain model and back.
        hide_child_prefix(self, "module")

    def __setattr__(self, name: str, value: Any) -> None:
        """Setting an attribute that only the wrapped module has sets it there."""
        inner = self.__dict__.get("_modules", {}).get("module")
        if (
            inner is not None
            and name not in self.__dict__
            and name not in type(self).__dict__
            and not isinstance(value, (nn.Module, nn.Parameter))
            and name not in self._parameters
            and name not in self._buffers
            and hasattr(inner, name)
        ):
            setattr(inner, name, value)
            return
        super().__setattr__(name, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or is_checkpointing_disabled():
            return self.module(*args, **kwargs)
        devices = [a.device if isinstance(a, torch.Tensor) else None for a in args]
        if self.offload_to_cpu:
            args = tuple(a.to("cpu") if isinstance(a, torch.Tensor) else a for a in args)
        return run_checkpointed(self.module, (devices, *args), kwargs, fn=self._run)

    def _run(self, devices: list[torch.device | None], *args: Any, **kwargs: Any) -> Any:
        moved = tuple(
            a.to(d) if isinstance(a, torch.Tensor) and d is not None else a
            for a, d in zip(args, devices)
        )
        return self.module(*moved, **kwargs)


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False) -> nn.Module:
    """Wrap ``module`` so its activations are recomputed in backward instead of stored.

    Example:
        >>> block = checkpoint_wrapper(nn.Sequential(nn.Linear(8, 8), nn.GELU()))
        >>> y = block(torch.randn(4, 8, requires_grad=True))
        >>> y.sum().backward()   # the Linear + GELU forward runs again here

    Args:
        module: any ``nn.Module``; its forward may take keyword arguments and return
            non-tensor values (tuples, dicts, None).
        offload_to_cpu: keep the checkpointed inputs in CPU memory between forward and
            backward (saves accelerator memory; a no-op on CPU). Default False.

    Returns:
        A :class:`CheckpointWrapper` around ``module``. Its ``state_dict()`` keys are
        ``module``'s own (no extra prefix), so checkpoints move freely between the
        wrapped and plain models. Inside FSDP, wrap the layer before FSDP wraps it
        (``FSDP(checkpoint_wrapper(block))``) so the recompute runs while the unit's
        parameters are gathered.

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``.

    Notes:
        Outputs and gradients equal the unwrapped module's; BatchNorm running
        statistics are updated once per forward, not again in the recompute. Under
        ``torch.no_grad()`` and inside :func:`disable_checkpointing` the module runs
        plainly, without checkpoint overhead. Attributes of ``module`` are reachable
        through the wrapper (``wrapped.cnt``); ``isinstance(wrapped, CheckpointWrapper)``
        is True and ``wrapped.module`` is ``module`` (FairScale returns ``module`` itself).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_wrapper expects an nn.Module, got {type(module).__name__}")
    return CheckpointWrapper(module, offload_to_cpu=offload_to_cpu)
