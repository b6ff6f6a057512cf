"""Replica layouts: their fingerprints, and gradients averaged in the plain model's index space.

A replica's *layout* is what each of its ranks holds of the trainable parameters, as
the universal checkpoint lists it: pieces (``ParamEntry`` of
:mod:`shardkit.checkpoint.universal.layout`, or any object with the same attributes,
:class:`LayoutPiece`), each a flat range of a plain-model tensor's local tensor, that
tensor's shard descriptor, and the parameter object holding it.

[Note: a layout fingerprint]
:func:`fingerprint` writes a rank's pieces as plain data (key, global shape, the
descriptor's splits, the element range, where it sits in its parameter, whether this
rank contributes it); a replica's fingerprint is the list of its ranks' and
:func:`digest` names it with a short hash. Two replicas with the same digest hold the
same pieces at rank ``j`` in the same order, so rank ``j`` of each can all-reduce its
flat gradient buffer with rank ``j`` of the others (the fast path). Different digests
(another strategy, another number of ranks) reduce in the plain model's index space.

[Note: the reduction in the plain model's index space]
:class:`ModelSpace` numbers every element of the plain model's trainable tensors (keys
sorted, each tensor flattened row-major). Each rank writes the gradient pieces it
*contributes* into a zero buffer of that size (``write`` in the universal layout:
exactly one rank of a replica per element, so a DDP replica's identical copies count
once), all ranks of all members sum the buffers (one all-reduce), and each rank reads
back the pieces it *holds* (every listed piece with a parameter), divided by the
number of members. The cost: every rank all-reduces the whole model's gradient (4
bytes per element in fp32) per step, against its shard's on the fast path.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

from shardkit.distributed.fault_tolerance.quorum import Quorum
from shardkit.distributed.fault_tolerance.transport import Store
from shardkit.distributed.shard_descriptor import TensorView
from shardkit.distributed.shard_elements import local_rows, read_range, write_range

__all__ = [
    "LayoutFn",
    "LayoutPiece",
    "ModelSpace",
    "PublishedLayouts",
    "digest",
    "fingerprint",
    "trainable",
]


class LayoutPiece(Protocol):
    """One piece of a plain-model tensor held by a rank: the attributes of the universal
    checkpoint's ``ParamEntry`` this module reads.

    Attributes:
        key: the plain model's state-dict key.
        view: the local tensor's shard descriptor.
        start, stop: elements ``[start, stop)`` of the flattened local tensor.
        param: the parameter holding the piece (its ``.grad`` holds the gradient), or
            None (a buffer; a parameter this rank does not step).
        write: whether this rank contributes the piece (one rank of the replica per
            element).
        param_offset: where the piece starts in the flattened ``param``, in elements;
            must be set where ``param`` is (``shardkit.checkpoint.universal.gradient_pieces``
            sets it).
    """

    @property
    def key(self) -> str: ...
    @property
    def view(self) -> TensorView: ...
    @property
    def start(self) -> int: ...
    @property
    def stop(self) -> int: ...
    @property
    def param(self) -> torch.Tensor | None: ...
    @property
    def write(self) -> bool: ...
    @property
    def param_offset(self) -> int | None: ...


#: Returns this rank's pieces (called at construction and at each cross-layout reduction).
LayoutFn = Callable[[], Iterable[LayoutPiece]]


def trainable(pieces: Iterable[LayoutPiece]) -> list[LayoutPiece]:
    """The non-empty pieces of parameters that require a gradient.

    Raises:
        ValueError: a piece has a parameter but no ``param_offset`` (named).
    """
    out = []
    for piece in pieces:
        if piece.param is None or not piece.param.requires_grad or piece.stop <= piece.start:
            continue
        if piece.param_offset is None:
            raise ValueError(
                f"layout piece {piece.key!r} [{piece.start}, {piece.stop}) has no param_offset; "
                "list the pieces with shardkit.checkpoint.universal.gradient_pieces"
            )
        out.append(piece)
    return out


def _view_data(view: TensorView) -> list[Any]:
    return [[s.dim, s.part, s.parts, s.stride] for s in view.splits]


def fingerprint(pieces: Sequence[LayoutPiece]) -> list[list[Any]]:
    """This rank's trainable pieces as plain data (see [Note: a layout fingerprint]):
    ``[key, global shape, splits, start, stop, parameter ordinal, param_offset, write]``
    each, in the given order."""
    ordinals: dict[int, int] = {}
    rows = []
    for p in pieces:
        assert p.param is not None
        ordinal = ordinals.setdefault(id(p.param), len(ordinals))
        shape = list(p.view.global_shape)
        rows.append(
            [p.key, shape, _view_data(p.view), p.start, p.stop, ordinal, p.param_offset, p.write]
        )
    return rows


def digest(replica_fingerprint: Sequence[Sequence[Any]]) -> str:
    """A short hash naming a replica's fingerprint (its ranks', in rank order)."""
    text = json.dumps(replica_fingerprint, separators=(",", ":"))
    return "L" + hashlib.sha256(text.encode()).hexdigest()[:20]


class ModelSpace:
    """The plain model's trainable elements numbered in one flat vector (see [Note: the
    reduction in the plain model's index space]).

    Args:
        tensors: ``{key: global shape}``; keys are numbered in sorted order.
    """

    def __init__(self, tensors: dict[str, tuple[int, ...]]) -> None:
        self.offsets: dict[str, tuple[int, int]] = {}
        total = 0
        for key in sorted(tensors):
            n = 1
            for d in tensors[key]:
                n *= d
            self.offsets[key] = (total, n)
            total += n
        self.numel = total

    def _rows(self, flat: torch.Tensor, view: TensorView, key: str) -> torch.Tensor:
        offset, n = self.offsets[key]
        return local_rows(flat[offset : offset + n], view)

    def scatter(self, pieces: Sequence[LayoutPiece], dtype: torch.dtype) -> torch.Tensor:
        """A zero vector of :attr:`numel` elements holding the gradients of the
        ``pieces`` this rank contributes (``write``); a missing ``.grad`` counts as zeros."""
        flat = torch.zeros(self.numel, dtype=dtype)
        for p in pieces:
            if not p.write or p.param is None or p.param.grad is None:
                continue
            start = int(p.param_offset or 0)
            grad = p.param.grad.detach().reshape(-1)[start : start + p.stop - p.start]
            write_range(self._rows(flat, p.view, p.key), p.start, grad.to(dtype))
        return flat

    def gather(self, flat: torch.Tensor, pieces: Sequence[LayoutPiece]) -> None:
        """Copy each piece's elements of ``flat`` into its parameter's ``.grad``
        (created as zeros where missing)."""
        for p in pieces:
            param = p.param
            assert param is not None
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            start = int(p.param_offset or 0)
            values = read_range(self._rows(flat, p.view, p.key), p.start, p.stop)
            target = param.grad.view(-1)[start : start + p.stop - p.start]
            target.copy_(values.to(target.dtype))


class PublishedLayouts:
    """The layouts the replicas published on the quorum store: ``<prefix>/layout/<digest>``
    holds ``{key: global shape}`` of a replica's trainable tensors (a digest ``n<size>``
    names a replica without ``layout=``: nothing published).

    Args:
        store: the quorum store.
        prefix: the job's store prefix.
    """

    def __init__(self, store: Store, prefix: str) -> None:
        self.store, self.prefix = store, prefix
        self._tensors: dict[str, dict[str, tuple[int, ...]]] = {}

    def publish(self, replica_fingerprint: Sequence[Sequence[Sequence[Any]]], write: bool) -> str:
        """The digest of a replica's fingerprint (its ranks', in rank order); ``write``:
        publish its tensors (the replica's rank 0)."""
        name = digest(replica_fingerprint)
        if write:
            tensors = {row[0]: row[1] for rank in replica_fingerprint for row in rank}
            self.store.set(f"{self.prefix}/layout/{name}", json.dumps(tensors))
        return name

    def tensors(self, name: str) -> dict[str, tuple[int, ...]] | None:
        """``{key: global shape}`` of layout ``name`` (cached), or None: not published."""
        if name not in self._tensors:
            key = f"{self.prefix}/layout/{name}"
            if name.startswith("n") or not self.store.check([key]):
                return None
            raw = json.loads(self.store.get(key).decode())
            self._tensors[name] = {k: tuple(v) for k, v in raw.items()}
        return self._tensors[name]

    def space(self, name: str) -> ModelSpace:
        """The plain model's index space of layout ``name`` (published)."""
        return ModelSpace(self.tensors(name) or {})

    def mismatch(self, quorum: Quorum) -> str | None:
        """Why the members of ``quorum`` (of different published layouts, which the
        quorum paired) cannot reduce in the plain model's index space, or None when
        they can."""
        spaces = [self.tensors(name) for name in quorum.layouts]
        if any(t is None or t != spaces[0] for t in spaces):
            return (
                f"replicas {list(quorum.members)} hold models of other parameters (keys or "
                "global shapes differ) or a layout that is not published: they cannot train "
                "together"
            )
        return None
