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
same limitation on dim 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from shardkit.checkpoint.universal.layout import TensorView
from shardkit.nn.data_parallel.fully_sharded.placement import Placement

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
    (a tensor-parallel part: :func:`shardkit.checkpoint.universal.tensor_views.view_of`
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


def _free(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _alloc(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    wanted = tensor.numel() * tensor.element_size()
    if storage.nbytes() != wanted:
        storage.resize_(wanted)


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
            None: a new buffer of ``dtype`` on ``device``, freed after the views are made.
    """

    def __init__(
        self,
        infos: list[ParamInfo],
        layout: FlatLayout,
        dtype: torch.dtype,
        device: torch.device,
        alias: torch.Tensor | None = None,
    ) -> None:
        self.owned = alias is None
        # Allocated for now: the views are made from it, then it is freed.
        self.flat = (
            torch.empty(layout.padded, dtype=dtype, device=device) if alias is None else alias
        )
        self.views = [
            nn.Parameter(
                self.flat[start : start + info.numel].view(info.shape),
                requires_grad=info.requires_grad,
            )
            for start, info in zip(layout.offsets, infos)
        ]
        self.free()

    def alloc(self) -> None:
        """Give the buffer its memory (contents undefined until gathered)."""
        if self.owned:
            _alloc(self.flat)

    def free(self) -> None:
        """Release the buffer's memory; the views stay as metadata."""
        if self.owned:
            _free(self.flat)


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
        self.local_shard = self._new_local_shard(flat)
        self._full_index: dict[int, int] = {}  # id of an unsharded parameter -> its index
        self._with_grad: set[int] = set()  # parameters in the flat gradient being reduced
        self.compute_full = self._new_full(self.placement.compute_dtype)
        self._precise_full: FullFlat | None = None
        self.full = self.compute_full  # the active one: compute_full, or full precision
        self.sharded_params = [self._sharded_view(i) for i in range(len(infos))]
        self.use_sharded()

    # construction --------------------------------------------------------------
    def _new_local_shard(self, flat: torch.Tensor) -> torch.Tensor:
        lo, hi = self.layout.shard_range(self.rank)
        padded = torch.zeros(self.layout.padded, dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()].copy_(flat)
        shard = padded[lo:hi]
        home = self.placement.to_shard_home(shard)
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

    def take_flat_grad(self) -> torch.Tensor:
        """The padded flat gradient ``(N * S,)`` of the unsharded parameters, in the
        reduce dtype on the compute device.

        Missing gradients (frozen, unused or empty parameters) and padding are zeros.
        The unsharded parameters' ``.grad`` are cleared. Parameters that had one are
        remembered for :meth:`accumulate_grad_shard` (a parameter frozen after its
        gradient was accumulated, e.g. inside ``no_sync``, keeps it, as in plain torch).
        """
        p = self.placement
        out = torch.zeros(self.layout.padded, dtype=p.reduce_dtype, device=p.compute_device)
        for index, (start, param) in enumerate(zip(self.layout.offsets, self.unsharded_params)):
            if param.grad is not None:
                out[start : start + self.infos[index].numel].copy_(param.grad.reshape(-1))
                param.grad = None
                self._with_grad.add(index)
        return out

    def accumulate_grad_shard(self, grad_shard: torch.Tensor, divide_by: float = 1.0) -> None:
        """Add a reduced gradient shard ``(S,)``, divided by ``divide_by``, into the
        sharded parameters' ``.grad`` (master dtype, on the shard device).

        A ``.grad`` that is None becomes a view of the (moved, cast) shard: no copy when
        it is already on the shard device in the master dtype.
        """
        grad_shard = self.placement.to_shard_home(grad_shard)
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
