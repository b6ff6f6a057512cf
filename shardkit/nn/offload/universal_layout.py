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

The disk tier (parameters and optimizer state in files, empty placeholders in
memory) is refused with ``ValueError``: save its ``state_dict()`` instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import accumulate
from typing import Any

import torch.distributed as dist

from shardkit.checkpoint.universal.adapters import tied_aliases
from shardkit.checkpoint.universal.layout import ParamEntry, register_layout
from shardkit.checkpoint.universal.optim_state import optimizer_params
from shardkit.checkpoint.universal.tensor_views import strategy_name, view_of
from shardkit.checkpoint.universal.whole import whole_entries
from shardkit.nn.offload.api import OffloadModel
from shardkit.nn.offload.disk import DiskTier

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
    """The adapter of an :class:`OffloadModel` on a memory tier (see the module).

    Raises:
        ValueError: the model is on the disk tier.
    """

    def __init__(self, model: OffloadModel, optimizer: Any = None) -> None:
        if isinstance(model.tier, DiskTier):
            raise ValueError(
                "the universal checkpoint does not read an OffloadModel on the disk tier "
                "(its parameters and optimizer state are files in offload_dir): save "
                "model.state_dict() instead, or use a memory tier"
            )
        self.model = model
        self.held = optimizer_params(optimizer) if optimizer is not None else {}
        self.writer = not dist.is_initialized() or dist.get_rank() == 0
        self.strategy = strategy_name("offload", (view_of(p) for p in model.parameters()))

    def _rename(self, key: str) -> str:
        return original_key(key, self.model.balance)

    def entries(self) -> Iterable[ParamEntry]:
        """Every tensor whole, under the plain model's key."""
        writer = self.writer
        return whole_entries(self.model, self.held, lambda t, p: writer, self._rename)

    def aliases(self) -> dict[str, str]:
        """Tied keys, ``{other key: first key}``, under the plain model's keys."""
        return {self._rename(k): self._rename(v) for k, v in tied_aliases(self.model).items()}

    def after_load(self) -> None:
        """Nothing: the master copies were filled in place (no slice is resident)."""


register_layout(OffloadModel, OffloadLayout)
