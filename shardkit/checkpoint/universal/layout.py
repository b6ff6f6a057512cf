"""How a wrapper describes its state to the universal checkpoint (the adapter contract).

The universal format stores every tensor under the *unwrapped model's* state-dict key
(``"blocks.0.attn.qkv.weight"``), as pieces: a flat element range of a rank's *local
tensor*, where the local tensor is either the whole original tensor or its
tensor-parallel shard. Wrappers (DDP, OSS, SDP, FSDP incl. hybrid, tensor parallel,
Pipe, OffloadModel) register an adapter that lists this rank's pieces; the format
(writer, reader, planner) knows no wrapper (layer: ``shardkit.checkpoint``, below
``shardkit.optim`` and ``shardkit.nn``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from shardkit.distributed.shard_descriptor import TensorView

__all__ = [
    "LayoutAdapter",
    "ParamEntry",
    "Purpose",
    "aliases_of",
    "factory_of",
    "register_layout",
    "session_of",
    "strategy_name",
]


@dataclass(frozen=True)
class ParamEntry:
    """One piece of one original tensor that this rank holds.

    Attributes:
        key: the unwrapped model's state-dict key (a tied weight: its first key).
        view: the shard descriptor of the local tensor (whole, or a tensor-parallel
            part; :class:`~shardkit.distributed.shard_descriptor.TensorView`).
        start, stop: the piece is elements ``[start, stop)`` of the row-major flattened
            local tensor.
        tensor: the piece's storage on this rank, ``stop - start`` elements (any shape
            with that numel; 1-D for FSDP's sharded views); loading copies into it.
        param: the object the optimizer holds for this piece (its optimizer state is
            saved and loaded with the same range), or None (a buffer, or a parameter
            without optimizer state on this rank, e.g. OSS non-owners).
        write: this rank writes the piece when saving (the adapter de-duplicates
            replicas: exactly one writer per element; checked at save time).
        param_offset: where the piece starts inside the flattened ``param`` (and inside
            each of its optimizer state tensors, which are shaped like ``param``), in
            elements. Default None: derived: ``tensor.storage_offset() -
            param.storage_offset()`` when ``tensor`` is a view of ``param``'s storage
            (FSDP's views into a flat shard; a plain parameter's flat slice), else 0
            when ``param`` has exactly ``stop - start`` elements; anything else must
            be given (the save raises ``ValueError`` naming the key).

    Optimizer state of ``param`` (``optimizer.state[param]``): a tensor shaped like
    ``param`` is element-wise and saved / loaded for elements ``[param_offset,
    param_offset + stop - start)`` of it, with the piece's range; a number or a
    one-element tensor of another shape (Adam's ``step``) is a scalar, saved with the
    piece and restored as it was (0-dim tensor or number). State of another shape (a
    factored second moment) is per-tensor state, saved whole when ``param`` is the
    whole tensor (see ``[Note: per-tensor optimizer state]`` in :mod:`.optim_state`),
    refused with ``ValueError`` when it is a piece.
    """

    key: str
    view: TensorView
    start: int
    stop: int
    tensor: torch.Tensor
    param: torch.Tensor | None = None
    write: bool = True
    param_offset: int | None = None


class LayoutAdapter(Protocol):
    """What a wrapper tells the universal checkpoint (one instance per save or load).

    ``entries()`` is called once per save or load, after the model is in the state to
    save (no collective expected inside; the pieces must stay valid until the call
    returns). Keys: every rank lists the pieces it *holds* (``write=False`` for a
    replica it does not write); loading fills every listed piece. Optimizer state is
    read from and written to ``optimizer.state[entry.param]`` and the hyperparameters
    to ``optimizer.param_groups`` of the optimizer given to the save / load (OSS: its
    full-view ``param_groups`` and its local ``state``).

    Optional methods: ``aliases()`` (see :func:`aliases_of`) and ``session(purpose)``
    (see :func:`session_of`), a context manager around the whole save or load, for a
    wrapper whose tensors are not in memory between uses (OffloadModel's disk tier).
    """

    strategy: str  # "plain", "ddp", "oss", "sdp", "fsdp", "hsdp", "pipe", "offload", (+ "tp<T>")

    def entries(self) -> Iterable[ParamEntry]:
        """This rank's pieces of every parameter and buffer (buffers with ``param=None``)."""
        ...

    def after_load(self) -> None:
        """Called once after every piece was filled (e.g. re-sync replicas, bump versions)."""
        ...


def aliases_of(adapter: Any) -> dict[str, str]:
    """The adapter's tied keys, ``{other key: first key}`` (e.g. ``{"lm_head.weight":
    "wte.weight"}``), from its optional method ``aliases()``; ``{}`` without one.

    Stored in the manifest so that a consolidated state dict (``python -m
    shardkit.checkpoint convert``) has every key of the plain model; loading needs
    none of it (the adapter lists each tied tensor once, under its first key).
    """
    method = getattr(adapter, "aliases", None)
    return dict(method()) if callable(method) else {}


Purpose = Literal["save", "load"]


def session_of(adapter: Any, purpose: Purpose) -> contextlib.AbstractContextManager[Any]:
    """The adapter's optional ``session(purpose)`` context manager, else a null context.

    ``save_universal`` enters it with ``"save"`` before ``entries()`` and leaves it after
    the checkpoint is committed; ``load_universal`` with ``"load"`` before ``entries()``
    and leaves it after ``after_load()``. It is left on failure too (then
    ``after_load`` was not called): the place to put the model back as it was between
    uses (e.g. release file mappings the pieces pointed at).
    """
    method = getattr(adapter, "session", None)
    if not callable(method):
        return contextlib.nullcontext()
    session: contextlib.AbstractContextManager[Any] = method(purpose)
    return session


LayoutFactory = Callable[[Any, Any], LayoutAdapter]  # (model, optimizer or None) -> adapter
_REGISTRY: dict[type, LayoutFactory] = {}


def register_layout(model_type: type, factory: LayoutFactory) -> None:
    """Register ``factory`` for models of ``model_type`` (called at the wrapper's import).

    ``factory(model, optimizer)`` (optimizer may be None) returns a fresh adapter.
    Registering a type again replaces its factory.
    """
    _REGISTRY[model_type] = factory


def factory_of(model: Any, optimizer: Any = None) -> LayoutFactory | None:
    """The factory registered for ``optimizer``'s type (OSS: ownership decides who
    writes), else for the most specific registered type ``model`` is an instance of
    (nearest in ``type(model).__mro__``); None when none matches."""
    owners = (
        type(model).__mro__ if optimizer is None else type(optimizer).__mro__ + type(model).__mro__
    )
    for cls in owners:  # an optimizer's adapter (OSS: it decides the writers) comes first
        factory = _REGISTRY.get(cls)
        if factory is not None:
            return factory
    return None


def strategy_name(base: str, views: Iterable[TensorView]) -> str:
    """``base`` (``"fsdp"``, ``"oss"``, ...), with ``"+<dim><P>"`` for each mesh
    dimension some view is split over into ``P`` parts (``"+tp2"``; an MoE layer's
    experts ``"+ep4"``; a split of unrecorded dimension counts as ``tp``): the
    ``strategy`` an adapter reports."""
    degrees: dict[str, int] = {}
    for v in views:
        for split in v.splits:
            dim = split.mesh_dim or "tp"
            degrees[dim] = max(degrees.get(dim, 0), split.parts)
    return base + "".join(f"+{dim}{parts}" for dim, parts in sorted(degrees.items()))
