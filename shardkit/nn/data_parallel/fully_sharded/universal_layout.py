"""FSDP in the universal checkpoint: this rank's piece of every original parameter.

Every unit keeps, on rank ``r`` of its shard group, elements ``[r * S, (r + 1) * S)``
of its flat parameter (:class:`~.flat_param.FlatLayout`), and the optimizer steps one
1-D sharded parameter per original parameter (``handle.sharded_params``), a view of
that slice. So parameter ``i``'s piece on this rank is ``FlatLayout.piece(i, r)``
shifted by the parameter's offset: a flat element range of the original (local)
tensor, with the sharded parameter as its storage and as the optimizer's key. A
parameter is a tensor-parallel part when its original carried a view
(``ParamInfo.view``, taken at wrap time); its range is then within the part.

Writers: with hybrid sharding the replicas (same shard on each shard group) are
written by replica 0 only, decided per unit from the unit's own groups (a nested unit
over other ranks, such as an MoE layer's experts in a unit over ``edp`` inside a hybrid
root, writes each of its shards from the rank holding it); a tensor held whole by every tensor-parallel rank by
the shard group holding the lowest rank of its shard descriptor's replica group
(:func:`~shardkit.distributed.shard_descriptor.writes_replica`; no process-wide mesh);
buffers (whole on every rank) by rank 0 of the shard group. Every rank loads its
pieces, replicas included, so nothing is re-synchronised after loading.

A parameter none of whose elements is on this rank (a small bias past the end of the
rank's shard) is listed as an empty piece, written by nobody: loading still sets its
optimizer state on this rank (the step and the empty element-wise state), so every
rank's optimizer holds the saving run's state for every parameter.

Keys are those of the unwrapped model's state dict (tied weights: their first key),
from :func:`state_dict_keys`, whatever the nesting (``FSDP(FSDP(m))`` has ``m``'s keys).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.checkpoint.universal.layout import ParamEntry, strategy_name
from shardkit.checkpoint.universal.optim_state import optimizer_params
from shardkit.distributed.shard_descriptor import TensorView, ranks_of, view_of, writes_replica
from shardkit.nn.data_parallel.fully_sharded.unit import (
    UnitRuntime,
    as_sharded,
    named_units,
    units_in,
    unwrapped_module,
)

__all__ = ["FSDPLayout", "state_dict_keys"]


def state_dict_keys(model: nn.Module) -> tuple[dict[int, list[str]], dict[int, str]]:
    """The plain model's state-dict keys of every sharded parameter (every name of a
    tied one) and persistent buffer, by object id, from the module tree as it stands
    (no gathering: ``keep_vars`` state dict of the wrapped module, units in gathering
    mode so that their own state-dict hooks let it through). The keys are the plain
    model's however many units wrap it directly (``FSDP(FSDP(m))``)."""
    units = units_in(model)
    for unit in units:
        unit.gathering_state_dict = True
    try:
        raw = nn.Module.state_dict(unwrapped_module(model), keep_vars=True)
    finally:
        for unit in units:
            unit.gathering_state_dict = False
    params: dict[int, list[str]] = {}
    buffers: dict[int, str] = {}
    for key, value in raw.items():
        if isinstance(value, nn.Parameter):
            params.setdefault(id(as_sharded(units, value)), []).append(key)
        elif isinstance(value, torch.Tensor):
            buffers[id(value)] = key
    return params, buffers


class FSDPLayout:
    """The universal-checkpoint adapter of a root :class:`FullyShardedDataParallel`.

    Args:
        model: the root FSDP module (nested units are found in its tree).
        optimizer: the optimizer built over ``model.parameters()``, or None.

    Raises:
        TypeError: ``model`` is not a root FSDP module.
        ValueError: units on the disk tier (``disk_offload``).
    """

    def __init__(self, model: nn.Module, optimizer: Any = None) -> None:
        self.units = named_units(model)
        if "flat_param" not in self.units:
            raise TypeError(f"expected a root FullyShardedDataParallel; got {type(model).__name__}")
        on_disk = [label for label, unit in self.units.items() if not unit.store.in_memory]
        if on_disk:
            raise ValueError(
                f"the universal checkpoint does not save or load FSDP units on the disk tier "
                f"({len(on_disk)} units, e.g. {on_disk[0]!r}: their shards and optimizer "
                "state are files of the DiskOffload directory, empty in memory): that "
                "directory is the checkpoint (DiskOffload(..., resume=True)), or save "
                "model.state_dict()"
            )
        self.model = model
        self.root: UnitRuntime = self.units["flat_param"]
        self.held = optimizer_params(optimizer) if optimizer is not None else {}
        replicas = self.root.replicate_group
        self.replica_writer = replicas is None or dist.get_rank(replicas) == 0
        self.holders = ranks_of(self.root.process_group)
        self.strategy = strategy_name(
            "hsdp" if replicas is not None else "fsdp",
            [i.view for u in self.units.values() for i in u.handle.infos if i.view is not None],
        )

    def entries(self) -> Iterator[ParamEntry]:
        """One entry per original parameter (an empty one where this rank holds none of
        its elements), then buffers."""
        param_keys, buffer_keys = state_dict_keys(self.model)
        for unit in self.units.values():
            yield from self._unit_entries(unit, param_keys)
        for buf in self.model.buffers():
            key = buffer_keys.get(id(buf))
            if key is None:  # non-persistent: not in the state dict
                continue
            view = view_of(buf)
            write = (
                self.root.rank == 0 and self.replica_writer and writes_replica(view, self.holders)
            )
            yield ParamEntry(key, view, 0, buf.numel(), buf.detach(), None, write)

    def _unit_entries(
        self, unit: UnitRuntime, param_keys: dict[int, list[str]]
    ) -> Iterator[ParamEntry]:
        handle = unit.handle
        shard_start = handle.layout.shard_range(handle.rank)[0]
        replicas = unit.replicate_group  # this unit's: a nested unit may have other groups
        replica_writer = replicas is None or dist.get_rank(replicas) == 0
        holders = ranks_of(unit.process_group)
        for index, (info, sharded) in enumerate(zip(handle.infos, handle.sharded_params)):
            a, b = handle.layout.piece(index, handle.rank)
            # an empty piece (no element on this rank) is listed too, written by nobody
            # (a 0-element parameter: by rank 0): the load still sets its optimizer
            # state's scalars (step) on this rank
            start = shard_start + a - handle.layout.offsets[index] if b > a else 0
            view = info.view if info.view is not None else TensorView(tuple(info.shape))
            keys = param_keys.get(id(sharded))
            if not keys:
                raise KeyError(f"FSDP parameter `{info.name}` has no key in the model's state dict")
            holds = b > a or (view.local_numel == 0 and handle.rank == 0)
            yield ParamEntry(
                key=keys[0],
                view=view,
                start=start,
                stop=start + max(b - a, 0),
                tensor=sharded.detach(),
                param=sharded if id(sharded) in self.held else None,
                write=holds and replica_writer and writes_replica(view, holders),
            )

    def aliases(self) -> dict[str, str]:
        """Tied keys, ``{other key: first key}`` (a GPT's ``lm_head.weight`` ->
        ``wte.weight``), for the manifest (``convert`` writes every name)."""
        param_keys, _ = state_dict_keys(self.model)
        return {k: keys[0] for keys in param_keys.values() for k in keys[1:]}

    def after_load(self) -> None:
        """Nothing to do: every rank filled its own shards (replicas included) in place;
        the shard version counters moved, so a leftover full buffer counts as stale."""
