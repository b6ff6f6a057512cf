"""ShardedDataParallel: gradient sharding (ZeRO stage 2), a drop-in for DistributedDataParallel.

The module is replicated on every rank, as with DDP; its optimizer is an
:class:`shardkit.optim.OSS` that gives each parameter an owner rank. During backward,
each gradient is reduced (averaged) only to its owner, through ordered buckets
(:mod:`shardkit.nn.data_parallel.grad_reducer`), and every other rank frees it: after
backward a rank holds the gradients of its own shard only. ``OSS.step`` then updates
the shard and broadcasts the new parameters.

Source: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", section 5.2 (P_os+g); the surface follows FairScale's
``fairscale.nn.data_parallel.ShardedDataParallel``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.profiler import record_function

from shardkit.distributed import (
    broadcast_from_owners,
    check_group,
    group_rank,
    group_ranks,
    group_size,
    plan_owner_broadcast,
)
from shardkit.distributed.compression import GradCompressor, get_compressor
from shardkit.distributed.consistency import describe_parameters, verify_consistent
from shardkit.distributed.failures import collective_context
from shardkit.distributed.validation import check_not_wrapped, check_parameters
from shardkit.nn.data_parallel.grad_reducer import GradReducer, grad_with_graph_message
from shardkit.nn.forwarding import ForwardingMixin
from shardkit.optim import OSS

__all__ = ["ShardedDDP", "ShardedDataParallel"]

_WRAPPER = "ShardedDataParallel"


def _check_optimizers(optimizers: Sequence[Any], group: dist.ProcessGroup | None) -> list[OSS]:
    for opt in optimizers:
        if not isinstance(opt, OSS):
            raise TypeError(
                f"ShardedDataParallel needs shardkit.optim.OSS optimizer(s); got "
                f"{type(opt).__module__}.{type(opt).__name__}. Shard the optimizer first: "
                "OSS(model.parameters(), optim=torch.optim.AdamW, lr=...)"
            )
        if group_ranks(opt.group) != group_ranks(group):
            raise ValueError(
                f"the OSS shards over ranks {group_ranks(opt.group)} but ShardedDataParallel "
                f"reduces over ranks {group_ranks(group)}: pass the same process group to "
                "both (OSS(..., group=pg) and ShardedDataParallel(..., process_group=pg))"
            )
    return list(optimizers)


def _check_module(module: nn.Module) -> None:
    check_not_wrapped("ShardedDataParallel", module, ShardedDataParallel)
    if next(module.parameters(), None) is None:
        raise ValueError(
            f"ShardedDataParallel: the module ({type(module).__name__}) has no parameters, "
            "so there is nothing to shard or reduce; run it unwrapped, or wrap the module "
            "that holds the parameters"
        )


class ShardedDataParallel(ForwardingMixin, nn.Module):
    """Wrap a module trained with :class:`~shardkit.optim.OSS` so each rank keeps 1/N of the grads.

    Example::

        optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=3e-4)
        model = ShardedDataParallel(model, optimizer)
        for x, y in loader:
            loss_fn(model(x), y).backward()   # each gradient reduced to its owner only
            optimizer.step()                  # owner steps, then broadcasts parameters
            optimizer.zero_grad()             # set_to_none=True is fine here

    Args:
        module: the model, identical on every rank (see ``sync_models_at_startup``).
        sharded_optimizer: one :class:`OSS` or a list of them over disjoint parameters;
            together they must cover every trainable parameter of ``module``.
        process_group: group to reduce over, the same as the optimizers'; default None
            (the world group).
        broadcast_buffers: broadcast the module's buffers (BatchNorm running stats) from
            the group's first rank before a forward, as DDP does: when the previous
            forward ran with gradients enabled outside ``no_sync``. Default True.
        sync_models_at_startup: broadcast parameters and buffers from the group's first
            rank at construction. Default True.
        reduce_buffer_size: bucket capacity, **in elements** (of the reduce dtype), as in
            FairScale; default ``2**23`` (32 MiB of fp32). A parameter larger than that is
            reduced through a bucket of its own size. ``0`` reduces each parameter alone.
        auto_refresh_trainable: at each forward, detect a change of ``requires_grad`` and
            re-partition (a collective on every rank). Default True.
        reduce_fp16: reduce in fp16, halving the traffic (the sum is taken in fp16).
            Default False.
        warn_on_trainable_params_changed: warn when a refresh happens. Default True.
        reduce_dtype: dtype to reduce in, e.g. ``torch.bfloat16``; overrides
            ``reduce_fp16``. Default None (the gradients' dtype).
        grad_compression: a gradient compressor
            (:class:`~shardkit.distributed.compression.GradCompressor`, or its name:
            ``"identity"``, ``"fp16"``, ``"bf16"``, ``"powersgd"``, ``"int8"``) each
            bucket's reduce goes through (see docs/compression.md); its state (error
            feedback) is kept per bucket. Default None: the plain exact reduce.

    Raises:
        TypeError: if an optimizer is not an :class:`OSS`, or a parameter has a complex
            dtype (a frozen integer or bool parameter is accepted, as by DDP: it is
            broadcast at construction like a buffer, never reduced).
        RuntimeError: in a training forward or backward, if a parameter's ``.grad``
            itself requires grad (``backward(create_graph=True)``, or a ``.grad`` set
            by hand): the reduction would silently drop its graph.
        ValueError: if ``module`` is (or contains) a ShardedDataParallel already, has no
            parameters or some on the meta device; if an optimizer holds parameters
            that are not the module's, a trainable parameter of the module is in no
            optimizer, two optimizers share a parameter, or the process groups differ.
        ConsistencyError: if the ranks' modules or options differ;
            ``PeerRejectedError`` (a subclass), at once, if another rank raised one of
            the errors above except the process-group and optimizer-type checks.
    """

    def __init__(
        self,
        module: nn.Module,
        sharded_optimizer: OSS | Sequence[OSS],
        process_group: dist.ProcessGroup | None = None,
        broadcast_buffers: bool = True,
        sync_models_at_startup: bool = True,
        reduce_buffer_size: int = 2**23,
        auto_refresh_trainable: bool = True,
        reduce_fp16: bool = False,
        warn_on_trainable_params_changed: bool = True,
        reduce_dtype: torch.dtype | None = None,
        grad_compression: GradCompressor | str | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        opts = (
            list(sharded_optimizer)
            if isinstance(sharded_optimizer, (list, tuple))
            else [sharded_optimizer]
        )
        # before the exchange: a rank on another group would exchange with other peers
        check_group(process_group, "ShardedDataParallel")
        self.sharded_optimizers = _check_optimizers(opts, process_group)
        self.process_group = process_group
        self.world_size = group_size(process_group)
        self.rank = group_rank(process_group)
        self.broadcast_buffers = broadcast_buffers
        self.reduce_buffer_size = reduce_buffer_size
        self.auto_refresh_trainable = auto_refresh_trainable
        self.warn_on_trainable_params_changed = warn_on_trainable_params_changed
        self.reduce_dtype = reduce_dtype or (torch.float16 if reduce_fp16 else None)
        self.grad_compression = get_compressor(grad_compression)
        options: dict[str, Any] = {
            "reduce_buffer_size": reduce_buffer_size,
            "reduce_dtype": self.reduce_dtype,
        }
        if self.grad_compression is not None:
            options["grad_compression"] = repr(self.grad_compression)
        self._reducer: GradReducer | None = None
        # As DDP: buffers are broadcast before a forward that follows a forward with
        # gradients and synchronisation on (not after no_sync or no_grad forwards).
        self._require_forward_param_sync = True
        verify_consistent(
            describe_parameters(module.named_parameters()),
            what="ShardedDataParallel",
            group=process_group,
            options=options,
            local_error=self._local_problem(),  # a bad input on one rank stops every rank
        )
        if sync_models_at_startup:
            self._broadcast_from_first_rank([p.detach() for p in module.parameters()])
            self._broadcast_from_first_rank(list(module.buffers()))
        self._build_reducer()

    # attributes DDP code reads -----------------------------------------------------
    @property
    def is_multi_device_module(self) -> bool:
        """Whether the module's parameters sit on more than one device (as DDP's)."""
        return len({p.device for p in self.module.parameters()}) > 1

    @property
    def device_type(self) -> str:
        """``"cpu"`` or ``"cuda"``: the device type of the module's first parameter."""
        first = next(self.module.parameters(), None)
        return "cpu" if first is None else first.device.type

    # set-up --------------------------------------------------------------------------
    def _local_problem(self) -> TypeError | ValueError | None:
        """This rank's own checks of the module and optimizers, for the wrap-time
        exchange (:func:`verify_consistent`'s ``local_error``)."""
        try:
            _check_module(self.module)
            check_parameters(
                "ShardedDataParallel", self.module.named_parameters(), allow_frozen_integer=True
            )
            self._owners()  # the optimizers hold exactly the module's trainable parameters
        except (TypeError, ValueError) as error:
            return error
        return None

    def _owners(self) -> dict[nn.Parameter, int]:
        module_params = set(self.module.parameters())
        owner: dict[nn.Parameter, int] = {}
        for opt in self.sharded_optimizers:
            foreign = [p for p in opt._all_params() if p not in module_params]
            if foreign:
                shapes = [tuple(p.shape) for p in foreign[:5]]
                raise ValueError(
                    f"{len(foreign)} parameters of the OSS (shapes {shapes}) are not "
                    "parameters of the wrapped module: build the OSS from this module's "
                    "parameters(), and wrap the same module"
                )
            for p, rank in opt.param_to_rank.items():
                if p in owner:
                    raise ValueError(
                        f"a parameter of shape {tuple(p.shape)} is in two OSS optimizers; "
                        "give each optimizer disjoint parameters"
                    )
                owner[p] = rank  # type: ignore[index]
        orphans = [p for p in self.module.parameters() if p.requires_grad and p not in owner]
        if orphans:
            raise ValueError(
                f"{len(orphans)} trainable parameters of the module (shapes "
                f"{[tuple(p.shape) for p in orphans[:5]]}) are in no OSS optimizer: pass "
                "them to one, or set requires_grad=False"
            )
        return owner

    def _build_reducer(self) -> None:
        if self._reducer is not None:
            self._reducer.remove_hooks()
        owner = self._owners()
        ordered = [p for p in reversed(list(self.module.parameters())) if p in owner]
        self._reducer = GradReducer(
            ordered,
            owner,
            self.process_group,
            self.reduce_buffer_size,
            self.reduce_dtype,
            grad_compression=self.grad_compression,
        )
        self._reducer.register_hooks()
        self._signature = self._trainable_signature()

    def _trainable_signature(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in self.module.parameters())

    def refresh_trainable(self) -> None:
        """Re-partition after ``requires_grad`` changed (a collective on every rank).

        Calls :meth:`OSS.refresh_trainable` on each optimizer, then rebuilds the buckets.
        """
        with record_function("ShardedDDP::refresh_trainable"):
            for opt in self.sharded_optimizers:
                opt.refresh_trainable()
            self._build_reducer()

    # runtime ------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Refresh the partition if needed, broadcast buffers (as DDP), run the module."""
        with record_function("ShardedDDP::pre_forward"):
            if self.auto_refresh_trainable and self._trainable_signature() != self._signature:
                if self.warn_on_trainable_params_changed:
                    warnings.warn(
                        "ShardedDataParallel: requires_grad of some parameters changed; "
                        "re-partitioning the optimizer state and gradient buckets",
                        stacklevel=2,
                    )
                self.refresh_trainable()
            if self.broadcast_buffers and self._require_forward_param_sync:
                self.sync_buffers()
            assert self._reducer is not None
            if self.training and torch.is_grad_enabled():
                self._check_grads_without_graph()
        self._require_forward_param_sync = torch.is_grad_enabled() and self._reducer.sync
        return self.module(*args, **kwargs)

    def _check_grads_without_graph(self) -> None:
        """Refuse a trainable parameter whose ``.grad`` requires grad (FairScale does too):
        the reduction copies gradients into buckets and would drop that graph."""
        for name, p in self.module.named_parameters():
            if p.requires_grad and p.grad is not None and p.grad.requires_grad:
                raise RuntimeError(grad_with_graph_message(name))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backwards inside accumulate locally, no communication.

        The first backward after the context reduces the accumulated gradients.
        """
        assert self._reducer is not None
        previous, self._reducer.sync = self._reducer.sync, False
        try:
            yield
        finally:
            self._reducer.sync = previous

    def reduce(self) -> None:
        """Reduce the gradients held now to their owners (for loops that end with
        ``no_sync`` backwards): a collective on every rank."""
        assert self._reducer is not None
        with record_function("ShardedDDP::reduce"):
            self._reducer.reduce_held()

    @torch.no_grad()
    def sync_buffers(self) -> None:
        """Broadcast the module's buffers from the group's first rank (a collective).

        As torch DDP, the broadcast keeps the buffers' autograd version counters: a
        graph that saved a buffer (an eval-mode BatchNorm saves its running statistics)
        still backpropagates after the next forward's broadcast, with the new values.
        """
        buffers = list(self.module.buffers())
        preserve = _unsafe_preserve_version_counter(tuple(buffers))
        with record_function("ShardedDDP::sync_buffers"), preserve:
            self._broadcast_from_first_rank(buffers)

    def _broadcast_from_first_rank(self, tensors: list[torch.Tensor]) -> None:
        if self.world_size == 1 or not tensors:
            return
        owned: list[list[torch.Tensor]] = [tensors] + [[] for _ in range(self.world_size - 1)]
        group = self.process_group
        with torch.no_grad(), collective_context(_WRAPPER, "broadcast from rank 0", group):
            broadcast_from_owners(plan_owner_broadcast(owned, 2**24), group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or free) the module's gradients and forget reduced ones."""
        self.module.zero_grad(set_to_none=set_to_none)
        if self._reducer is not None:
            self._reducer.clear()


ShardedDDP = ShardedDataParallel
