"""The disk tier: each slice's parameters, gradients and optimizer state in files.

Directory layout (``<name>`` is ``slice<i>`` or ``shared``, ``<g>`` the generation)::

    manifest.json             generation, layouts, file names, optimizer class and
                              optimizer-state layouts
    <name>.params.g<g>        raw bytes of the slice's flat parameter buffer
    <name>.optim.g<g>         the slice's optimizer state, packed (after step 1; see
                              [Note: the optimizer-state file] in shardkit.optim.file_backed)
    buffers.g<g>.pt           module buffers (BatchNorm statistics, ...), torch.save
    <name>.grad               gradients accumulated since the last zero_grad (scratch)

[Note: crash safety]
The files live in a :class:`~shardkit.checkpoint.generations.GenerationStore` (see its
[Note: crash safety]): an optimizer step writes generation ``g + 1`` of every file next
to generation ``g``, then commits it with one atomic rename of ``manifest.json``. A
crash before it leaves generation ``g``; a reopen (``resume=True``) deletes the
unreferenced generation ``g + 1`` files and the scratch gradient files.

[Note: what is resident]
Parameters are read into the slice's compute buffer (direct I/O where the file system
allows, no page-cache copy) and the buffer is freed after use. Forward and backward
hold one slice at a time, plus the pinned ``shared`` group, plus what ``disk_io_bytes``
allows (below).

[Note: the step at the disk's speed]
``optimizer.step()`` keeps the disk busy (ZeRO-Infinity's overlap of the optimizer with
NVMe I/O, section 6.2): while slice k steps, the parameters, gradients and optimizer
state of slices k + 1 and k + 2 are read ahead (:meth:`DiskTier.read_ahead`) and slice
k - 1's are written behind (the store's write-behind; a slice's compute buffer is
freed once written). Forward and backward read ahead the same way: while slice k
computes, the parameters of the two slices that run next are read. The slices that
run next across phases are read ahead too: forward's last slice keeps its compute
buffer for backward, backward's last keeps it (and its gradients, above) for the step
and starts reading its optimizer state (see [Note: gradient files] in
:mod:`shardkit.nn.offload.grad_files`), and the step's end starts reading the first
two slices of the next forward (a slice whose buffer is still being written is not
read: the buffer holds its new parameters).

Memory bound: beyond the resident slice (its parameters, gradients and optimizer
state) and the pinned group, at most ``disk_io_bytes`` of writes in flight plus at
most ``disk_io_bytes`` held ahead (read-ahead parts, kept buffers, held gradients;
each part is taken only while it fits), so at most one slice plus ``2 *
disk_io_bytes``. With the default 0 nothing is read ahead and each slice is written
before the next is read, and the commit waits for every write (see [Note:
write-behind] in :mod:`shardkit.checkpoint.generations`) before the step returns.

[Note: background step commits]
With ``disk_io_bytes > 0`` the step's commit runs on the store's commit thread (see
[Note: background commits] in :mod:`shardkit.checkpoint.generations`): it waits for
the last slices' writes, ``fsync``-s, renames the manifest and deletes generation
``g``'s files while the next forward already runs (a read of a file still being
written waits for its write; the next forward's first slices are usually still in
their buffers). The training thread waited for those writes at the end of every step
before, with the disk writing and the CPU idle. ``optimizer.step()`` so returns before
``g + 1`` is on the disk; it is there once the next step's commit starts (one commit
in flight), after :meth:`DiskTier.settle` (a universal checkpoint's save or load calls
it), when the tier is garbage-collected, or when the process exits (the store's
threads finish their queue). A crash before leaves generation ``g``, as before; a
failed background write or commit is raised by the next step's write or commit,
nothing after it committed.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from shardkit.checkpoint.atomic import atomic_save
from shardkit.checkpoint.generations import MANIFEST, GenerationStore, check_writable
from shardkit.nn.offload.directory import FORMAT, OWNED, check_layouts, remove_offloaded
from shardkit.nn.offload.flat import SliceLayout
from shardkit.nn.offload.grad_files import GradientFiles
from shardkit.nn.offload.slices import Slice, SliceState
from shardkit.nn.offload.tiers import Tier
from shardkit.optim.file_backed import (
    StateByIndex,
    StateLayout,
    StateRead,
    read_state,
    read_state_async,
    write_state,
)

__all__ = ["MANIFEST", "DiskTier", "check_writable", "remove_offloaded"]


def _placeholder(p: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=p.dtype, device=p.device)


class DiskTier(Tier):
    """Slices kept in files in ``directory``; one slice is resident at a time.

    Args:
        device: the compute device.
        directory: the offload directory (created if missing).
        resume: False (default): start from the model's values; the directory must not
            hold an offloaded model yet. True: continue from the committed generation in
            the directory (the model only gives the architecture; it may be on ``meta``).
        io_bytes: memory the step may use beyond one slice for write-behind and
            read-ahead (see [Note: the step at the disk's speed]); default 0.

    Raises:
        ValueError: for an unwritable directory, a directory that already holds a model
            when ``resume`` is False, or none when it is True.
    """

    kind = "disk"

    def __init__(
        self,
        device: torch.device,
        directory: str | os.PathLike[str],
        *,
        resume: bool,
        io_bytes: int = 0,
    ) -> None:
        super().__init__(device)
        self.io_bytes = io_bytes
        self.store = GenerationStore(
            directory,
            fmt=FORMAT,
            owned=OWNED,
            resume=resume,
            holds="an offloaded model",
            write_behind_bytes=io_bytes,
            io_threads=2 if io_bytes else 1,  # each thread holds a bounce buffer
        )
        self.directory = self.store.directory
        self.resume = resume
        self.optimizer_class: str | None = None
        self.optim_layouts: dict[str, StateLayout | None] = {}  # slice -> its state file's
        self.buffers: dict[str, torch.Tensor] = {}
        self.grads = GradientFiles(self.store, device, background=io_bytes > 0)
        self._init_fn: Callable[[nn.Module], None] | None = None
        self._reading: dict[str, Future[int]] = {}  # slice -> its parameters read ahead
        self._state_ahead: dict[str, StateRead] = {}  # slice -> its optimizer state
        self._ahead_bytes: dict[tuple[str, str], int] = {}  # (slice, part) -> bytes held ahead
        self._writing: dict[str, tuple[Slice, Future[int]]] = {}  # buffers being written
        weakref.finalize(self, self.store.flush)  # a background commit lands at gc too

    @property
    def generation(self) -> int:
        """The committed generation."""
        return self.store.generation

    # -- attaching ---------------------------------------------------------------------

    def attach_model(
        self,
        slices: list[Slice],
        buffers: dict[str, torch.Tensor],
        init_fn: Callable[[nn.Module], None] | None = None,
    ) -> None:
        """Attach ``slices`` and the model's ``buffers``; write generation 0 or open the stored one.

        A fresh directory is written one slice at a time (allocate, copy the values or
        run ``init_fn`` on the slice's layers when its parameters were on ``meta``,
        write, free), so the model never has to be resident at once.
        """
        self.buffers = buffers
        self._init_fn = init_fn
        self.store.files = {s.name: {"params": None, "optim": None} for s in slices}
        self.attach(slices)
        if self.resume:
            self._open_existing()
        else:
            for s in slices:
                if s.pinned:
                    self.write_params(s, 0)
            self.commit(0)

    def _attach(self, s: Slice) -> None:
        s.attach_compute(self.device)
        if self.resume:
            s.point_at([_placeholder(p) for p in s.parameters])
            return
        assert s.compute is not None and s.module is not None
        s.compute.allocate()
        entries = zip(s.parameters, s.layout.entries, strict=True)
        on_meta = any(p.numel() < e.nbytes // e.dtype.itemsize for p, e in entries)
        if not on_meta:
            for view, p in zip(s.compute_views, s.parameters, strict=True):
                view.copy_(p.data)
        s.point_at(s.compute_views)
        if on_meta:
            assert self._init_fn is not None  # OffloadModel checks it
            self._init_fn(s.module)
        self.write_params(s, 0)
        self.release(s)

    def _open_existing(self) -> None:
        manifest = self.store.open()
        check_layouts(manifest["layouts"], {s.name: s.layout.to_json() for s in self.slices})
        self.optimizer_class = manifest.get("optimizer_class")
        self.optim_layouts = manifest["optim_layouts"]
        for s in self.slices:
            if s.pinned:
                self._read_pinned(s)
        self._read_buffers(manifest.get("buffers"))
        self._remove_unreferenced()

    # -- moving slices -----------------------------------------------------------------

    def _load(self, s: Slice) -> None:
        assert s.compute is not None
        reading = self._reading.pop(s.name, None)
        self._release_ahead(s, "params", "held")  # now the resident slice's
        if reading is not None:
            reading.result()
        else:
            self._reap(s)
            s.compute.allocate()
            self.store.read(s.name, "params", s.compute.tensor)
        s.point_at(s.compute_views)
        self.grads.restore(s)  # a backward adds to them, the step uses them

    def read_ahead(self, s: Slice, optim_state: bool = True) -> None:
        """Start reading offloaded ``s``'s parameters into its compute buffer and (with
        ``optim_state``, for the step) its gradients and optimizer state on the store's
        background threads (see [Note: the step at the disk's speed]); :meth:`load`,
        :meth:`open_grads` and :meth:`load_optim_state` then wait for them. Each part
        is read only while everything read ahead and not yet loaded fits in
        ``io_bytes``; a part already read ahead is not read again."""
        if s.pinned or s.state is not SliceState.OFFLOADED:
            return
        assert s.compute is not None
        if s.name not in self._reading and self._reserve(s, "params", s.layout.nbytes):
            self._start_params(s)
        if not optim_state:
            return
        if self.grads.needs_read(s) and self._reserve(s, "grads", s.layout.nbytes):
            self.grads.read_ahead(s)
        layout = self.optim_layouts.get(s.name)
        if (
            layout is not None
            and s.name not in self._state_ahead
            and self.store.path(s.name, "optim") is not None
            and self._reserve(s, "state", int(layout["nbytes"]))
        ):
            self._state_ahead[s.name] = read_state_async(self.store, s.name, layout)

    def drop_read_ahead(self) -> None:
        """Wait for every read-ahead and forget it (before the files change under it);
        held gradients go to their files."""
        for s in self.slices:
            self.grads.flush_held(s)  # s is offloaded: not through its parameters
            reading = self._reading.pop(s.name, None)
            if reading is not None:
                reading.result()
                self.release(s)
            self.grads.drop_ahead(s)
            state = self._state_ahead.pop(s.name, None)
            if state is not None:
                state.wait()
        self._ahead_bytes.clear()

    def _reserve(self, s: Slice, part: str, nbytes: int) -> bool:
        """Count ``nbytes`` of ``s``'s ``part`` held ahead if they fit in ``io_bytes``."""
        if sum(self._ahead_bytes.values()) + nbytes > self.io_bytes:
            return False
        self._ahead_bytes[(s.name, part)] = nbytes
        return True

    def _release_ahead(self, s: Slice, *parts: str) -> None:
        """Stop counting ``s``'s ``parts`` held ahead (used, or dropped)."""
        for part in parts:
            self._ahead_bytes.pop((s.name, part), None)

    def _start_params(self, s: Slice) -> None:
        """Bring offloaded ``s``'s parameters into its compute buffer in the background
        (none to read while the buffer is still being written: it holds them)."""
        assert s.compute is not None
        writing = self._writing.pop(s.name, None)
        self._reap()
        if writing is not None:
            self._reading[s.name] = writing[1]
            return
        s.compute.allocate()
        self._reading[s.name] = self.store.read_async(s.name, "params", s.compute.tensor)

    def _offload(self, s: Slice) -> None:
        """Offload ``s``; gradients it held before its load are held again if they fit."""
        again = s.name in self.grads.restored  # see [Note: gradient files]
        if not (again and self.grads.can_hold(s) and self._reserve(s, "held", s.layout.nbytes)):
            self.grads.flush(s)
        self.grads.hold(s)
        self.release(s)

    def _offload_next(self, s: Slice) -> None:
        """Offload ``s``, which is loaded next: its compute buffer is kept as if read
        ahead and its gradients held instead of written when its gradient file has
        none yet (when they fit in ``io_bytes``), so that the load reads nothing (see
        [Note: gradient files])."""
        if not (self.grads.can_hold(s) and self._reserve(s, "held", s.layout.nbytes)):
            self.grads.flush(s)
        self.grads.hold(s)
        if not self._reserve(s, "params", s.layout.nbytes):
            self.release(s)
            return
        assert s.compute is not None
        s.point_at([_placeholder(v) for v in s.compute_views])
        done: Future[int] = Future()
        done.set_result(s.layout.nbytes)
        self._reading[s.name] = done

    def release(self, s: Slice) -> None:
        """Point the parameters of offloaded ``s`` at empty placeholders, free its buffer
        (once written, when a write of it is in flight)."""
        assert s.compute is not None
        s.point_at([_placeholder(v) for v in s.compute_views])
        if s.name not in self._writing:
            s.compute.free()

    def _reap(self, s: Slice | None = None) -> None:
        """Free the compute buffers whose write finished (every one when ``s`` is None
        and the store was flushed; else wait for ``s``'s own write first)."""
        if s is not None and s.name in self._writing:
            self._writing[s.name][1].result()
        for name, (written, future) in list(self._writing.items()):
            if future.done():
                del self._writing[name]
                if written.state is SliceState.OFFLOADED and written is not s:
                    assert written.compute is not None
                    written.compute.free()

    # -- gradients ---------------------------------------------------------------------

    def open_grads(self, s: Slice) -> None:
        """Point the gradients of resident ``s`` at its gradient file (see
        :meth:`GradientFiles.open`)."""
        self._release_ahead(s, "grads")
        self.grads.open(s)

    def zero_grads(self) -> None:
        """Forget all gradients: delete the gradient files, drop the pinned ones."""
        self.grads.zero(self.slices)
        for s in self.slices:
            self._release_ahead(s, "held", "grads")
            if s.pinned:
                for p in s.parameters:
                    p.grad = None

    # -- generations -------------------------------------------------------------------

    def step_slice(self, s: Slice, generation: int, optim_state: StateByIndex) -> None:
        """Start writing generation ``generation`` of resident ``s``: parameters and
        optimizer state, behind (see [Note: the step at the disk's speed])."""
        flat = _flat_bytes(s)
        future = self.store.write_async(s.name, "params", generation, [flat])
        compute = s.compute
        if not s.pinned and compute is not None and flat.data_ptr() == compute.tensor.data_ptr():
            self._writing[s.name] = (s, future)  # the buffer is freed once written
        self.write_optim_state(s, generation, optim_state, background=True)
        if self.io_bytes == 0:
            self.store.flush()  # one slice at a time

    def write_optim_state(
        self,
        s: Slice,
        generation: int,
        optim_state: StateByIndex | None,
        *,
        background: bool = False,
    ) -> None:
        """Write generation ``generation`` of ``s``'s optimizer state (per parameter
        index; None: no state, as before step 1); not committed. ``background``: the
        store's write-behind (the state's tensors stay unchanged until the commit)."""
        if optim_state is None:
            self.store.files.setdefault(s.name, {})["optim"] = None
            self.optim_layouts[s.name] = None
            return
        self.optim_layouts[s.name] = write_state(
            self.store,
            s.name,
            generation,
            optim_state,
            f"OffloadModel {s.name}",
            background=background,
        )

    def load_optim_state(self, s: Slice, device: torch.device | None = None) -> StateByIndex | None:
        """The committed optimizer state of ``s`` per parameter index (views of a private
        memory map on the CPU, copied to ``device``: default the compute device), or
        None before step 1."""
        ahead = self._state_ahead.pop(s.name, None)
        self._release_ahead(s, "state")
        layout = self.optim_layouts.get(s.name)
        if ahead is not None:
            state = ahead.wait()
        elif layout is None or self.store.path(s.name, "optim") is None:
            return None
        else:
            state = read_state(self.store, s.name, layout, mapped=device is not None)
        target = self.device if device is None else device
        if target.type == "cpu":
            return state
        return {
            i: {k: v.to(target) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
            for i, values in state.items()
        }

    def commit(
        self, generation: int, optimizer_class: str | None = None, background: bool = False
    ) -> None:
        """Make ``generation`` the committed one (atomic), then delete the older files.

        Args:
            generation: the generation committed (every slice's current files).
            optimizer_class: the optimizer's class name, recorded in the manifest.
            background: wait for the writes, rename the manifest and delete the older
                files on the store's commit thread and return at once (see [Note:
                background step commits]). Default False: all of it before returning.
        """
        if optimizer_class is not None:
            self.optimizer_class = optimizer_class
        self._write_buffers(generation)
        fields: dict[str, Any] = {
            "optimizer_class": self.optimizer_class,
            "optim_layouts": self.optim_layouts,
            "layouts": {s.name: s.layout.to_json() for s in self.slices},
            "buffers": f"buffers.g{generation}.pt",
        }
        if background:
            entries = list(self.store.files)
            self.store.commit(generation, entries=entries, background=True, **fields)
            # the previous commit landed (the store waited): no manifest names g - 2's
            if self.store.durable_generation == generation - 1:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.directory / f"buffers.g{generation - 2}.pt")
            return
        self.store.flush()
        self._reap()
        # the store keeps its scratch files
        self.store.commit(generation, keep={f"buffers.g{generation}.pt"}, **fields)

    def settle(self) -> None:
        """Wait for a background step commit and every write in flight (see [Note:
        background step commits]); the committed generation is then on the disk and the
        files no manifest names are deleted.

        Raises:
            OSError: a background write or commit failed (the generation before it is
                the committed one on the disk).
        """
        self.store.flush()
        self._reap()
        self._remove_unreferenced()

    def write_params(self, s: Slice, generation: int) -> None:
        """Write generation ``generation`` of ``s``'s parameter file (not committed); a
        read-ahead of the older file is dropped."""
        if s.state is SliceState.OFFLOADED:
            self.drop_read_ahead()
        self.store.write(s.name, "params", generation, _flat_bytes(s))

    def _read_pinned(self, s: Slice) -> None:
        flat = torch.empty(s.layout.nbytes, dtype=torch.uint8)
        self.store.read(s.name, "params", flat)
        for p, view in zip(s.parameters, s.layout.views(flat), strict=True):
            p.data.copy_(view)

    def _write_buffers(self, generation: int) -> None:
        cpu = {k: v.detach().cpu() for k, v in self.buffers.items()}
        atomic_save(cpu, self.directory / f"buffers.g{generation}.pt")

    def _read_buffers(self, name: str | None) -> None:
        if name is None:
            return
        stored = torch.load(self.directory / name, weights_only=True)
        for key, value in self.buffers.items():
            value.copy_(stored[key])

    def _remove_unreferenced(self) -> None:  # keeps the buffers (and the scratch files)
        self.store.remove_unreferenced(
            {f"buffers.g{g}.pt" for g in (self.generation, self.store.durable_generation)}
        )

    def stored_layout(self, name: str) -> SliceLayout:
        """The layout of slice ``name`` (for tools reading the directory)."""
        return next(s.layout for s in self.slices if s.name == name)


def _flat_bytes(s: Slice) -> torch.Tensor:
    """The CPU ``uint8`` bytes of ``s``'s parameters in layout order."""
    if s.compute is not None and s.compute.is_allocated:
        return s.compute.tensor.cpu()
    flat = torch.zeros(s.layout.nbytes, dtype=torch.uint8)
    for view, p in zip(s.layout.views(flat), s.parameters, strict=True):
        view.copy_(p.data)
    return flat
