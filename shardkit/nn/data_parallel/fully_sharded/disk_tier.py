"""FSDP's disk tier: each unit's shard and optimizer state in files, one unit in memory.

ZeRO-Infinity's NVMe offload (Rajbhandari et al. 2021, "ZeRO-Infinity: Breaking the GPU
Memory Wall for Extreme Scale Deep Learning", sections 5-6) for any module tree: a
unit's local shard (its 1/N of the parameters) and its optimizer state live in files of
a :class:`~shardkit.checkpoint.generations.GenerationStore`, one directory per rank,
and are read in only while the unit runs.

One step of a unit (``DiskUnit``: the unit's :class:`~.store.ShardStore`, its hooks
called by :class:`~.unit.UnitRuntime`)::

    forward      read shard (prefetched on a background thread while the previous
                 unit computes) -> all-gather -> drop the shard -> run -> free full
    backward     read shard and optimizer state (prefetched while the next unit runs
                 its backward) -> all-gather -> run -> reduce-scatter -> step the
                 shard -> write shard + state as generation g + 1 on a background
                 thread (write-behind) -> drop gradient and state, the shard once
                 written
    end          (root) wait for the writes; every rank wrote g + 1 (a barrier) ->
                 commit g + 1

[Note: I/O at the disk's speed]
The step is bound by the disk, so the disk must never wait for the training thread:
while unit k steps, unit k - 1's shard and optimizer state are read (prefetched when
unit k's backward starts) and unit k + 1's are written (write-behind, at most
``write_behind_bytes`` in flight; a write's tensors are its memory: the stepped shard
stays allocated until written), all with large aligned direct I/O that bypasses the
page cache (:mod:`shardkit.checkpoint.direct_io`), as ZeRO-Infinity's NVMe engine
(section 6.2). Crash safety is the store's: the commit waits for every write (see
[Note: write-behind] in :mod:`shardkit.checkpoint.generations`).

[Note: reading the backward's first states in the forward]
A forward reads only the shards, and at a few tokens per rank its units compute for
less time than the disk needs to be kept busy, while the backward reads shards and
optimizer state and writes both: the disk idles in the forward and the backward waits
for it. So the forward also reads the optimizer state of the units that step first in
the backward after it (the order the last backward stepped them in: the last block
first), up to ``read_ahead_bytes``, one such read at a time after each prefetched
shard so that the forward's own reads keep the other I/O thread. Only when a stepping
backward follows (grad enabled, not inside ``no_sync``); a forward whose backward never
comes leaves the states held (valid: only a step changes them) for the next step's
backward. ZeRO-Infinity overlaps its NVMe reads with compute the same way
(Rajbhandari et al. 2021, section 6.2).

[Note: per-unit generations]
With ``generations="step"`` (the default) the files of generation g + 1 are written
beside those of g and the step commits them all at once: the disk holds two
generations, ``2 x (4 + optimizer state bytes per element) x psi / N`` per rank. A model
whose state fills the disk cannot afford that, so ``generations="unit"`` commits each
unit as soon as its shard and optimizer state are written (the training thread asks at
the next unit's prefetch; :meth:`GenerationStore.commit` with ``entries`` does it on a
background thread, see [Note: per-entry commits] and [Note: background commits] in
:mod:`shardkit.checkpoint.generations`) and deletes its previous files then. Backward
visits each unit once, after its forward read, so no later read of the step needs
them. The disk holds one generation plus the units written and not yet committed
(about one), the previous files of the (at most two) units whose commits are queued,
and the writes in flight (``write_behind_bytes``).
What a crash leaves: every file the manifest names is whole (written, ``fsync``-ed and
renamed before the manifest names it). Between the step's first unit commit and its
final commit the manifest records the step as ``unfinished`` with the units already
at it; those units' previous values are gone, so no consistent step remains and
``resume=True`` refuses the directory, naming the units on each side. A crash before
the first unit commit (forward, the start of backward) or after the step's commit
resumes as with ``"step"``.

[Note: stepping inside backward]
The optimizer steps each unit as soon as its reduced gradient shard is complete, so
no gradient is ever written to disk or held for more than one unit, and a unit's
shard is read once for backward and step together. So with a disk tier a backward
*is* the optimizer step: :meth:`DiskOffload.optimizer` returns a
:class:`DiskOptimizer` whose ``param_groups[0]`` holds the hyperparameters each unit's
step reads (LR schedulers work), whose ``step()`` only acknowledges the step the
backward made, and which refuses a second backward before that acknowledgement (a
gradient-accumulation loop would otherwise update once per micro-batch: accumulate
inside ``model.no_sync()`` instead). Element-wise optimizers only (SGD, Adam, AdamW,
Adagrad, RMSprop): each unit is stepped by its own instance, built over the unit's
sharded parameters with the state read from its file: the file-backed optimizer of
:mod:`shardkit.optim.file_backed`, OffloadModel's disk tier's too (a unit is its
"piece"). Gradient clipping by the global norm would need every unit's gradient
first and is not available.

[Note: what is resident]
While a unit is not running, its local shard's memory is given back (the handle's
page-aligned :class:`~.unit_buffers.UnitBuffer`, released: direct I/O reads into it and
writes from it in place, with no bounce copy) and its sharded parameters
(``named_parameters()``) are empty placeholders, as
OffloadModel's disk tier; at most the running unit, the prefetched one and the units
whose gradient reduction is in flight hold their shard, plus the optimizer state of
the stepping unit and of the prefetched one, plus the writes in flight (at most
``write_behind_bytes``). Reads and writes bypass the page cache where the file system
allows (no memory map, no second copy of what is read once).

Why this module is long: the disk tier's classes (DiskOffload the user passes, DiskUnit
with a unit's files and prefetch, DiskOptimizer) share the file layout and generation
rules this docstring states; it becomes the disk shard-store policy.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.profiler import record_function

from shardkit.checkpoint.generations import GenerationStore, check_byte_count
from shardkit.distributed.collectives import group_size
from shardkit.nn.data_parallel.fully_sharded.flat_param import FlatParamHandle
from shardkit.nn.data_parallel.fully_sharded.store import ShardStore
from shardkit.optim.file_backed import (
    FileBackedOptimizer,
    StateRead,
    read_state,
    read_state_async,
    write_state,
)

__all__ = [
    "DiskOffload",
    "DiskOptimizer",
    "DiskStats",
    "DiskUnit",
    "check_one_tier",
    "refuse_on_disk",
]

FORMAT = "shardkit.fsdp.disk/1"
_OWNED = re.compile(r"^unit\d+\.(params|optim)\.g\d+$")


@dataclass(frozen=True)
class DiskStats:
    """Disk traffic of one committed step on this rank.

    Attributes:
        generation: the generation the step committed.
        bytes_read: payload bytes read (shards, optimizer state) since the previous commit.
        bytes_written: payload bytes written (shards, optimizer state; padding included).
        read_wait_s: seconds the training thread waited for reads (not overlapped).
        seconds: wall-clock seconds since the previous commit (or since the first read).
        peak_write_behind_bytes: the most bytes of writes in flight during the step.
        io_seconds: seconds during which a read or write of the tier was running.
        io_busy: those periods as ``(start, end)`` in ``time.time()`` seconds (the
            store's busy periods since the previous commit): joined over the ranks,
            when the disk had work.
    """

    generation: int
    bytes_read: int
    bytes_written: int
    read_wait_s: float
    seconds: float
    peak_write_behind_bytes: int = 0
    io_seconds: float = 0.0
    io_busy: tuple[tuple[float, float], ...] = ()


class DiskOffload:
    """FSDP's disk tier: pass the same object to every unit of a model (``disk_offload=``).

    Usage::

        disk = DiskOffload("/nvme/run1")
        with enable_wrap(wrapper_cls=FSDP, disk_offload=disk):
            model = auto_wrap(model_on_meta, transformer_auto_wrap_policy({Block}))
        model = FSDP(model, disk_offload=disk)  # the root unit on disk too
        optimizer = disk.optimizer(torch.optim.AdamW, lr=1e-4)
        loss_fn(model(x), y).backward()  # every unit steps in its backward
        optimizer.step()  # acknowledges the step (see [Note: stepping inside backward])

    Each rank keeps its files in ``<directory>/rank<r>`` (r: the global rank). Generation 0
    is each unit's initial shard, written as the unit is wrapped; a model built on the
    meta device is materialised one unit at a time (FSDP's ``param_init_fn``), so no
    rank ever holds the model. See [Note: crash safety] in
    :mod:`shardkit.checkpoint.generations`: a crash leaves the last committed step.

    Args:
        directory: the directory of all ranks (created if missing); room for two
            generations: ``2 x (4 + optimizer state bytes per element) x psi / N`` per rank.
        resume: False (default): start from the module's values; the rank's directory
            must not hold a model. True: continue from its committed generation (the
            module gives the architecture only; build it on meta). Every rank must be
            at the same generation.
        prefetch: read the next unit's shard (and in backward its optimizer state) on
            a background thread while the current one computes. Default True.
        write_behind_bytes: the most bytes of stepped shards and optimizer state being
            written on background threads while backward goes on (see [Note: I/O at the
            disk's speed]); 0 writes each unit before the next one steps. Default
            512 MiB.
        generations: ``"step"`` (default): a step writes generation g + 1 of every unit
            beside g and commits it at the end of the step, so a crash at any point
            resumes at a whole step; the disk holds two generations during a step.
            ``"unit"``: each unit's new files replace its previous ones as soon as they
            are written (see [Note: per-unit generations]); the disk holds one
            generation plus about one unit's files and the writes in flight, but a crash
            during a backward leaves a directory that does not resume.
        read_ahead_bytes: the most bytes of optimizer state a forward reads ahead for
            the units that step first in the backward after it (see [Note: reading the
            backward's first states in the forward]); 0 reads each unit's state in
            backward only. Default 512 MiB.

    Raises:
        ValueError: an unwritable directory, a directory holding a model (``resume``
            False) or none (``resume`` True), a directory whose last step did not
            finish with ``generations="unit"`` (``resume`` True), an unknown
            ``generations``, or a ``read_ahead_bytes`` / ``write_behind_bytes`` that is
            not an int >= 0.
    """

    def __init__(
        self,
        directory: str | Path,
        resume: bool = False,
        prefetch: bool = True,
        write_behind_bytes: int = 512 * 2**20,
        generations: str = "step",
        read_ahead_bytes: int = 512 * 2**20,
    ) -> None:
        check_byte_count("read_ahead_bytes", read_ahead_bytes)
        check_byte_count("write_behind_bytes", write_behind_bytes)
        if generations not in ("step", "unit"):
            raise ValueError(
                f"generations must be 'step' (two generations on disk during a step) or "
                f"'unit' (one, and a crash mid-step does not resume), got {generations!r}"
            )
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.store = GenerationStore(
            Path(directory) / f"rank{rank}",
            fmt=FORMAT,
            owned=_OWNED,
            resume=resume,
            what="disk_offload directory",
            write_behind_bytes=write_behind_bytes,
            # per-unit commits: the training thread waits for a unit's commit only when
            # two are queued (one in flight made it wait about 0.15 s a unit)
            commits_in_flight=2,
        )
        self.resume = resume
        self.prefetch = prefetch
        self.per_unit = generations == "unit"
        self.units: list[DiskUnit] = []
        self.optimizer_class: str | None = None
        self._stored: dict[str, Any] = {}
        if resume:
            manifest = self.store.open()
            self._stored = manifest["units"]
            self.optimizer_class = manifest.get("optimizer_class")
            _refuse_unfinished(manifest, self.directory)
            self.store.remove_unreferenced(set())  # a crashed step's files
        self._optimizer: DiskOptimizer | None = None
        self._group: dist.ProcessGroup | None = None
        self.unacknowledged = False  # a backward stepped; optimizer.step() not called yet
        self.in_backward = False  # a backward started and has not ended
        self.stepping = False  # that backward reduces gradients (not inside no_sync)
        self.written: list[DiskUnit] = []  # stepped units whose shard is being written
        self.stepped: list[DiskUnit] = []  # units stepped in the step being written
        self.step_order: list[DiskUnit] = []  # the order the last backward stepped them in
        self.read_ahead_bytes = read_ahead_bytes
        self.uncommitted: list[DiskUnit] = []  # per-unit generations: stepped, not committed
        self._records: dict[str, Any] = dict(self._stored)  # committed unit records
        self.history: list[DiskStats] = []
        self.read_wait_s = 0.0
        self._mark = (0, 0, 0.0, 0.0, 0.0)  # read, written, wait, time, I/O s at the last commit

    @property
    def directory(self) -> Path:
        """This rank's directory."""
        return self.store.directory

    @property
    def generation(self) -> int:
        """The committed generation (number of steps taken)."""
        return self.store.generation

    # attaching -----------------------------------------------------------------------
    def attach(
        self, handle: FlatParamHandle, label: str, group: dist.ProcessGroup | None
    ) -> DiskUnit:
        """Take over ``handle``'s local shard: write it as generation 0 (or check it
        against the stored unit when resuming) and drop it from memory.

        Raises:
            ValueError: resuming, the stored unit does not match (another model or
                world size), or ranks are at different generations.
        """
        if not self.units:
            self._group = group
            if self.resume:
                _check_same_generation(self.generation, group)
        unit = DiskUnit(self, f"unit{len(self.units)}", handle, label)
        self.units.append(unit)
        if self.resume:
            unit.check_stored(self._stored.get(unit.entry))
        else:
            self.store.write(unit.entry, "params", 0, handle.local_shard)
            self._commit(0)
        unit.release()
        return unit

    def optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], **defaults: Any
    ) -> DiskOptimizer:
        """The optimizer of the units on this tier (see :class:`DiskOptimizer`).

        Args:
            optimizer_class: an element-wise ``torch.optim.Optimizer`` class (SGD, Adam,
                AdamW, ...).
            defaults: its hyperparameters (``lr=...``).

        Raises:
            ValueError: the directory holds state of another optimizer class.
        """
        self._optimizer = DiskOptimizer(self, optimizer_class, defaults)
        return self._optimizer

    # reading and writing -------------------------------------------------------------
    def reap(self) -> None:
        """Free the shards of stepped units whose write finished, and with per-unit
        generations commit the units whose files are written (training thread)."""
        if self.written:
            done = [u for u in self.written if u.write_done()]
            self.written = [u for u in self.written if u not in done]
            for unit in done:
                unit.release()
        if self.uncommitted:
            self._commit_units([u for u in self.uncommitted if self.store.written(u.entry)])

    def _commit_units(self, units: list[DiskUnit]) -> None:
        """Per-unit generations: commit ``units``' new files (waiting for their writes),
        their previous ones deleted; the manifest names the step they belong to as
        unfinished until the step's commit (see [Note: per-unit generations])."""
        if not units:
            return
        with record_function("FSDP::disk_commit_unit"):
            for unit in units:
                self._records[unit.entry] = unit.describe()
            self.uncommitted = [u for u in self.uncommitted if u not in units]
            ahead = sorted(u.entry for u in self.stepped if u not in self.uncommitted)
            self.store.commit(
                self.generation,
                entries=[u.entry for u in units],
                background=True,
                units=self._records,
                optimizer_class=self.optimizer_class,
                unfinished={"generation": self.generation + 1, "units": ahead},
            )

    def read_ahead_states(self) -> None:
        """In a forward that a stepping backward follows: start reading the optimizer
        state of the next unit, in the order the last backward stepped them, that fits
        in ``read_ahead_bytes``; one such read at a time (see [Note: reading the
        backward's first states in the forward])."""
        held = 0
        for unit in self.step_order:
            if unit.reading_state():
                return
            held += unit.state_bytes() if unit.holds_state() else 0
        for unit in self.step_order:
            if unit.holds_state():
                continue
            if held + unit.state_bytes() > self.read_ahead_bytes:
                return
            unit.start_state_read()
            return

    def waited(self, seconds: float) -> None:
        """Count ``seconds`` of the training thread waiting for a read."""
        self.read_wait_s += seconds

    # stepping ------------------------------------------------------------------------
    def begin_unit_step(self, unit: DiskUnit) -> DiskOptimizer:
        """Checks before ``unit`` steps: an optimizer exists, the previous step was
        acknowledged, the unit did not step in this backward yet.

        Raises:
            RuntimeError: naming the cause and the fix.
        """
        if self._optimizer is None:
            raise RuntimeError(
                f"{unit.label}: backward with disk_offload steps the optimizer, but none "
                "was built: call disk.optimizer(torch.optim.AdamW, lr=...) before the "
                "first backward"
            )
        self.check_backward_allowed(unit.label, steps=True)
        if unit in self.stepped:
            raise RuntimeError(
                f"{unit.label}: its gradient was reduced twice in one backward; the disk "
                "tier steps once per backward (was the unit's output used by two losses?)"
            )
        self.stepped.append(unit)
        if self.per_unit:
            self.uncommitted.append(unit)
        return self._optimizer

    def check_backward_allowed(self, label: str, steps: bool) -> None:
        """Refuse a backward while the previous one's step is not acknowledged.

        Called when a unit's backward starts, before the unit changes state, so the
        refused backward leaves every unit as its forward left it: ``optimizer.step()``
        and a new forward and backward then train on. ``steps``: the backward reduces
        gradients, so the units step (False inside ``no_sync``: no optimizer state is
        read ahead).

        Raises:
            RuntimeError: a second backward before ``optimizer.step()``.
        """
        if self.unacknowledged:
            raise RuntimeError(
                f"{label}: a second backward before optimizer.step(): with "
                "disk_offload every backward is an optimizer step. Call optimizer.step() "
                "after each backward; accumulate micro-batches inside model.no_sync()"
            )
        self.in_backward = True
        self.stepping = steps

    def end_backward(self) -> None:
        """The root's backward is over: if units stepped, commit their generation once
        every rank has written it (one all-reduce as a barrier)."""
        self.in_backward = False
        if not self.stepped:
            return
        with record_function("FSDP::disk_commit"):
            start = time.perf_counter()
            self.store.flush()  # this rank's g + 1 is on the disk
            self.waited(time.perf_counter() - start)
            self.reap()
            self._commit_units(self.uncommitted)
            if dist.is_initialized() and group_size(self._group) > 1:
                dist.all_reduce(torch.zeros(1), group=self._group)  # all wrote g + 1
            self._commit(self.generation + 1)
        self.step_order = list(self.stepped)
        self.stepped.clear()
        self.unacknowledged = True

    def _commit(self, generation: int) -> None:
        self._records = {u.entry: u.describe() for u in self.units}
        self.store.commit(generation, units=self._records, optimizer_class=self.optimizer_class)
        read, written, now = self.store.bytes_read, self.store.bytes_written, time.perf_counter()
        if generation > 0:
            last_read, last_written, last_wait, last_time, last_io = self._mark
            self.history.append(
                DiskStats(
                    generation,
                    read - last_read,
                    written - last_written,
                    self.read_wait_s - last_wait,
                    now - last_time,
                    self.store.peak_inflight_bytes,
                    self.store.io_seconds - last_io,
                    self.store.take_busy_periods(),
                )
            )
        else:
            self.store.take_busy_periods()  # the build's
        self._mark = (read, written, self.read_wait_s, now, self.store.io_seconds)
        self.store.peak_inflight_bytes = 0

    def acknowledge(self) -> None:
        """``optimizer.step()``: the backward's step is taken.

        Raises:
            RuntimeError: no backward stepped since the last acknowledgement.
        """
        if not self.unacknowledged:
            raise RuntimeError(
                "optimizer.step() without a backward since the last one: with disk_offload "
                "the units step during backward (see DiskOptimizer); nothing to step"
            )
        self.unacknowledged = False

    def resident_bytes(self) -> int:
        """Bytes the tier holds in memory now: the local shards of the running,
        prefetched and reducing units, and the optimizer state read ahead for a step."""
        return sum(u.resident_bytes() for u in self.units)

    def close(self) -> None:
        """Wait for the writes in flight and stop the background threads (idempotent)."""
        self.store.close()


class DiskOptimizer(FileBackedOptimizer):
    """The optimizer of a disk tier: hyperparameters for the units' steps in backward.

    The file-backed optimizer (:class:`~shardkit.optim.file_backed.FileBackedOptimizer`,
    as OffloadModel's) over the sharded parameters of every unit: ``param_groups[0]``
    holds the hyperparameters; edit them between steps by hand or with an LR scheduler.
    Its ``state`` stays empty: the state lives in the units' files. Made by
    :meth:`DiskOffload.optimizer`; see [Note: stepping inside backward].

    Raises:
        ValueError: the directory was written with another optimizer class.
    """

    def __init__(
        self,
        tier: DiskOffload,
        optimizer_class: type[torch.optim.Optimizer],
        defaults: dict[str, Any],
    ) -> None:
        params = [p for u in tier.units for p in u.handle.sharded_params]
        super().__init__(
            params,
            optimizer_class,
            defaults,
            stored_class=tier.optimizer_class,
            where="the disk_offload directory",
        )
        tier.optimizer_class = self.class_name
        self.tier = tier

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the full gradients accumulated inside ``model.no_sync()`` since the last
        step (as the plain model's ``zero_grad`` would); outside ``no_sync`` each unit's
        gradient is dropped right after its step. ``set_to_none`` is ignored (dropped
        gradients read as zeros either way)."""
        for unit in self.tier.units:
            unit.handle.drop_flat_grad()

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """Acknowledge the step the last backward made (every unit stepped in it).

        Raises:
            ValueError: ``closure`` is given.
            RuntimeError: no backward stepped since the last ``step()`` (a double step).
        """
        if closure is not None:
            raise ValueError("DiskOptimizer.step does not take a closure")
        self.tier.acknowledge()


class DiskUnit:
    """One unit's files and residency on a :class:`DiskOffload` (one per unit): the
    unit's :class:`~.store.ShardStore` (see [Note: the shard-store hooks] there).

    Args:
        tier: the tier.
        entry: the unit's name in the store (``unit<k>``, k in wrapping order).
        handle: the unit's flat parameter; its local shard is ``(S,)`` on the CPU.
        label: the unit's label, for messages.
    """

    def __init__(self, tier: DiskOffload, entry: str, handle: FlatParamHandle, label: str):
        self.tier = tier
        self.entry = entry
        self.handle = handle
        self.label = label
        shard = handle.local_shard
        if handle.shard_buffer is None:
            raise ValueError(f"{label}: its flat parameter was not built for the disk tier")
        self.buffer = handle.shard_buffer  # page-aligned: read and written in place
        self.nbytes = shard.numel() * shard.element_size()
        self.resident = True
        self.loaded_version = 0
        self.optim_layout: dict[str, Any] | None = None
        self._reading: Future[int] | None = None
        self._state: StateRead | None = None  # optimizer state read ahead for backward
        self._writing: Future[int] | None = None  # the stepped shard being written
        self._placeholder = shard.new_empty(0)

    in_memory = False

    def describe(self) -> dict[str, Any]:
        """The unit's manifest record: layout and optimizer-state layout."""
        layout = self.handle.layout
        return {
            "label": self.label,
            "numels": list(layout.numels),
            "world_size": layout.world_size,
            "rank": self.handle.rank,
            "dtype": str(self.handle.local_shard.dtype),
            "optim": self.optim_layout,
        }

    def check_stored(self, stored: dict[str, Any] | None) -> None:
        """Resuming: the stored record must describe this unit.

        Raises:
            ValueError: naming the stored and the present layout.
        """
        mine = self.describe()
        if stored is None:
            raise ValueError(
                f"{self.label} is {self.entry} of this model, but the disk_offload "
                f"directory {str(self.tier.directory)!r} holds only {len(self.tier._stored)} "
                "units: resume with the model and wrapping that wrote it"
            )
        for key in ("numels", "world_size", "rank", "dtype"):
            if stored[key] != mine[key]:
                raise ValueError(
                    f"{self.label} ({self.entry}) does not match the disk_offload directory: "
                    f"stored {key}={stored[key]}, model {key}={mine[key]}; resume with the "
                    "model, wrapping and world size that wrote it"
                )
        self.optim_layout = stored["optim"]

    # residency -----------------------------------------------------------------------
    def prefetch(self, steps: bool) -> bool:
        """Start reading the shard on the background thread (no-op if resident); in a
        backward that steps, this unit's optimizer state too; in a forward with
        ``steps`` (a stepping backward follows), after the shard, the state of a unit
        that steps first (see :meth:`DiskOffload.read_ahead_states`). Returns False:
        the all-gather waits for :meth:`before_gather`."""
        tier = self.tier
        tier.reap()
        if not tier.prefetch:
            return False
        self._read_state_ahead()  # in a backward that steps
        if not self.resident:
            self._allocate()
            self._reading = tier.store.read_async(self.entry, "params", self.handle.local_shard)
        if steps and not tier.in_backward:
            tier.read_ahead_states()
        return False

    def _read_state_ahead(self) -> None:
        """In a backward that steps: start reading the optimizer state for this unit's
        step (inside ``no_sync`` nothing steps, and nothing is held for it)."""
        if self.tier.in_backward and self.tier.stepping:
            self.start_state_read()

    def start_state_read(self) -> None:
        """Start reading this unit's optimizer state for its next step on the store's
        background thread (no-op if held or none was written yet)."""
        if self._state is None and self.optim_layout is not None:
            self._state = read_state_async(self.tier.store, self.entry, self.optim_layout)

    def holds_state(self) -> bool:
        """Its optimizer state is read ahead (being read or read) for its next step."""
        return self._state is not None

    def reading_state(self) -> bool:
        """Its optimizer state is being read (not done yet)."""
        return self._state is not None and not self._state.future.done()

    def state_bytes(self) -> int:
        """Bytes of its optimizer state file's payload (0 before its first step)."""
        return int(self.optim_layout["nbytes"]) if self.optim_layout is not None else 0

    def before_gather(self) -> None:
        """Make the local shard resident (waits for a prefetch, or reads now)."""
        self._read_state_ahead()
        if self._reading is not None:
            start = time.perf_counter()
            with record_function("FSDP::disk_wait_read"):
                self._reading.result()
            self.tier.waited(time.perf_counter() - start)
            self._reading = None
        elif not self.resident:
            start = time.perf_counter()
            with record_function("FSDP::disk_read"):
                self._allocate()
                self.tier.store.read(self.entry, "params", self.handle.local_shard)
            self.tier.waited(time.perf_counter() - start)
        else:
            return
        handle = self.handle
        for index, param in enumerate(handle.sharded_params):
            a, b = handle.layout.piece(index, handle.rank)
            param.data = handle.local_shard[a:b]
        self.loaded_version = int(handle.local_shard._version)

    def _allocate(self) -> None:
        self.buffer.acquire()
        self.resident = True

    def release(self) -> None:
        """Drop the local shard from memory (its file is the current copy); while the
        shard is being written, only the parameters' views of it (the tier frees it
        once written: :meth:`DiskOffload.reap`)."""
        if self._reading is not None:
            self._reading.result()
            self._reading = None
        if not self.resident:
            return
        for param in self.handle.sharded_params:
            param.data = self._placeholder
        if not self.write_done():
            if self not in self.tier.written:
                self.tier.written.append(self)
            return
        self.buffer.release()
        self.resident = False

    def resident_bytes(self) -> int:
        """Bytes of this unit in memory: its local shard if resident, plus its optimizer
        state if read ahead."""
        state = self.state_bytes() if self.holds_state() else 0
        return (self.nbytes if self.resident else 0) + state

    def write_done(self) -> bool:
        """No write of the shard is in flight (a finished one's error is raised by the
        store's flush)."""
        if self._writing is not None and self._writing.done():
            self._writing = None
        return self._writing is None

    def after_gather(self, in_forward: bool) -> None:
        """After the all-gather: forward drops the shard; backward keeps it for the step."""
        if in_forward:
            self.release()

    def check_backward_allowed(self, label: str, steps: bool) -> None:
        """Refuse a backward while the tier's previous step is not acknowledged (see
        :meth:`DiskOffload.check_backward_allowed`)."""
        self.tier.check_backward_allowed(label, steps)

    def end_backward(self) -> None:
        """The backward pass ended: drop the shard, and optimizer state read ahead for a
        step the unit did not take (no trainable parameter, or no gradient reached it);
        the tier commits the step (once, whichever of its units ends first)."""
        if self._state is not None:
            self._state.future.result()  # the read is done with the buffer
            self._state = None
        self.release()
        self.tier.end_backward()

    def abort_backward(self) -> None:
        """A backward that raised may have stepped some units of the tier, not all.

        Raises:
            RuntimeError: always; the directory holds the last whole step.
        """
        raise RuntimeError(
            f"{self.entry}: a backward raised; with disk_offload some units may have "
            "stepped: close the tier and continue from its directory "
            "(DiskOffload(directory, resume=True), the last whole step)"
        )

    def end_summon(self) -> None:
        """Leaving ``summon_full_params``: drop the shard.

        Raises:
            RuntimeError: the shard was changed inside (not written to the tier).
        """
        changed = self.resident and int(self.handle.local_shard._version) != self.loaded_version
        self.release()
        if changed:
            raise RuntimeError(
                f"{self.label}: parameters changed inside summon_full_params (or by "
                "load_state_dict) are not written to the disk tier, so the change was "
                "dropped; load weights into the module before wrapping it, or resume from "
                "a disk_offload directory"
            )

    # the step ------------------------------------------------------------------------
    @torch.no_grad()
    def accept_grad_shard(self, grad_shard: torch.Tensor, divide_by: float) -> None:
        """The reduced gradient shard ``(S,)`` is complete: step this unit and write its
        shard and optimizer state as the next generation (see [Note: stepping inside
        backward])."""
        tier = self.tier
        optimizer = tier.begin_unit_step(self)
        with record_function("FSDP::disk_step"):
            self.before_gather()
            handle = self.handle
            handle.accumulate_grad_shard(grad_shard, divide_by=divide_by)
            params = handle.sharded_params
            state = self._take_state()
            new_state = optimizer.step_piece(params, state)
            del state
            for param in params:
                param.grad = None
            generation = tier.generation + 1
            self._writing = tier.store.write_async(
                self.entry, "params", generation, [handle.local_shard]
            )
            self.optim_layout = write_state(
                tier.store, self.entry, generation, new_state, self.label, background=True
            )
            del new_state
            self.release()
        tier.reap()  # with per-unit generations, commit the units written by now

    def _take_state(self) -> dict[int, dict[str, Any]]:
        """This unit's optimizer state for its step: read ahead, or read now."""
        pending, self._state = self._state, None
        start = time.perf_counter()
        with record_function("FSDP::disk_wait_read"):
            if pending is not None:
                state = pending.wait()
            elif self.optim_layout is None:
                state = {}
            else:
                state = read_state(self.tier.store, self.entry, self.optim_layout)
        self.tier.waited(time.perf_counter() - start)
        return state


class TieredUnit(Protocol):
    """What :func:`check_one_tier` reads of a unit (``UnitRuntime`` has it)."""

    label: str
    store: ShardStore
    handle: FlatParamHandle


def check_one_tier(units: Sequence[TieredUnit]) -> None:
    """At the root's first forward: either every unit holding parameters is on one disk
    tier, or none is (a unit left in memory would never be stepped by the tier's
    optimizer: its parameters would silently stay at their initial values).

    Raises:
        ValueError: naming a unit on disk and one not (or on another tier).
    """
    holding = [u for u in units if u.handle.infos]
    tiers = {id(tier) if (tier := _tier_of(u)) is not None else None for u in holding}
    if len(tiers) <= 1:
        return
    on_disk = next(u for u in holding if _tier_of(u) is not None)
    tier = _tier_of(on_disk)
    other = next(u for u in holding if _tier_of(u) is not tier)
    raise ValueError(
        f"{on_disk.label} is on a disk tier but {other.label} is "
        f"{'in memory' if _tier_of(other) is None else 'on another one'}: pass the same "
        "disk_offload=DiskOffload(...) to every FSDP unit of the model, the root included "
        "(with auto_wrap: to enable_wrap and to the outer FSDP)"
    )


_NOT_ON_DISK = {
    "clip_grad_norm_": "the units step inside backward, each as soon as its gradient is "
    "reduced, so no global gradient norm exists to clip by",
    "local_state_dict": "the shards live in the tier's files",
    "load_local_state_dict": "the shards live in the tier's files",
    "save_fsdp_sharded": "the shards and optimizer state live in the tier's files",
    "load_fsdp_sharded": "the shards and optimizer state live in the tier's files",
    "gather_full_optim_state_dict": "the optimizer state lives in the tier's files",
    "get_shard_from_optim_state_dict": "the optimizer state lives in the tier's files",
}


def refuse_on_disk(units: Sequence[TieredUnit], what: str) -> None:
    """Refuse an entry point that reads or writes shards, gradients or optimizer state in
    memory when the model is on a disk tier (between units' steps the shards are empty
    placeholders: a copy would read freed memory, a load would write into it, and the
    optimizer's ``state`` is empty).

    Args:
        units: the model's units.
        what: the entry point's name (a key of the reasons above).

    Raises:
        RuntimeError: a unit is on a disk tier; names the entry point, the reason, the
            directory and what to use instead.
    """
    tier = next((t for u in units if (t := _tier_of(u)) is not None), None)
    if tier is None:
        return
    raise RuntimeError(
        f"{what}() is not available with disk_offload: {_NOT_ON_DISK[what]} "
        f"({str(tier.store.directory.parent)!r}). The directory is the "
        "checkpoint (DiskOffload(directory, resume=True) continues from it, optimizer "
        "state included); model.state_dict() gives the full weights"
    )


def _tier_of(unit: TieredUnit) -> DiskOffload | None:
    """The disk tier ``unit``'s store is on, None for a unit in memory."""
    return unit.store.tier if isinstance(unit.store, DiskUnit) else None


def _refuse_unfinished(manifest: dict[str, Any], directory: Path) -> None:
    """Resuming: the directory's last step finished (see [Note: per-unit generations]).

    Raises:
        ValueError: naming the step, the units already at it and the others.
    """
    unfinished = manifest.get("unfinished")
    if not unfinished:
        return
    ahead = unfinished["units"]
    behind = sorted(set(manifest["units"]) - set(ahead))
    raise ValueError(
        f"the disk_offload directory {str(directory)!r} was left in the middle of step "
        f"{unfinished['generation']} with generations='unit': {', '.join(ahead)} hold that "
        f"step's values and their step-{manifest['generation']} files are gone, "
        f"{', '.join(behind) or 'no unit'} hold step {manifest['generation']}'s; no "
        "consistent step remains. Start again (from a checkpoint), and use "
        "generations='step' (room for two generations) where a crash must resume"
    )


def _check_same_generation(generation: int, group: dist.ProcessGroup | None) -> None:
    """Resuming: every rank of ``group`` is at the same committed generation.

    Raises:
        ValueError: naming the lowest and highest generation.
    """
    if not dist.is_initialized() or group_size(group) == 1:
        return
    both = torch.tensor([generation, -generation], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    highest, lowest = int(both[0]), -int(both[1])
    if highest != lowest:
        raise ValueError(
            f"the ranks' disk_offload directories hold generations {lowest} to {highest} "
            f"(this rank: {generation}); every rank must resume from the same step"
        )
