"""The file-backed optimizer: optimizer state in files, stepped one piece at a time.

Shared by the two disk tiers, which keep a model's parameters and optimizer state in a
:class:`~shardkit.checkpoint.generations.GenerationStore` and step it piece by piece:
FSDP's (``disk_offload``: a piece is one unit's local shard, stepped inside backward)
and OffloadModel's (a piece is one slice, stepped by ``optimizer.step()``).

[Note: one torch optimizer per piece, rebuilt each step]
Element-wise optimizers (SGD, Adam, AdamW, Adagrad, RMSprop) update each parameter
from its own gradient and state only, so stepping piece after piece with one instance
per piece gives exactly the update of one instance over the whole model. Each visit
builds an instance of the user's class over the (resident) piece with the
hyperparameters of :class:`FileBackedOptimizer`'s ``param_groups[0]`` (so LR schedulers
work), puts the piece's state read from its file into it, steps, and the caller writes
the new parameters and state as the next generation: no optimizer state stays resident
between pieces, and the files are the only copy. Optimizers that couple parameters
(LBFGS, a global gradient norm) are not supported.

[Note: the optimizer-state file]
A piece's state is one file ``<entry>.optim.g<g>`` of the store: every tensor of
``state[param][key]`` (``exp_avg``, ``step``, ...) packed at aligned offsets
(:meth:`~shardkit.checkpoint.generations.GenerationStore.write_packed`), no pickle. Its
layout (a JSON-able :data:`StateLayout`, kept in the store's manifest by the caller)
lists, per tensor, ``[parameter index, key, dtype, shape, byte offset]``, and the
non-tensor values (numbers, None) as ``[parameter index, key, value]``; the file's
dtypes are the state's own (a piece may mix dtypes). Written as part of generation
``g + 1`` and committed with it, so a crash leaves generation ``g``'s state (see
[Note: crash safety] in :mod:`shardkit.checkpoint.generations`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardkit.checkpoint.direct_io import PAGE, Segment
from shardkit.checkpoint.generations import GenerationStore, packed_offsets
from shardkit.distributed.optim_guard import exempt_optimizer

__all__ = [
    "FileBackedOptimizer",
    "StateByIndex",
    "StateLayout",
    "StateRead",
    "read_state",
    "read_state_async",
    "write_state",
]

StateByIndex = dict[int, dict[str, Any]]  # parameter index in the piece -> its state
StateLayout = dict[str, Any]  # {"nbytes", "tensors", "values"}: see the module note


class FileBackedOptimizer(torch.optim.Optimizer):
    """The hyperparameters of a model whose optimizer state lives in files, and the
    stepping of one piece of it (see [Note: one torch optimizer per piece, rebuilt each
    step]).

    A ``torch.optim.Optimizer`` with one parameter group over every parameter of the
    model, holding every hyperparameter of ``optimizer_class`` (those passed and the
    class's defaults), editable between steps by hand or by an LR scheduler. Its
    ``state`` stays empty: the state is in the pieces' files. The disk tiers subclass
    it and decide when pieces step (``step()``).

    Args:
        params: every parameter of the model (placeholders between steps).
        optimizer_class: an element-wise ``torch.optim.Optimizer`` class.
        defaults: its hyperparameters (keyword arguments of ``optimizer_class``).
        stored_class: the class name the files were written with (None: no state yet).
        where: names the directory in messages (``"offload_dir"``).

    Raises:
        ValueError: ``stored_class`` is another class than ``optimizer_class``.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        optimizer_class: type[torch.optim.Optimizer],
        defaults: dict[str, Any],
        *,
        stored_class: str | None,
        where: str,
    ) -> None:
        name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
        if stored_class not in (None, name):
            raise ValueError(
                f"{where} holds optimizer state of {stored_class}, not {name}; "
                "resume with the same optimizer class"
            )
        # every hyperparameter of the class, not only those passed: an edit of
        # param_groups[0] (a scheduler, a warm-up) or one restored from a universal
        # checkpoint (say eps) must reach the pieces' steps
        hyper = _class_defaults(optimizer_class, defaults)
        super().__init__(list(params), {**hyper, **defaults})
        self.optimizer_class = optimizer_class
        self.class_name = name
        self._hyper_keys = set(defaults) | set(hyper)
        exempt_optimizer(self)  # it holds the tiers' placeholders by design

    def hyperparameters(self) -> dict[str, Any]:
        """The keyword arguments each piece's ``optimizer_class`` instance gets:
        ``param_groups[0]``'s entries that the class's constructor takes."""
        group = self.param_groups[0]
        return {k: group[k] for k in self._hyper_keys}

    def piece_optimizer(self, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
        """A fresh ``optimizer_class`` instance over ``params`` (resident, no state),
        with :meth:`hyperparameters`."""
        optimizer = self.optimizer_class(list(params), **self.hyperparameters())
        exempt_optimizer(optimizer)
        return optimizer

    @torch.no_grad()
    def step_piece(self, params: Sequence[nn.Parameter], state: StateByIndex) -> StateByIndex:
        """Step resident ``params`` (their ``.grad`` set; None: not stepped) from
        ``state``; returns their new state (write it with :func:`write_state`)."""
        optimizer = self.piece_optimizer(params)
        for index, values in state.items():
            optimizer.state[params[index]] = dict(values)
        optimizer.step()
        return state_of(optimizer, params)


def state_of(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> StateByIndex:
    """``optimizer.state`` of ``params`` keyed by their index (parameters without state
    left out)."""
    return {i: dict(optimizer.state[p]) for i, p in enumerate(params) if optimizer.state.get(p)}


def write_state(
    store: GenerationStore,
    entry: str,
    generation: int,
    state: StateByIndex,
    what: str,
    *,
    background: bool = False,
) -> StateLayout:
    """Write ``state`` as generation ``generation`` of ``entry``'s ``optim`` file (not
    committed; see [Note: the optimizer-state file]); returns its layout.

    State read by :func:`read_state` and stepped in place is still laid out as in its
    file, in one page-aligned buffer: that buffer is written as it is (no packing copy).

    Args:
        store, entry, generation: the file.
        state: the state per parameter index.
        what: names the piece in messages.
        background: False (default): wait for the file. True: write-behind (see [Note:
            write-behind] in :mod:`shardkit.checkpoint.generations`); the tensors must
            stay unchanged until the store's next ``flush`` or ``commit``.

    Raises:
        TypeError: a state value is neither a tensor, a number nor None (names ``what``).
    """
    tensors: list[tuple[int, str, torch.Tensor]] = []
    values: list[list[Any]] = []
    for index in sorted(state):
        for key, value in sorted(state[index].items()):
            if isinstance(value, torch.Tensor):
                tensors.append((index, key, value.detach().cpu().contiguous()))
            elif value is None or isinstance(value, (bool, int, float)):
                values.append([index, key, value])
            else:
                raise TypeError(
                    f"{what}: optimizer state {key!r} is a {type(value).__name__}; the "
                    "file-backed optimizer stores tensors, numbers and None only"
                )
    flats = [t for _, _, t in tensors]
    offsets, total = packed_offsets([t.numel() * t.element_size() for t in flats])
    in_place = _in_place(flats, offsets, total)
    future = store.write_async(entry, "optim", generation, flats, segments=in_place)
    if not background:
        store._wait(future)
    return {
        "nbytes": total,
        "tensors": [
            [i, k, str(t.dtype), list(t.shape), o]
            for (i, k, t), o in zip(tensors, offsets, strict=True)
        ],
        "values": values,
    }


def _in_place(
    flats: list[torch.Tensor], offsets: list[int], total: int
) -> tuple[list[Segment], int] | None:
    """The whole file as one segment when ``flats`` lie at ``offsets`` of one
    page-aligned buffer (state read by :func:`read_state`), else None (packed).

    Empty tensors hold no bytes and are left out of the test: torch gives every tensor
    of no element the address 0, even a view at an offset of the buffer (the state of a
    parameter whose piece is empty on this rank), so testing them refused every such
    piece and packed its whole state with a copy at every step.
    """
    held = [(t, o) for t, o in zip(flats, offsets, strict=True) if t.numel()]
    if not held:
        return None
    base = held[0][0].data_ptr() - held[0][1]
    if base % PAGE or any(t.data_ptr() - o != base for t, o in held):
        return None
    storage = held[0][0].untyped_storage()
    if storage.data_ptr() != base or storage.nbytes() < total:
        return None
    return [(0, base, total)], total


class StateRead:
    """A piece's optimizer state being read ahead on the store's background thread
    (:func:`read_state_async`); :meth:`wait` gives the state."""

    def __init__(self, store: GenerationStore, entry: str, layout: StateLayout) -> None:
        self.layout = layout
        self.flat = store.buffers.take(int(layout["nbytes"]))
        self.future = store.read_async(entry, "optim", self.flat)

    def wait(self) -> StateByIndex:
        """The state (views of one page-aligned buffer), once read.

        Raises:
            RuntimeError: the file is truncated.
        """
        self.future.result()
        return _unpack(self.flat, self.layout)


def read_state_async(store: GenerationStore, entry: str, layout: StateLayout) -> StateRead:
    """Start reading ``entry``'s current ``optim`` file (described by ``layout``) on
    the store's background thread: read-ahead of the next piece's state while this one
    steps.

    Raises:
        KeyError: no ``optim`` file was written for ``entry``.
    """
    return StateRead(store, entry, layout)


def read_state(
    store: GenerationStore, entry: str, layout: StateLayout, *, mapped: bool = False
) -> StateByIndex:
    """The state of ``entry``'s current ``optim`` file, described by ``layout``.

    Args:
        store: the store.
        entry: the piece's name in it.
        layout: what :func:`write_state` returned for the file.
        mapped: False (default): read the file into memory. True: the tensors are views
            of a private memory map (pages come in as they are touched; writes to them
            stay in this process).

    Raises:
        KeyError: no ``optim`` file was written for ``entry``.
    """
    nbytes = int(layout["nbytes"])
    path = store.path(entry, "optim")
    if path is None:
        raise KeyError(f"{store.directory}: no optim file for {entry}")
    if mapped and nbytes:
        flat = torch.from_file(str(path), shared=False, size=nbytes, dtype=torch.uint8)
    else:
        flat = store.buffers.take(nbytes)  # read in place by direct I/O, written back so
        store.read(entry, "optim", flat)
    return _unpack(flat, layout)


def _unpack(flat: torch.Tensor, layout: StateLayout) -> StateByIndex:
    """The state tensors of ``layout``, views of the file's bytes ``flat``."""
    state: StateByIndex = {}
    for index, key, dtype, shape, offset in layout["tensors"]:
        kind = getattr(torch, dtype.removeprefix("torch."))
        size = torch.Size(shape).numel() * kind.itemsize
        state.setdefault(index, {})[key] = flat[offset : offset + size].view(kind).view(shape)
    for index, key, value in layout["values"]:
        state.setdefault(index, {})[key] = value
    return state


def _class_defaults(
    optimizer_class: type[torch.optim.Optimizer], defaults: dict[str, Any]
) -> dict[str, Any]:
    """The hyperparameters of ``optimizer_class(params, **defaults)`` that its
    constructor takes (AdamW's ``defaults`` hold ``decoupled_weight_decay`` too)."""
    full = optimizer_class([nn.Parameter(torch.zeros(1))], **defaults).defaults
    accepted = inspect.signature(optimizer_class.__init__).parameters
    return {k: v for k, v in full.items() if k in accepted}
