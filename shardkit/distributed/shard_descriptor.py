"""The shard descriptor: which piece of an original tensor a rank's local tensor is.

Every producer of split or replicated tensors (tensor-parallel layers and plans today;
any new parallelism tomorrow) describes a local tensor with one :class:`TensorView`,
recorded on the tensor itself (:func:`set_view`, attribute ``universal_view``), and
every consumer (the universal checkpoint's adapters, FSDP's flattening, gradient-norm
and state-dict helpers) reads it back with :func:`view_of`. An attribute, not a table:
it survives ``copy.deepcopy`` and travels with the parameter object. This module knows
no wrapper and reads no global (no registered mesh); the element arithmetic of a view
is :mod:`shardkit.distributed.shard_elements`.

[Note: who writes a replicated tensor]
A checkpoint needs exactly one writer per element. Two kinds of copies exist:

- the copies a data-parallel wrapper keeps (DDP, OSS, FSDP's shard and replica groups):
  the wrapper's checkpoint adapter knows its own process group and picks one writer
  per piece itself (DDP spreads a tensor over its group, FSDP writes each shard once);
- the copies the producer of the descriptor made, which no wrapper knows about: a
  tensor every tensor-parallel rank holds whole (a LayerNorm weight, a row-parallel
  bias) is recorded with ``replicate_group`` = the tensor-parallel group.

:func:`writes_replica` combines the two from the descriptor alone: the adapter passes
the global ranks it de-duplicates over (``holders``), and this rank writes its copy
when the lowest rank of the replica group is among them. For a tensor-parallel rank
``t`` under DDP over its data-parallel group ``D_t``, the lowest rank of the
tensor-parallel group is in ``D_t`` exactly when ``t = 0``: tensor-parallel rank 0's
data-parallel group writes it, spread over its ranks as DDP does. The same test is
right for every wrapper whose group holds copies of the same piece (DDP, OSS, SDP,
FSDP's shard group, a pipeline stage alone with ``holders`` None), and it holds when
the replica group also lists the data-parallel holders (a mesh given to
``parallelize``).

A plain module (no data-parallel wrapper) saved over a group ``W`` is the one case
where the group's ranks hold whole *model* copies rather than copies of one piece: the
holders of part ``p`` are rank ``p`` of every tensor-parallel group in ``W``.
:func:`writes_part` picks the tensor-parallel group (``split_group``) holding the
lowest rank of ``W``, which needs no global and no collective; a replica group given
explicitly (the part's data-parallel holders) decides instead.

[Note: groups as rank tuples]
``split_group`` and ``replicate_group`` are sorted tuples of *global* ranks, not
``ProcessGroup`` objects: a descriptor is pickled (``all_gather_object`` in the save's
agreement) and deep-copied with the model, and a ``ProcessGroup`` is neither
picklable nor meaningful in another process. They are ``compare=False`` and
``repr=False``: two descriptors of the same piece of data compare (and hash) equal
whichever ranks hold them, which is what the checkpoint planner matches on; the
checkpoint serialises the data fields only (``SavedPiece.to_json``).

[Note: the mesh dimension of a split]
A split is over one dimension of the process mesh: ``"tp"`` for the tensor-parallel
layers, ``"ep"`` for the stacked experts of an MoE layer (dim 0, one block of experts
per expert-parallel rank). ``mesh_dim`` records which, so a reader that means one kind
(tensor parallel's gradient norm, its consolidated state dict, ``compose``'s
tensor-parallel keys) does not take the other for it. Like the groups it says who holds
the parts, not what the data is: it is left out of equality and of the checkpoint, and
None (a view made by hand, or read back from a checkpoint) means "not recorded", which
tensor-parallel readers take as ``"tp"`` (the only split that existed before).

[Note: several splits]
A tensor can be split over several mesh dimensions at once: tensor parallel inside each
expert cuts an MoE layer's stacked ``(E, M, F)`` weight on dim 0 over ``ep`` and on dim
2 over ``tp``. A view holds an ordered tuple of :class:`Split` (:attr:`TensorView.splits`),
each on a *different* dimension of the global tensor, so the local tensor is the same
whichever order the cuts are made in. The first split keeps the fields a single-split
view always had (``split_dim``, ``part``, ``parts``, ``stride``, ``split_group``,
``mesh_dim``), so every single-split view, constructor call and checkpoint file reads
and compares exactly as before; the others are in ``inner_splits``. Equality compares
every split's data (dimension, part, parts, stride), never its group or mesh
dimension. A writer of a checkpoint with ``inner_splits`` appends them to the piece's
``view`` record; a reader of a file without them gets ``()``.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardkit.distributed.collectives import group_ranks

__all__ = [
    "VIEW_ATTRIBUTE",
    "Ranks",
    "Split",
    "TensorView",
    "ranks_of",
    "set_view",
    "view_of",
    "writes_part",
    "writes_replica",
]

#: A process group as the sorted global ranks of its members.
Ranks = tuple[int, ...]

#: The tensor attribute holding a local tensor's :class:`TensorView`.
VIEW_ATTRIBUTE = "universal_view"


@dataclass(frozen=True)
class Split:
    """One split of a tensor over one mesh dimension (see ``[Note: several splits]``).

    Dimension ``dim`` of the tensor is cut into ``stride * parts`` equal blocks and
    part ``part`` keeps blocks ``part, part + parts, ...``, concatenated.

    Attributes:
        dim: the dimension split (of the global tensor).
        part: this rank's part, in ``[0, parts)``. Default 0.
        parts: the number of parts (the degree of the mesh dimension). Default 1.
        stride: interleaved blocks per part. Default 1.
        group: the global ranks the tensor is split over (sorted), part ``i`` on the
            ``i``-th; None when not known. Left out of equality.
        mesh_dim: the process-mesh dimension (``"tp"``, ``"ep"``), or None: not
            recorded. Left out of equality.
    """

    dim: int
    part: int = 0
    parts: int = 1
    stride: int = 1
    group: Ranks | None = field(default=None, compare=False, repr=False)
    mesh_dim: str | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class TensorView:
    """How a rank's local tensor relates to the original (global) tensor.

    ``split_dim is None``: the local tensor *is* the global tensor (shape
    ``global_shape``). Otherwise it is the tensor-parallel shard
    ``shardkit.nn.tensor_parallel.partition.shard(global, split_dim, part, parts,
    stride)``: dim ``split_dim`` cut into ``stride * parts`` equal blocks, part ``p``
    keeps blocks ``p, p + parts, ...`` (stride 3 for a fused ``[q | k | v]``),
    concatenated.

    Attributes:
        global_shape: the original tensor's shape.
        split_dim: the dimension split across ``split_group``, or None (held whole).
        part: this rank's part, in ``[0, parts)``. Default 0.
        parts: the number of parts (the tensor-parallel degree). Default 1.
        stride: interleaved blocks per part. Default 1.
        split_group: the global ranks the tensor is split over, part ``i`` on the
            ``i``-th of them (sorted); None when not known (a view made by hand).
        replicate_group: the global ranks holding copies identical to this local
            tensor that no wrapper de-duplicates (see ``[Note: who writes a replicated
            tensor]``), sorted; None: no such copies are known.
        mesh_dim: the process-mesh dimension the split is over (``"tp"``, ``"ep"``),
            or None: not recorded (see ``[Note: the mesh dimension of a split]``).
        inner_splits: the further splits, each on another dimension (see ``[Note:
            several splits]``); needs ``split_dim`` set. Default ``()``: one split
            (or none).

    The two groups and ``mesh_dim`` are left out of equality, hashing and ``repr``
    (see ``[Note: groups as rank tuples]``); ``inner_splits`` is in all three (shown
    in ``repr`` when not empty).
    """

    global_shape: tuple[int, ...]
    split_dim: int | None = None
    part: int = 0
    parts: int = 1
    stride: int = 1
    split_group: Ranks | None = field(default=None, compare=False, repr=False)
    replicate_group: Ranks | None = field(default=None, compare=False, repr=False)
    mesh_dim: str | None = field(default=None, compare=False, repr=False)
    inner_splits: tuple[Split, ...] = field(default=(), repr=False)

    @classmethod
    def of_splits(
        cls,
        global_shape: tuple[int, ...],
        splits: tuple[Split, ...],
        replicate_group: Ranks | None = None,
    ) -> TensorView:
        """The view of ``splits`` applied to a tensor of ``global_shape`` (no split:
        the whole tensor), copies on ``replicate_group``.

        Example::

            # expert block 1 of 2 over ep, hidden part 0 of 2 over tp, of an (8, 16, 64) w1
            TensorView.of_splits((8, 16, 64), (Split(0, 1, 2, mesh_dim="ep"),
                                               Split(2, 0, 2, mesh_dim="tp")))
        """
        if not splits:
            return cls(global_shape, replicate_group=replicate_group)
        first, *inner = splits
        return cls(
            global_shape,
            first.dim,
            first.part,
            first.parts,
            first.stride,
            split_group=first.group,
            replicate_group=replicate_group,
            mesh_dim=first.mesh_dim,
            inner_splits=tuple(inner),
        )

    @property
    def splits(self) -> tuple[Split, ...]:
        """Every split, in order (``()`` for a whole tensor); the first is the one in
        ``split_dim``, ``part``, ``parts``, ``stride``, ``split_group`` and ``mesh_dim``."""
        if self.split_dim is None:
            return self.inner_splits
        first = Split(
            self.split_dim, self.part, self.parts, self.stride, self.split_group, self.mesh_dim
        )
        return (first, *self.inner_splits)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the local tensor: ``global_shape`` with each split's dimension
        divided by its ``parts``."""
        if self.split_dim is None and not self.inner_splits:
            return self.global_shape
        shape = list(self.global_shape)
        for split in self.splits:
            shape[split.dim] //= split.parts
        return tuple(shape)

    @property
    def local_numel(self) -> int:
        """The number of elements of the local tensor."""
        return math.prod(self.local_shape)

    def __repr__(self) -> str:
        text = (
            f"TensorView(global_shape={self.global_shape!r}, split_dim={self.split_dim!r}, "
            f"part={self.part!r}, parts={self.parts!r}, stride={self.stride!r}"
        )
        if self.inner_splits:
            text += f", inner_splits={self.inner_splits!r}"
        return text + ")"


def ranks_of(group: dist.ProcessGroup | None) -> Ranks | None:
    """``group``'s global ranks, sorted (the world's for None); None when
    ``torch.distributed`` is not initialised (one process: nothing to record)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    return tuple(sorted(group_ranks(group)))


def set_view(tensor: torch.Tensor, view: TensorView) -> None:
    """Record that ``tensor`` is the local tensor ``view`` describes.

    Raises:
        ValueError: ``tensor``'s shape is not ``view.local_shape`` (both named).
    """
    if tuple(tensor.shape) != view.local_shape:
        raise ValueError(
            f"a tensor of shape {tuple(tensor.shape)} cannot be the local part {view} "
            f"(local shape {view.local_shape})"
        )
    setattr(tensor, VIEW_ATTRIBUTE, view)


def view_of(tensor: torch.Tensor) -> TensorView:
    """The view recorded on ``tensor`` by :func:`set_view`; else the whole tensor
    (``TensorView(tuple(tensor.shape))``, no replica group)."""
    view = getattr(tensor, VIEW_ATTRIBUTE, None)
    if isinstance(view, TensorView):
        return view
    return TensorView(tuple(tensor.shape))


def _this_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def writes_replica(view: TensorView, holders: Collection[int] | None = None) -> bool:
    """Whether this rank writes its copy of the tensor ``view`` describes, as far as
    the copies recorded in the descriptor go (see ``[Note: who writes a replicated
    tensor]``): True when ``view.replicate_group`` is None or empty, else whether its
    lowest rank is in ``holders``.

    Args:
        view: the tensor's descriptor.
        holders: the global ranks among which the caller (a checkpoint adapter) picks
            one writer per piece itself: its process group's ranks (DDP, OSS, FSDP's
            shard group). Default None: this rank alone (the caller writes every piece
            it holds).
    """
    replicas = view.replicate_group
    if not replicas:
        return True
    return min(replicas) in (holders if holders is not None else (_this_rank(),))


def writes_part(view: TensorView, model_holders: Collection[int]) -> bool:
    """Whether this rank writes its tensor-parallel part (``view.split_dim`` set) in a
    plain module, every rank of ``model_holders`` holding a whole copy of the model
    (see ``[Note: who writes a replicated tensor]``).

    The replica group decides when recorded (its lowest rank writes); else the split
    group holding the lowest of ``model_holders`` writes (every part when the split
    group is not known, or ``model_holders`` is empty). A view of several splits: the
    grid of ranks its split groups span from this rank (one rank per combination of
    parts) writes when it holds the lowest of ``model_holders``.
    """
    if view.replicate_group:
        return writes_replica(view)
    if view.split_group is None or not model_holders:
        return True
    if not view.inner_splits:
        return min(model_holders) in view.split_group
    span = _holders_of_every_part(view)
    return span is None or min(model_holders) in span


def _holders_of_every_part(view: TensorView) -> set[int] | None:
    """The ranks holding the parts of every split of ``view`` that this rank's own
    groups reach (a mesh numbers its ranks as a grid, each group an axis through this
    rank: the grid points ``rank + sum_i (g_i - rank)``, one ``g_i`` from each split's
    group); every rank when a group is not known."""
    rank = _this_rank()
    span = {rank}
    for split in view.splits:
        if split.group is None:
            return None
        span = {r + g - rank for r in span for g in split.group}
    return span
