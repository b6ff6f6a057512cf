"""The disk tier in the universal checkpoint: its files as tensors for one save or load.

[Note: saving and loading the disk tier]
Between uses a disk-tier parameter is an empty placeholder and its optimizer state is a
file, while the universal checkpoint reads and fills ``param.data`` and
``optimizer.state[param]``. So for the length of one save or load (a
:class:`DiskSession`, which the universal checkpoint enters through the adapter's
``session``) every offloaded parameter's ``.data`` is a view of a memory-mapped file,
never of memory:

- saving: the committed generation's parameter file (a private mapping, only read)
  and the committed optimizer state (a private mapping of its file). The writer copies
  them into its shard file piece by piece: the kernel pages each slice in as it is
  written and may drop it again, so the model is never resident at once.
- loading into generation ``g + 1``: a copy of generation ``g``'s parameter file per
  slice (a shared, writable mapping) and one scratch file per slice and element-wise
  optimizer state (``exp_avg``, ``exp_avg_sq``), initialised from generation ``g``'s
  state, which the loader fills in place; generation ``g``'s scalar state (``step``)
  too. Then ``after_load`` (:meth:`DiskSession.commit`) writes each slice's optimizer
  state file (one slice in memory at a time, in the format of a step), syncs the
  parameter files, and commits ``g + 1`` with the buffers (the tier's atomic manifest
  rename). A load that fails commits nothing and deletes what it wrote.

Leaving the session puts the placeholders back and empties the optimizer's ``state``.
The pinned ``shared`` group (tied weights) is resident throughout: read and filled in
place, its parameter file written at the commit.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from shardkit.checkpoint.universal.layout import Purpose
from shardkit.nn.offload.disk import DiskTier
from shardkit.nn.offload.flat import SliceLayout
from shardkit.nn.offload.optim import SlicedOptimizer
from shardkit.nn.offload.slices import Slice, SliceState
from shardkit.optim.file_backed import StateByIndex, StateLayout

__all__ = ["DiskSession", "disk_session"]


def _map(path: Path, nbytes: int, *, writable: bool) -> torch.Tensor:
    """The first ``nbytes`` bytes of ``path`` as a CPU ``uint8`` tensor backed by a
    memory map: shared (writes reach the file) or private (only read here)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=writable, size=nbytes, dtype=torch.uint8)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _state_names(optimizer: SlicedOptimizer) -> tuple[set[str], set[str]]:
    """(element-wise, scalar) state names of one step of ``optimizer``'s class with its
    hyperparameters (AdamW: ``{exp_avg, exp_avg_sq}``, ``{step}``), from a step of a
    two-element probe."""
    probe = torch.nn.Parameter(torch.zeros(2))
    probe.grad = torch.ones(2)
    instance = optimizer.optimizer_class([probe], **optimizer.hyperparameters())
    instance.step()
    state = instance.state[probe]
    tensors = {
        k
        for k, v in state.items()
        if k != "step" and isinstance(v, torch.Tensor) and v.shape == probe.shape
    }
    return tensors, set(state) - tensors


class DiskSession:
    """One universal save or load of a disk-tier ``OffloadModel`` (see the module note).

    Args:
        tier: the model's disk tier.
        optimizer: its :class:`SlicedOptimizer`, or None (parameters and buffers only;
            a load then keeps the tier's optimizer state as it is).
        purpose: ``"save"`` or ``"load"``.
    """

    def __init__(self, tier: DiskTier, optimizer: SlicedOptimizer | None, purpose: Purpose):
        self.tier = tier
        self.optimizer = optimizer
        self.purpose = purpose
        self.generation = tier.generation + 1  # the one a load commits
        self.opened: list[Slice] = []
        self.created: list[Path] = []
        self.committed = False
        self._scalars: set[str] = set()  # state a complete entry has (AdamW: step)
        self._files: dict[str, dict[str, str | None]] | None = None
        self._layouts: dict[str, StateLayout | None] = {}

    def open(self) -> None:
        """Point every parameter at its file and fill the optimizer's ``state``.

        Raises:
            RuntimeError: a slice is resident (a forward or backward is under way).
        """
        busy = [
            s.name for s in self.tier.slices if not s.pinned and s.state is not SliceState.OFFLOADED
        ]
        if busy:
            raise RuntimeError(
                f"slices {busy} of the disk-tier OffloadModel are resident (a forward or "
                "backward is under way): save or load the universal checkpoint between steps"
            )
        self.tier.settle()  # the committed generation on the disk: its files are mapped
        self.tier.drop_read_ahead()  # a load changes the files under it
        names: set[str] = set()
        if self.purpose == "load":
            self._files = copy.deepcopy(self.tier.store.files)  # generation g's, for close()
            self._layouts = copy.deepcopy(self.tier.optim_layouts)
            if self.optimizer is not None:
                names, self._scalars = _state_names(self.optimizer)
        for s in self.tier.slices:
            self.opened.append(s)
            if self.purpose == "save":
                self._open_committed(s)
            else:
                self._open_target(s, names)

    def _committed_state(self, s: Slice) -> StateByIndex:
        """The committed optimizer state of ``s`` per parameter index, memory-mapped."""
        return self.tier.load_optim_state(s, torch.device("cpu")) or {}

    def _open_committed(self, s: Slice) -> None:
        if not s.pinned:
            path = self.tier.store.path(s.name, "params")
            assert path is not None  # written at attach
            s.point_at(s.layout.views(_map(path, s.layout.nbytes, writable=False)))
        if self.optimizer is not None:
            for i, state in self._committed_state(s).items():
                self.optimizer.state[s.parameters[i]] = dict(state)

    def _new_file(self, name: str) -> Path:
        path = self.tier.directory / name
        self.created.append(path)
        return path

    def _open_target(self, s: Slice, names: set[str]) -> None:
        if not s.pinned:  # a key the checkpoint lacks (strict=False) keeps its value
            source = self.tier.store.path(s.name, "params")
            assert source is not None
            target = self._new_file(f"{s.name}.params.g{self.generation}")
            shutil.copyfile(source, target)
            s.point_at(s.layout.views(_map(target, s.layout.nbytes, writable=True)))
        if self.optimizer is None:
            return
        committed = self._committed_state(s)
        shapes = [e.shape for e in s.layout.entries]
        names = names | {
            k
            for i, state in committed.items()
            for k, v in state.items()
            if k != "step" and isinstance(v, torch.Tensor) and v.shape == shapes[i]
        }
        for name in sorted(names):
            self._open_state_file(s, name, committed)
        for i, state in committed.items():  # scalars (step), kept for absent keys too
            mine = self.optimizer.state[s.parameters[i]]
            mine.update((k, v) for k, v in state.items() if k not in names)

    def _open_state_file(self, s: Slice, name: str, committed: dict[int, dict[str, Any]]) -> None:
        """A scratch file holding state ``name`` of every parameter of ``s`` (shaped and
        typed like the committed one, else like the parameter), in ``optimizer.state``."""
        assert self.optimizer is not None
        like = []
        for i, e in enumerate(s.layout.entries):
            old = committed.get(i, {}).get(name)
            dtype = old.dtype if isinstance(old, torch.Tensor) else e.dtype
            like.append((e.name, torch.empty(e.shape, dtype=dtype, device="meta")))
        layout = SliceLayout.of(like)
        path = self._new_file(f"{s.name}.load-{name}.g{self.generation}")
        with open(path, "wb") as handle:
            handle.truncate(layout.nbytes)  # zeros
        views = layout.views(_map(path, layout.nbytes, writable=True))
        for i, (p, view) in enumerate(zip(s.parameters, views, strict=True)):
            old = committed.get(i, {}).get(name)
            if isinstance(old, torch.Tensor) and old.shape == view.shape:
                view.copy_(old)
            self.optimizer.state[p][name] = view

    def commit(self) -> None:
        """After a load: write generation ``g + 1`` (parameters, optimizer state one
        slice at a time, buffers) and commit it atomically."""
        if self.purpose != "load" or self.committed:
            return
        g = self.generation
        for s in self.tier.slices:
            if s.pinned:
                self.tier.write_params(s, g)
            else:
                _fsync(self.tier.directory / f"{s.name}.params.g{g}")
                self.tier.store.name(s.name, "params", g)
            if self.optimizer is not None:
                self.tier.write_optim_state(s, g, self._slice_state(s))
        class_name = self.optimizer.class_name if self.optimizer is not None else None
        self.tier.commit(g, class_name)
        self.committed = True

    def _slice_state(self, s: Slice) -> StateByIndex | None:
        """The loaded optimizer state of ``s`` per parameter index, as a step writes it
        (read from the scratch files); None when no parameter has complete state
        (loaded from a checkpoint saved before step 1)."""
        assert self.optimizer is not None
        state: StateByIndex = {}
        for i, p in enumerate(s.parameters):
            held = self.optimizer.state.get(p)
            if held is None or self._scalars - held.keys():
                continue
            state[i] = dict(held)
        return state or None

    def close(self) -> None:
        """Placeholders back, the optimizer's ``state`` empty; after a failed load, the
        files it wrote deleted (generation ``g`` stays the committed one)."""
        for s in self.opened:
            if not s.pinned:
                self.tier.release(s)
        if self.optimizer is not None:
            self.optimizer.state.clear()
        committed = self.committed or self.tier.generation == self.generation
        if self.purpose == "load" and not committed:
            for path in self.created:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            if self._files is not None:  # a commit that failed half-way named new files
                self.tier.store.files = self._files
                self.tier.optim_layouts = self._layouts


@contextlib.contextmanager
def disk_session(
    tier: DiskTier, optimizer: SlicedOptimizer | None, purpose: Purpose
) -> Iterator[DiskSession]:
    """A :class:`DiskSession`, opened for the body and closed after it (also on error)."""
    session = DiskSession(tier, optimizer, purpose)
    try:
        session.open()
        yield session
    finally:
        session.close()
