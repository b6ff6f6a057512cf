"""OffloadModel in the universal checkpoint: its slices under the original layer names.

``OffloadModel`` cuts an ``nn.Sequential`` into slices of consecutive layers
(``model_slices.<i>``, an ``nn.Sequential`` numbering its layers from 0); layer ``j``
of slice ``i`` is layer ``balance[0] + ... + balance[i - 1] + j`` of the original, so
``model_slices.<i>.<j>.<rest>`` is saved as ``<that index>.<rest>``, the plain
model's key (for a model given as a list of slices: the key in the ``nn.Sequential``
of all their layers).

On the memory tiers (resident, CPU memory) a parameter between uses is its master
copy (``param.data`` on the offload device), which the optimizer steps: each tensor is
one whole entry with the parameter as the optimizer's key. Every rank of a
data-parallel ``OffloadModel`` holds everything; rank 0 writes.

On the disk tier (parameters and optimizer state in files, empty placeholders in
memory) the entries are the same, with the :class:`~.optim.SlicedOptimizer` as the
optimizer: the adapter's ``session`` maps the tier's files under the parameters and
the optimizer state for the save or load (:mod:`.disk_universal`), and a load
commits a new generation of the directory in ``after_load``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from itertools import accumulate
from typing import Any

import torch.distributed as dist

from shardkit.checkpoint.universal.adapters import tied_aliases
from shardkit.checkpoint.universal.layout import (
    ParamEntry,
    Purpose,
    register_layout,
    strategy_name,
)
from shardkit.checkpoint.universal.optim_state import optimizer_params
from shardkit.checkpoint.universal.whole import whole_entries
from shardkit.distributed.shard_descriptor import ranks_of, view_of
from shardkit.nn.offload.api import OffloadModel
from shardkit.nn.offload.disk import DiskTier
from shardkit.nn.offload.disk_universal import DiskSession, disk_session
from shardkit.nn.offload.optim import SlicedOptimizer

__all__ = ["OffloadLayout", "original_key"]

_PREFIX = "model_slices."


def original_key(key: str, balance: list[int]) -> str:
    """The plain ``nn.Sequential``'s key of ``OffloadModel`` state-dict key ``key``
    (``model_slices.<i>.<j>.<rest>`` -> ``<sum(balance[:i]) + j>.<rest>``).

    Raises:
        ValueError: ``key`` is not under ``model_slices.<i>.<j>`` with ``i`` a slice
            and ``j`` one of its layers (all named).
    """
    parts = key.split(".", 3)
    if len(parts) < 4 or parts[0] + "." != _PREFIX or not (parts[1] + parts[2]).isdigit():
        raise ValueError(f"{key!r} is not an OffloadModel key model_slices.<i>.<j>.<name>")
    i, j = int(parts[1]), int(parts[2])
    if i >= len(balance) or j >= balance[i]:
        raise ValueError(f"{key!r}: no layer {j} in slice {i} of balance {balance}")
    return f"{[0, *accumulate(balance)][i] + j}.{parts[3]}"


class OffloadLayout:
    """The adapter of an :class:`OffloadModel` (see the module).

    Args:
        model: the OffloadModel.
        optimizer: the optimizer stepping it, or None; on the disk tier its
            :meth:`~OffloadModel.sliced_optimizer`.

    Raises:
        ValueError: on the disk tier, ``optimizer`` is not the model's sliced optimizer.
    """

    def __init__(self, model: OffloadModel, optimizer: Any = None) -> None:
        self.disk = model.tier if isinstance(model.tier, DiskTier) else None
        sliced = isinstance(optimizer, SlicedOptimizer) and optimizer.tier is self.disk
        if self.disk is not None and optimizer is not None and not sliced:
            raise ValueError(
                f"an OffloadModel on the disk tier keeps its optimizer state in "
                f"{str(self.disk.directory)!r}: pass its model.sliced_optimizer(...), "
                f"not a {type(optimizer).__name__}"
            )
        self.model = model
        self.optimizer = optimizer
        self.held = optimizer_params(optimizer) if optimizer is not None else {}
        self.writer = not dist.is_initialized() or dist.get_rank() == 0
        self.strategy = strategy_name("offload", (view_of(p) for p in model.parameters()))
        self._session: DiskSession | None = None

    @contextlib.contextmanager
    def session(self, purpose: Purpose) -> Iterator[None]:
        """On the disk tier, the tier's files under the parameters and optimizer state
        for one save or load (:class:`~.disk_universal.DiskSession`); else nothing."""
        if self.disk is None:
            yield
            return
        with disk_session(self.disk, self.optimizer, purpose) as opened:
            self._session = opened
            try:
                yield
            finally:
                self._session = None

    def _rename(self, key: str) -> str:
        return original_key(key, self.model.balance)

    def entries(self) -> Iterable[ParamEntry]:
        """Every tensor whole, under the plain model's key.

        Raises:
            RuntimeError: on the disk tier, outside :meth:`session` (the parameters are
                empty placeholders there).
        """
        if self.disk is not None and self._session is None:
            raise RuntimeError(
                "the entries of a disk-tier OffloadModel exist inside its session() "
                "only (save_universal / load_universal enter it)"
            )
        writer = self.writer
        return whole_entries(
            self.model, self.held, lambda t, p: writer, self._rename, holders=ranks_of(None)
        )

    def aliases(self) -> dict[str, str]:
        """Tied keys, ``{other key: first key}``, under the plain model's keys."""
        return {self._rename(k): self._rename(v) for k, v in tied_aliases(self.model).items()}

    def after_load(self) -> None:
        """Memory tiers: nothing (the master copies were filled in place). Disk tier:
        commit the loaded tensors as the directory's next generation."""
        if self._session is not None:
            self._session.commit()


register_layout(OffloadModel, OffloadLayout)
