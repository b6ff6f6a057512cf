"""Gradients accumulated between optimizer steps, in the disk tier's scratch files.

[Note: gradient files]
Gradients accumulated since the last ``zero_grad`` are the store's scratch files
``<name>.grad`` (see [Note: scratch files] in :mod:`shardkit.checkpoint.generations`):
written like every other file of the tier (direct I/O, write-behind with
``disk_io_bytes``, no memory map, no page cache), never named in a manifest, deleted by
``zero_grad`` and by a reopen. A slice's first backward writes its gradients as they
are (at their layout offsets, zeros elsewhere); a further backward before the step
reads the file, adds, and writes the sum. The step reads a slice's gradient file ahead
with its parameters and optimizer state. Backward's last slice is the step's first:
its gradients (when its file has none yet) are held in memory instead of written and
read back, and whatever loads the slice next (the step, or another forward) gets them
back as ``param.grad``, so a further backward adds to them. Whatever offloads it then
(the step, a ``state_dict()``, a forward) holds them again: they stay until
``zero_grad``, as gradients in a file do, and are written to the file only when they
no longer fit in ``disk_io_bytes``.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from shardkit.checkpoint.direct_io import segments_of
from shardkit.checkpoint.generations import GenerationStore
from shardkit.nn.offload.slices import Slice

__all__ = ["GradientFiles"]

KIND = "grad"  # the scratch files' kind: ``<name>.grad``


class GradientFiles:
    """The gradient file of each offloaded slice (see [Note: gradient files]).

    Args:
        store: the disk tier's store.
        device: the compute device (gradients handed back there).
        background: write behind (the tier has ``io_bytes``); False: wait for each write.

    Attributes:
        present: slice -> indices of the parameters its file holds gradients of.
        held: slice -> gradients held in memory instead of written (one per parameter).
        restored: resident slices whose gradients were held before their load (until
            :meth:`flush` or :meth:`hold` at their offload).
    """

    def __init__(self, store: GenerationStore, device: torch.device, background: bool) -> None:
        self.store = store
        self.device = device
        self.background = background
        self.present: dict[str, set[int]] = {}
        self.held: dict[str, list[torch.Tensor | None]] = {}
        self._ahead: dict[str, tuple[torch.Tensor, Future[int]]] = {}  # file bytes being read
        self.restored: set[str] = set()

    def flush(self, s: Slice) -> None:
        """Add the resident gradients of ``s`` into its gradient file, then drop them."""
        self.restored.discard(s.name)
        grads = [p.grad for p in s.parameters]
        for p in s.parameters:
            p.grad = None
        self._add(s, grads)

    def flush_held(self, s: Slice) -> None:
        """Add the held gradients of ``s`` into its gradient file, then forget them; ``s``
        may be offloaded (its parameters placeholders: nothing is handed to them)."""
        self._add(s, self.held.pop(s.name, []))

    def _add(self, s: Slice, grads: list[torch.Tensor | None]) -> None:
        """Add ``grads`` (one per parameter of ``s``, None: none) into its gradient file."""
        with_grad = [(i, g) for i, g in enumerate(grads) if g is not None]
        if not with_grad:
            return
        present = self.present.setdefault(s.name, set())
        segments: tuple[list[tuple[int, int, int]], int] | None = None
        if present:  # accumulate: the file's gradients plus these
            flat = self._file_bytes(s)
            views = s.layout.views(flat)
            for i, grad in with_grad:
                grad = grad.to(views[i].device)
                views[i].add_(grad) if i in present else views[i].copy_(grad)
            held = [flat]
        else:  # the gradients themselves at their offsets: no packing copy here
            held = [g.detach().cpu().contiguous() for _, g in with_grad]
            offsets = [s.layout.entries[i].offset for i, _ in with_grad]
            segments = (segments_of(held, offsets), s.layout.nbytes)
        present.update(i for i, _ in with_grad)
        future = self.store.write_async(s.name, KIND, 0, held, segments, scratch=True)
        if not self.background:
            self.store._wait(future)

    def hold(self, s: Slice) -> bool:
        """Take resident ``s``'s gradients into memory (not written) when its file has
        none yet; returns whether it did (the caller has counted their bytes)."""
        self.restored.discard(s.name)
        if not self.can_hold(s):
            return False
        self.held[s.name] = [p.grad for p in s.parameters]
        for p in s.parameters:
            p.grad = None
        return True

    def can_hold(self, s: Slice) -> bool:
        """Whether :meth:`hold` would take resident ``s``'s gradients."""
        return not self.present.get(s.name) and any(p.grad is not None for p in s.parameters)

    def restore(self, s: Slice) -> None:
        """Hand the held gradients of resident ``s`` back as ``param.grad`` (and note it
        in :attr:`restored`)."""
        held = self.held.pop(s.name, None)
        if held is None:
            return
        self.restored.add(s.name)
        for p, grad in zip(s.parameters, held, strict=False):
            p.grad = grad

    def read_ahead(self, s: Slice) -> None:
        """Start reading ``s``'s gradient file on the store's background thread (the
        caller has checked :meth:`needs_read` and counted the bytes)."""
        flat = self.store.buffers.take(s.layout.nbytes)
        self._ahead[s.name] = (flat, self.store.read_async(s.name, KIND, flat))

    def needs_read(self, s: Slice) -> bool:
        """``s`` has a gradient file not being read ahead yet."""
        return bool(self.present.get(s.name)) and s.name not in self._ahead

    def open(self, s: Slice) -> None:
        """Point the gradients of resident ``s`` at its gradient file's bytes (read
        ahead, or read now; None where absent); held gradients stay as they are."""
        present = self.present.get(s.name, set())
        if not present:
            return
        flat = self._file_bytes(s)
        for i, (p, view) in enumerate(zip(s.parameters, s.layout.views(flat), strict=True)):
            p.grad = view.to(self.device) if i in present else None

    def _file_bytes(self, s: Slice) -> torch.Tensor:
        """The bytes of ``s``'s gradient file (read ahead, or read now)."""
        ahead = self._ahead.pop(s.name, None)
        if ahead is not None:
            ahead[1].result()
            return ahead[0]
        flat = self.store.buffers.take(s.layout.nbytes)
        self.store.read(s.name, KIND, flat)
        return flat

    def drop_ahead(self, s: Slice) -> None:
        """Wait for a read-ahead of ``s``'s file and forget it."""
        ahead = self._ahead.pop(s.name, None)
        if ahead is not None:
            ahead[1].result()

    def zero(self, slices: list[Slice]) -> None:
        """Forget every gradient: held ones, read-aheads, the files."""
        self.held.clear()
        self.restored.clear()
        for s in slices:
            self.drop_ahead(s)
            self.store.remove_scratch(s.name, KIND)
        self.present.clear()
