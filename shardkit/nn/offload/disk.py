"""The disk tier: each slice's parameters, gradients and optimizer state in files.

Directory layout (``<name>`` is ``slice<i>`` or ``shared``, ``<g>`` the generation)::

    manifest.json             generation, layouts, file names, optimizer class
    <name>.params.g<g>        raw bytes of the slice's flat parameter buffer
    <name>.optim.g<g>.pt      the slice's optimizer state dict (torch.save), after step 1
    buffers.g<g>.pt           module buffers (BatchNorm statistics, ...), torch.save
    <name>.grad               gradients accumulated since the last zero_grad (scratch)

[Note: crash safety]
Committed files are never modified. An optimizer step writes generation ``g + 1`` of
every file next to generation ``g`` (each through :func:`atomic_write`: a temporary
file, ``fsync``, rename), then replaces ``manifest.json`` atomically: that rename is
the commit point. A crash before it leaves generation ``g`` complete and referenced; a
reopen (``resume=True``) deletes the unreferenced generation ``g + 1`` files and the
scratch gradient files. The cost is disk space: two generations exist during a step.

[Note: what is resident]
Parameters are read into the slice's compute buffer (``readinto``, no second copy) and
the buffer is freed after use; gradients are added into ``<name>.grad`` through a
shared memory map, which is unmapped right away; optimizer state is loaded with
``torch.load(mmap=True)``. So a step holds one slice's parameters, gradients and
optimizer state at a time, plus the pinned ``shared`` group.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardkit.checkpoint.atomic import atomic_save, atomic_write
from shardkit.nn.offload.flat import LayoutEntry, SliceLayout
from shardkit.nn.offload.slices import Slice
from shardkit.nn.offload.tiers import Tier

__all__ = ["MANIFEST", "DiskTier"]

MANIFEST = "manifest.json"
FORMAT = "shardkit.offload/1"
_OWNED = re.compile(r"^(\.?(slice\d+|shared|buffers)\..*|\.manifest\.json\..*\.tmp)$")


def _placeholder(p: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=p.dtype, device=p.device)


def check_writable(directory: Path) -> None:
    """Create ``directory`` if needed and prove it is writable.

    Raises:
        ValueError: if the path exists and is not a directory, or cannot be written,
            naming the path and the fix.
    """
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"offload_dir {str(directory)!r} exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".shardkit-write-probe"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise ValueError(
            f"offload_dir {str(directory)!r} is not writable ({exc.strerror}); choose a "
            "directory you can write to, on a disk with room for two copies of the model "
            "state"
        ) from exc


class DiskTier(Tier):
    """Slices kept in files in ``directory``; one slice is resident at a time.

    Args:
        device: the compute device.
        directory: the offload directory (created if missing).
        resume: False (default): start from the model's values; the directory must not
            hold an offloaded model yet. True: continue from the committed generation in
            the directory (the model only gives the architecture; it may be on ``meta``).

    Raises:
        ValueError: for an unwritable directory, a directory that already holds a model
            when ``resume`` is False, or none when it is True.
    """

    kind = "disk"

    def __init__(self, device: torch.device, directory: str | os.PathLike[str], *, resume: bool):
        super().__init__(device)
        self.directory = Path(directory)
        self.resume = resume
        self.generation = 0
        self.optimizer_class: str | None = None
        self.buffers: dict[str, torch.Tensor] = {}
        self.grads_present: dict[str, set[int]] = {}
        self._files: dict[str, dict[str, str | None]] = {}
        self._init_fn: Callable[[nn.Module], None] | None = None
        check_writable(self.directory)
        has_manifest = (self.directory / MANIFEST).exists()
        if has_manifest and not resume:
            raise ValueError(
                f"offload_dir {str(self.directory)!r} already holds an offloaded model; pass "
                "resume=True to continue from it, or choose an empty directory"
            )
        if resume and not has_manifest:
            raise ValueError(
                f"resume=True but offload_dir {str(self.directory)!r} has no {MANIFEST}; "
                "pass resume=False to start a new offloaded model there"
            )

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
        self._files = {s.name: {"params": None, "optim": None} for s in slices}
        self.attach(slices)
        if self.resume:
            self._open_existing()
        else:
            for s in slices:
                if s.pinned:
                    self._write_params(s, 0)
            self.commit(0)

    def _attach(self, s: Slice) -> None:
        s.attach_compute(self.device)
        if self.resume:
            s.point_at([_placeholder(p) for p in s.parameters])
            return
        assert s.compute is not None and s.module is not None
        s.compute.allocate()
        on_meta = any(p.numel() < e.nbytes // e.dtype.itemsize for p, e in _entries(s))
        if not on_meta:
            for view, p in zip(s.compute_views, s.parameters, strict=True):
                view.copy_(p.data)
        s.point_at(s.compute_views)
        if on_meta:
            assert self._init_fn is not None  # OffloadModel checks it
            self._init_fn(s.module)
        self._write_params(s, 0)
        self._release(s)

    def _open_existing(self) -> None:
        manifest = json.loads((self.directory / MANIFEST).read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{MANIFEST} has format {manifest.get('format')!r}, not {FORMAT!r}")
        self._check_layouts(manifest["layouts"])
        self.generation = int(manifest["generation"])
        self.optimizer_class = manifest.get("optimizer_class")
        self._files = manifest["files"]
        for s in self.slices:
            if s.pinned:
                self._read_pinned(s)
        self._read_buffers(manifest.get("buffers"))
        self._remove_unreferenced()

    def _check_layouts(self, stored: dict[str, list[dict[str, object]]]) -> None:
        mine = {s.name: s.layout.to_json() for s in self.slices}
        if sorted(stored) != sorted(mine):
            raise ValueError(
                f"offload_dir holds slices {sorted(stored)} but this model has {sorted(mine)}; "
                "use the same num_slices (and model) as the run that wrote it"
            )
        for name, entries in mine.items():
            if stored[name] != entries:
                diff = next((a, b) for a, b in zip(stored[name] + [{}], entries + [{}]) if a != b)
                raise ValueError(
                    f"{name} in offload_dir does not match the model: stored {diff[0]}, "
                    f"model {diff[1]}; use the architecture that wrote the directory"
                )

    # -- moving slices -----------------------------------------------------------------

    def _load(self, s: Slice) -> None:
        assert s.compute is not None
        s.compute.allocate()
        path = self.directory / str(self._files[s.name]["params"])
        _read_into(path, s.compute.tensor)
        s.point_at(s.compute_views)

    def _offload(self, s: Slice) -> None:
        self.flush_grads(s)
        self._release(s)

    def _release(self, s: Slice) -> None:
        assert s.compute is not None
        s.point_at([_placeholder(v) for v in s.compute_views])
        s.compute.free()

    # -- gradients ---------------------------------------------------------------------

    def _grad_path(self, s: Slice) -> Path:
        return self.directory / f"{s.name}.grad"

    def flush_grads(self, s: Slice) -> None:
        """Add the resident gradients of ``s`` into its gradient file, then drop them."""
        with_grad = [(i, p) for i, p in enumerate(s.parameters) if p.grad is not None]
        if not with_grad:
            return
        path = self._grad_path(s)
        if not path.exists():
            with open(path, "wb") as handle:
                handle.truncate(s.layout.nbytes)  # zeros, sparse until written
        mapped = torch.from_file(str(path), shared=True, size=s.layout.nbytes, dtype=torch.uint8)
        views = s.layout.views(mapped)
        present = self.grads_present.setdefault(s.name, set())
        for i, p in with_grad:
            assert p.grad is not None
            views[i].add_(p.grad.to(views[i].device))
            present.add(i)
            p.grad = None
        del views, mapped  # unmaps: the pages leave this process's resident set

    def open_grads(self, s: Slice) -> None:
        """Point the gradients of resident ``s`` at its gradient file (None where absent)."""
        present = self.grads_present.get(s.name, set())
        if not present:
            return
        mapped = torch.from_file(
            str(self._grad_path(s)), shared=False, size=s.layout.nbytes, dtype=torch.uint8
        )
        for i, (p, view) in enumerate(zip(s.parameters, s.layout.views(mapped), strict=True)):
            p.grad = view.to(self.device) if i in present else None

    def zero_grads(self) -> None:
        """Forget all gradients: delete the gradient files, drop the pinned ones."""
        for s in self.slices:
            with contextlib.suppress(FileNotFoundError):
                self._grad_path(s).unlink()
            if s.pinned:
                for p in s.parameters:
                    p.grad = None
        self.grads_present.clear()

    # -- generations -------------------------------------------------------------------

    def step_slice(self, s: Slice, generation: int, optim_state: dict[str, Any]) -> None:
        """Write generation ``generation`` of resident ``s``: parameters and optimizer state."""
        self._write_params(s, generation)
        name = f"{s.name}.optim.g{generation}.pt"
        atomic_save(optim_state, self.directory / name)
        self._files[s.name]["optim"] = name

    def load_optim_state(self, s: Slice) -> dict[str, Any] | None:
        """The committed optimizer state of ``s`` (memory-mapped), or None before step 1."""
        name = self._files[s.name]["optim"]
        if name is None:
            return None
        state: dict[str, Any] = torch.load(
            self.directory / name, mmap=True, weights_only=True, map_location=self.device
        )
        return state

    def commit(self, generation: int, optimizer_class: str | None = None) -> None:
        """Make ``generation`` the committed one (atomic), then delete the older files."""
        if optimizer_class is not None:
            self.optimizer_class = optimizer_class
        self._write_buffers(generation)
        manifest = {
            "format": FORMAT,
            "generation": generation,
            "optimizer_class": self.optimizer_class,
            "layouts": {s.name: s.layout.to_json() for s in self.slices},
            "files": self._files,
            "buffers": f"buffers.g{generation}.pt",
        }
        with atomic_write(self.directory / MANIFEST, "w") as handle:
            json.dump(manifest, handle, indent=1)
        self.generation = generation
        self._remove_unreferenced()

    def _write_params(self, s: Slice, generation: int) -> None:
        name = f"{s.name}.params.g{generation}"
        with atomic_write(self.directory / name) as handle:
            _write_tensor(handle, _flat_bytes(s))
        self._files[s.name]["params"] = name

    def _read_pinned(self, s: Slice) -> None:
        flat = torch.empty(s.layout.nbytes, dtype=torch.uint8)
        _read_into(self.directory / str(self._files[s.name]["params"]), flat)
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

    def _remove_unreferenced(self) -> None:
        keep = {MANIFEST, f"buffers.g{self.generation}.pt"}
        for files in self._files.values():
            keep.update(f for f in files.values() if f is not None)
        keep.update(f"{s.name}.grad" for s in self.slices if s.name in self.grads_present)
        for entry in os.listdir(self.directory):
            if _OWNED.match(entry) and entry not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.directory / entry)

    def stored_layout(self, name: str) -> SliceLayout:
        """The layout of slice ``name`` (for tools reading the directory)."""
        return next(s.layout for s in self.slices if s.name == name)


def _entries(s: Slice) -> list[tuple[torch.Tensor, LayoutEntry]]:
    return list(zip(s.parameters, s.layout.entries, strict=True))


def _flat_bytes(s: Slice) -> torch.Tensor:
    """The CPU ``uint8`` bytes of ``s``'s parameters in layout order."""
    if s.compute is not None and s.compute.is_allocated:
        return s.compute.tensor.cpu()
    flat = torch.zeros(s.layout.nbytes, dtype=torch.uint8)
    for view, p in zip(s.layout.views(flat), s.parameters, strict=True):
        view.copy_(p.data)
    return flat


def _bytes_view(flat: torch.Tensor) -> memoryview:
    """A writable byte view of the contiguous CPU ``uint8`` tensor ``flat`` (no copy).

    Through ``ctypes``, not ``Tensor.numpy()``: the latter marks the storage as not
    resizable for good, which would break :meth:`FlatBuffer.free`.
    """
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * flat.numel()).from_address(flat.data_ptr())).cast("B")


def _write_tensor(handle: Any, flat: torch.Tensor) -> None:
    handle.write(_bytes_view(flat))


def _read_into(path: Path, flat: torch.Tensor) -> None:
    """Fill the ``uint8`` tensor ``flat`` with the bytes of ``path`` (same size)."""
    if flat.device.type == "cpu":
        with open(path, "rb") as handle:
            got = handle.readinto(_bytes_view(flat))
    else:
        staged = torch.from_file(str(path), shared=False, size=flat.numel(), dtype=torch.uint8)
        flat.copy_(staged)
        got = flat.numel()
    if got != flat.numel():
        raise RuntimeError(f"{path} holds {got} bytes, expected {flat.numel()}: truncated file")
