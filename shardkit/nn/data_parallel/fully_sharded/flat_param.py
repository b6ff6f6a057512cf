"""The flat parameter of one unit: layout, padding, shard, and the views users see.

[Note: flat layout, original parameters]
A unit's parameters are flattened in module order into one buffer of ``total``
elements, padded with zeros to ``padded = ceil(total / N) * N`` (at most N - 1 padding
elements per unit), and rank r keeps the contiguous slice ``[r * S, (r + 1) * S)`` with
``S = padded / N`` (the *local shard*). Communication is one all-gather and one
reduce-scatter of that buffer per unit, and the full parameters are plain views into
the gathered buffer: no copy in, no copy out.

What the optimizer and ``named_parameters()`` see are the *sharded parameters*: for
every original parameter, one ``nn.Parameter`` under its original name, which is a 1-D
view of the part of the local shard that belongs to it (possibly empty on some ranks).
The optimizer steps these views, so it updates the local shard in place, and
per-parameter settings (no weight decay on biases and norms, chosen by name) work as
on the unwrapped model. During forward and backward the module's attributes are
swapped for the *unsharded parameters*: full-shape ``nn.Parameter`` views of the
gathered buffer, created once and reused, whose gradients autograd accumulates.

The price: a shape-dependent optimizer sees a 1-D piece of each parameter, different
on each rank. Element-wise optimizers (SGD, Adam, AdamW, Adagrad, RMSprop) are exact;
optimizers that take a norm per tensor (LAMB, LARS), factor the second moment
(Adafactor) or precondition by matrix (Shampoo) would compute on the piece, not on the
tensor. FairScale's flat parameters hide the names too; torch's FSDP2 shards each
parameter on dim 0 (per-parameter padding, a copy after each all-gather) and has the
same limitation on dim 0. Such optimizers are refused over the shards
(``sharing.refuse_whole_tensor_optimizer``) and stepped exactly by
:class:`shardkit.optim.WholeTensorOptimizer` (each parameter whole on one owner rank).

Why this module is long: FlatParamHandle is one object (the flat buffer, its shard and
the views over both) whose methods keep the views and buffers in step; split over files,
that one invariant would be too. It is just over the limit.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from shardkit.distributed.shard_descriptor import TensorView
from shardkit.nn.data_parallel.fully_sharded.placement import Placement
from shardkit.nn.data_parallel.fully_sharded.unit_buffers import (
    GRADIENTS,
    PARAMETERS,
    SHARDS,
    UnitBuffer,
)

__all__ = ["FlatLayout", "FlatParamHandle", "FullFlat", "ParamInfo", "ParamLocation"]


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter sits in a unit's flat buffer, and which rank owns what.

    Args:
        numels: elements of each parameter, in flat order.
        world_size: N, the number of ranks sharing the unit.
    """

    numels: tuple[int, ...]
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1; got {self.world_size}")
        if any(n < 0 for n in self.numels):
            raise ValueError(f"numels must be >= 0; got {self.numels}")

    @property
    def offsets(self) -> tuple[int, ...]:
        """Start of each parameter in the flat buffer (elements)."""
        starts, acc = [], 0
        for n in self.numels:
            starts.append(acc)
            acc += n
        return tuple(starts)

    @property
    def total(self) -> int:
        """Elements of all parameters, without padding."""
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        """S: elements each rank keeps, padding included."""
        return math.ceil(self.total / self.world_size)

    @property
    def padded(self) -> int:
        """N * S: elements of the full flat buffer, padding included."""
        return self.shard_numel * self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of rank ``rank``'s shard in flat coordinates."""
        s = self.shard_numel
        return rank * s, (rank + 1) * s

    def piece(self, index: int, rank: int) -> tuple[int, int]:
        """``[start, end)`` of parameter ``index``'s piece inside rank ``rank``'s shard.

        Local coordinates (0 is the first element of the shard); empty when the rank
        owns none of the parameter (then ``start == end``).
        """
        lo, hi = self.shard_range(rank)
        start = self.offsets[index]
        a, b = max(start, lo), min(start + self.numels[index], hi)
        if b <= a:
            return 0, 0
        return a - lo, b - lo


@dataclass
class ParamLocation:
    """One place a parameter is registered: ``module._parameters[attr]``.

    Attributes:
        module: the owning module.
        attr: attribute name on ``module``.
        name: dotted name relative to the unit's wrapped module (``"blocks.0.ln_1.weight"``).
    """

    module: nn.Module
    attr: str
    name: str


@dataclass
class ParamInfo:
    """One unique original parameter of a unit (tied parameters have several locations).

    ``view``: what the original parameter is a part of, for the universal checkpoint
    (a tensor-parallel part: :func:`shardkit.distributed.shard_descriptor.view_of`
    of the original, taken at wrap time, since the sharded parameters replace it).
    """

    shape: torch.Size
    requires_grad: bool
    locations: list[ParamLocation] = field(default_factory=list)
    view: TensorView | None = None

    @property
    def numel(self) -> int:
        """Elements of the parameter."""
        return math.prod(self.shape)

    @property
    def name(self) -> str:
        """The first location's dotted name."""
        return self.locations[0].name


def _row_pieces(start: int, length: int, row: int) -> list[tuple[int, ...]]:
    """``length`` elements from ``start`` of a row-major parameter with rows of ``row``
    elements (0: a vector) as (partial row,) (rows, row) (partial row,) pieces."""
    if row <= 1:
        return [(length,)]
    head = min(length, (-start) % row)
    rows = (length - head) // row
    tail = length - head - rows * row
    pieces: list[tuple[int, ...]] = [(head,)] if head else []
    if rows:
        pieces.append((rows, row))
    return pieces + [(tail,)] if tail else pieces


class FullFlat:
    """A full flat buffer ``(N * S,)`` and the full-shape parameter views into it.

    Args:
        infos: the unit's parameters, in flat order.
        layout: the unit's flat layout.
        alias: the buffer to use (the local shard, when it is the full buffer); default
            None: the unit's own :class:`~.unit_buffers.UnitBuffer` of ``dtype`` on
            ``device`` (released until :meth:`alloc`).
    """

    def __init__(
        self,
        infos: list[ParamInfo],
        layout: FlatLayout,
        dtype: torch.dtype,
        device: torch.device,
        alias: torch.Tensor | None = None,
    ) -> None:
        self.buffer: UnitBuffer | None = None
        if alias is None:
            self.buffer = UnitBuffer(layout.padded, dtype, device, PARAMETERS)
            alias = self.buffer.tensor
        self.flat = alias
        self.views = [
            nn.Parameter(
                self.flat[start : start + info.numel].view(info.shape),
                requires_grad=info.requires_grad,
            )
            for start, info in zip(layout.offsets, infos)
        ]

    def alloc(self) -> None:
        """Give the buffer its memory (contents undefined until gathered)."""
        if self.buffer is not None:
            self.buffer.acquire()

    def free(self) -> None:
        """Release the buffer's memory; the buffer and its views stay valid (see
        [Note: keep the storage, give back the pages] in :mod:`.unit_buffers`)."""
        if self.buffer is not None:
            self.buffer.release()


class FlatParamHandle:
    """The tensors of one unit: local shard, full flat buffer, sharded and unsharded views.

    Built from the unit's original parameters (identical on every rank; the caller
    broadcasts first). Afterwards the module's attributes hold the sharded parameters.

    Args:
        infos: the unit's unique parameters, in flat order.
        flat: the full, unpadded concatenation of the original parameters, ``(total,)``.
        rank: this rank's index in the unit's process group.
        world_size: N.
        placement: devices and dtypes (see :mod:`.placement`); default None: everything
            on ``flat``'s device in ``flat``'s dtype.
    """

    def __init__(
        self,
        infos: list[ParamInfo],
        flat: torch.Tensor,
        rank: int,
        world_size: int,
        placement: Placement | None = None,
    ) -> None:
        self.infos = infos
        self.rank = rank
        self.layout = FlatLayout(tuple(i.numel for i in infos), world_size)
        self.placement = placement or Placement(
            flat.device, flat.device, flat.dtype, flat.dtype, flat.dtype
        )
        self.shard_buffer: UnitBuffer | None = None  # the disk tier's local shard memory
        self.local_shard = self._new_local_shard(flat)
        self._full_index: dict[int, int] = {}  # id of an unsharded parameter -> its index
        self._with_grad: set[int] = set()  # parameters in the flat gradient being reduced
        self.compute_full = self._new_full(self.placement.compute_dtype)
        self._precise_full: FullFlat | None = None
        self.full = self.compute_full  # the active one: compute_full, or full precision
        self.sharded_params = [self._sharded_view(i) for i in range(len(infos))]
        self._grad: UnitBuffer | None = None  # the full flat gradient, made at the first one
        self._grad_views: list[torch.Tensor] = []
        self._grad_taken = False  # handed to a reduction: stale once that is done
        self._grad_pointed: set[int] = set()  # .grad pointed into it since it was zeros
        self._grad_hooked: set[int] = set()
        for index in self.trainable:
            self._hook_grad(index)
        self.use_sharded()

    # construction --------------------------------------------------------------
    def _new_local_shard(self, flat: torch.Tensor) -> torch.Tensor:
        lo, hi = self.layout.shard_range(self.rank)
        padded = torch.zeros(self.layout.padded, dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()].copy_(flat)
        shard = padded[lo:hi]
        home = self.placement.to_shard_home(shard)
        if self.placement.on_disk:
            # a page-aligned buffer at a fixed address, its memory given back between
            # the unit's uses: direct I/O reads and writes it in place (no bounce copy)
            self.shard_buffer = UnitBuffer(hi - lo, home.dtype, home.device, SHARDS)
            self.shard_buffer.acquire()
            self.shard_buffer.tensor.copy_(home)
            return self.shard_buffer.tensor
        return home.clone() if home is shard else home  # not a view into ``padded``

    def _new_full(self, dtype: torch.dtype) -> FullFlat:
        p = self.placement
        is_shard = (
            self.layout.world_size == 1 and dtype == p.master_dtype and not p.offloaded
        )  # the shard is the full buffer: nothing to gather
        alias = self.local_shard if is_shard else None
        full = FullFlat(self.infos, self.layout, dtype, p.compute_device, alias)
        self._full_index.update({id(view): i for i, view in enumerate(full.views)})
        return full

    def _sharded_view(self, index: int) -> nn.Parameter:
        a, b = self.layout.piece(index, self.rank)
        info = self.infos[index]
        return nn.Parameter(self.local_shard[a:b], requires_grad=info.requires_grad)

    def set_requires_grad(self, index: int, requires_grad: bool) -> None:
        """Make parameter ``index`` trainable or frozen in every form (sharded, unsharded)."""
        self.infos[index].requires_grad = requires_grad
        forms = [self.sharded_params, self.compute_full.views]
        if self._precise_full is not None:
            forms.append(self._precise_full.views)
        for params in forms:
            params[index].requires_grad_(requires_grad)
        if requires_grad:
            self._hook_grad(index)

    def as_sharded(self, param: nn.Parameter) -> nn.Parameter:
        """The sharded parameter of ``param`` if it is one of the unit's unsharded
        (full-shape) parameters, else ``param`` itself."""
        index = self._full_index.get(id(param))
        return param if index is None else self.sharded_params[index]

    @property
    def unsharded_params(self) -> list[nn.Parameter]:
        """The full-shape parameters of forward and backward (compute dtype)."""
        return self.compute_full.views

    # the module's attributes ---------------------------------------------------
    def _install(self, params: list[nn.Parameter]) -> None:
        for info, param in zip(self.infos, params):
            for loc in info.locations:
                loc.module._parameters[loc.attr] = param

    def use_sharded(self) -> None:
        """Point every location at its sharded (1-D piece) parameter."""
        self._install(self.sharded_params)

    def use_unsharded(self) -> None:
        """Point every location at its unsharded (full-shape) parameter of the active
        full buffer."""
        self._install(self.full.views)

    # the full flat buffer ------------------------------------------------------
    @property
    def full_flat(self) -> torch.Tensor:
        """The active full flat buffer ``(N * S,)``."""
        return self.full.flat

    @property
    def owns_full_flat(self) -> bool:
        """False when the full buffer is the local shard (N == 1, no cast, no offload)."""
        return self.full.flat is not self.local_shard

    def use_full_precision(self, enabled: bool) -> None:
        """Gather into a master-dtype full buffer (``summon_full_params``) or, with
        ``enabled=False``, into the compute-dtype one. Call while sharded."""
        if not enabled or self.placement.compute_dtype == self.placement.master_dtype:
            self.full = self.compute_full
            return
        if self._precise_full is None:
            self._precise_full = self._new_full(self.placement.master_dtype)
            for view, info in zip(self._precise_full.views, self.infos):
                view.requires_grad_(info.requires_grad)
        self.full = self._precise_full

    def gather_source(self) -> torch.Tensor:
        """The local shard on the compute device in the active buffer's dtype, ``(S,)``."""
        return self.placement.to_compute(self.local_shard, self.full.flat.dtype)

    def alloc_full(self) -> None:
        """Give the full flat buffer its memory (contents undefined until gathered)."""
        self.full.alloc()

    def free_full(self) -> None:
        """Release the full flat buffer's memory; the unsharded views stay as metadata."""
        self.full.free()

    def full_shard_slice(self) -> torch.Tensor:
        """This rank's slice of the full flat buffer, ``(S,)``."""
        lo, hi = self.layout.shard_range(self.rank)
        return self.full.flat[lo:hi]

    # gradients -----------------------------------------------------------------
    def flat_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the consecutive pieces of the padded flat buffer ``(N * S,)``: every
        parameter's, then the padding as a vector (for a gradient compressor)."""
        shapes = [tuple(info.shape) if info.numel else (0,) for info in self.infos]
        padding = self.layout.padded - self.layout.total
        return shapes + [(padding,)] if padding else shapes

    def shard_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the consecutive pieces of this rank's shard ``(S,)``: for each
        parameter's piece, its whole rows as a ``(rows, row length)`` matrix and any
        partial row before or after them as vectors; padding as a vector (so a
        low-rank compressor sees matrices where the shard holds whole rows)."""
        out: list[tuple[int, ...]] = []
        lo, hi = self.layout.shard_range(self.rank)
        for index, info in enumerate(self.infos):
            a, b = self.layout.piece(index, self.rank)
            if b <= a:
                continue
            start = lo + a - self.layout.offsets[index]  # within the parameter
            row = info.numel // info.shape[0] if len(info.shape) >= 2 and info.shape[0] else 0
            out += _row_pieces(start, b - a, row)
        used = sum(math.prod(shape) for shape in out)
        if used < hi - lo:
            out.append((hi - lo - used,))
        return out

    @property
    def trainable(self) -> list[int]:
        """Indices of parameters that require a gradient."""
        return [i for i, info in enumerate(self.infos) if info.requires_grad]

    @property
    def has_frozen(self) -> bool:
        """True if some parameter of the unit does not require a gradient."""
        return any(not info.requires_grad for info in self.infos)

    # [Note: the flat gradient buffer]
    # A unit's full gradient lives in one UnitBuffer ``(N * S,)`` of the compute dtype
    # (see .unit_buffers). A tensor hook on each trainable unsharded parameter runs just
    # before autograd accumulates its gradient and points the parameter's ``.grad`` at
    # the parameter's place in the buffer; autograd then adds into it in place (under
    # no_sync, micro-batch after micro-batch), so no per-parameter gradient is allocated
    # and take_flat_grad copies nothing. The buffer goes to the reduce-scatter as is and
    # is released when the reduced shard was accumulated (accumulate_grad_shard), or at
    # the latest when the next gradient arrives. Released memory reads as zeros, which
    # is what frozen and unused parameters and the padding contribute.
    def _hook_grad(self, index: int) -> None:
        view = self.compute_full.views[index]
        if index not in self._grad_hooked and view.requires_grad and view.numel():
            view.register_hook(functools.partial(_point_grad_into_buffer, self, index))
            self._grad_hooked.add(index)

    def _grad_buffer(self) -> UnitBuffer:
        """The flat gradient buffer, resident, holding only the live unsharded ``.grad``
        (zeros elsewhere)."""
        p = self.placement
        if self._grad is None:
            self._grad = UnitBuffer(
                self.layout.padded, p.compute_dtype, p.compute_device, GRADIENTS
            )
            flat = self._grad.tensor
            self._grad_views = [
                flat[start : start + info.numel].view(info.shape)
                for start, info in zip(self.layout.offsets, self.infos)
            ]
        self.release_flat_grad()  # a reduction took it and is done with it
        self._grad.acquire(zero=True)
        return self._grad

    def point_grad(self, index: int) -> None:
        """Before autograd accumulates a gradient into unsharded parameter ``index``:
        make its ``.grad`` the parameter's view of the flat gradient buffer unless it has
        a gradient already (see [Note: the flat gradient buffer])."""
        param = self.unsharded_params[index]
        if param.grad is None and param.requires_grad:
            self._grad_buffer()
            param.grad = self._grad_views[index]
            self._grad_pointed.add(index)

    def _is_grad_view(self, index: int, grad: torch.Tensor) -> bool:
        view = self._grad_views[index] if self._grad_views else None
        return view is not None and grad.data_ptr() == view.data_ptr() and grad.shape == view.shape

    def take_flat_grad(self) -> torch.Tensor:
        """The padded flat gradient ``(N * S,)`` of the unsharded parameters, in the
        reduce dtype on the compute device: the flat gradient buffer itself when the
        reduce dtype is the compute dtype (released by :meth:`accumulate_grad_shard` or
        :meth:`release_flat_grad`), else a cast copy.

        Missing gradients (frozen, unused or empty parameters) and padding are zeros.
        The unsharded parameters' ``.grad`` are cleared. Parameters that had one are
        remembered for :meth:`accumulate_grad_shard` (a parameter frozen after its
        gradient was accumulated, e.g. inside ``no_sync``, keeps it, as in plain torch).
        """
        buffer = self._grad_buffer()
        for index, param in enumerate(self.unsharded_params):
            grad, view = param.grad, self._grad_views[index]
            if grad is None:
                if index in self._grad_pointed:
                    view.zero_()  # a .grad pointed here was dropped
                continue
            if not self._is_grad_view(index, grad):  # create_graph, or assigned by hand
                view.copy_(grad)
            param.grad = None
            self._with_grad.add(index)
        self._grad_taken = True
        reduce_dtype = self.placement.reduce_dtype
        if buffer.tensor.dtype == reduce_dtype:
            return buffer.tensor
        out = buffer.tensor.to(reduce_dtype)
        self.release_flat_grad()
        return out

    def drop_flat_grad(self) -> None:
        """Forget the unsharded gradients (accumulated inside ``no_sync``): the unsharded
        parameters' ``.grad`` cleared and the flat gradient buffer given back, so the
        next backward starts from zeros. Between steps only (no reduction in flight)."""
        for param in self.unsharded_params:
            param.grad = None
        self._give_back_flat_grad()

    def release_flat_grad(self) -> None:
        """Give back the flat gradient buffer's memory once a reduction is done with it
        (a no-op unless :meth:`take_flat_grad` handed it out)."""
        if self._grad_taken:
            self._give_back_flat_grad()

    def _give_back_flat_grad(self) -> None:
        if self._grad is not None:
            self._grad.release()
        self._grad_taken = False
        self._grad_pointed.clear()

    def accumulate_grad_shard(self, grad_shard: torch.Tensor, divide_by: float = 1.0) -> None:
        """Add a reduced gradient shard ``(S,)``, divided by ``divide_by``, into the
        sharded parameters' ``.grad`` (master dtype, on the shard device), then release
        the flat gradient buffer (the reduction is done with it).

        A ``.grad`` that is None becomes a view of the (moved, cast) shard: no copy when
        it is already on the shard device in the master dtype and not a part of the
        flat gradient buffer (one rank: the shard is the buffer; it is copied).
        """
        grad_shard = self.placement.to_shard_home(grad_shard)
        if self._grad is not None and _same_storage(grad_shard, self._grad.tensor):
            grad_shard = grad_shard.clone()
        if divide_by != 1.0:
            grad_shard.div_(divide_by)
        indices = sorted(set(self.trainable) | self._with_grad)
        self._with_grad.clear()
        for index in indices:
            a, b = self.layout.piece(index, self.rank)
            param, piece = self.sharded_params[index], grad_shard[a:b]
            if param.grad is None:
                param.grad = piece
            else:
                param.grad.add_(piece)
        self.release_flat_grad()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _point_grad_into_buffer(handle: FlatParamHandle, index: int, grad: torch.Tensor) -> None:
    handle.point_grad(index)
