"""Optimizer state of a sharded model: as flat shards per unit, gathered, or re-sharded.

The optimizer steps the sharded parameters, so its per-parameter state tensors
(``exp_avg``, ``exp_avg_sq``, ...) are 1-D pieces shaped like them, and scalars
(``step``) are the same on every rank. A unit's pieces of one state key laid out like
its parameters form a flat shard ``(S,)``, which gathers and re-shards exactly like the
flat parameter: :func:`flat_optim_state` builds them, :func:`load_flat_optim_state`
takes them back, :func:`gather_full` all-gathers them into the state dict of the
unwrapped model, :func:`shard_full` cuts such a dict into this rank's share.

A state tensor counts as sharded when it has the sharded parameter's shape (1-D);
0-dim tensors and Python values are kept as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardkit.nn.data_parallel.fully_sharded.collectives import all_gather_flat
from shardkit.nn.data_parallel.fully_sharded.unit import UnitRuntime, named_units

__all__ = [
    "flat_optim_state",
    "flat_optim_state_dict",
    "gather_full",
    "load_flat_optim_state",
    "shard_full",
]

# unit key -> state key -> flat shard (S,)
FlatState = dict[str, dict[str, torch.Tensor]]


def _names(root: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in root.named_parameters()}


def _is_sharded(value: Any, param: nn.Parameter) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def flat_optim_state(
    root: nn.Module, optim: torch.optim.Optimizer
) -> tuple[FlatState, dict[str, dict[str, Any]]]:
    """This rank's optimizer state as (flat shards per unit and key, scalars per name).

    Padding and frozen parameters are zeros in the flat shards. Every parameter with
    state has an entry in the scalars (empty for SGD's momentum-only state); those the
    optimizer has no state for have none.
    """
    names = _names(root)
    flat: FlatState = {}
    scalars: dict[str, dict[str, Any]] = {}
    for key, unit in named_units(root).items():
        handle, per_key = unit.handle, {}
        for index, param in enumerate(handle.sharded_params):
            a, b = handle.layout.piece(index, handle.rank)
            param_state = optim.state.get(param, {})
            if param_state:  # present even without scalars (SGD: only momentum_buffer)
                scalars.setdefault(names[id(param)], {})
            for state_key, value in param_state.items():
                if _is_sharded(value, param):
                    if state_key not in per_key:
                        per_key[state_key] = value.new_zeros(handle.layout.shard_numel)
                    per_key[state_key][a:b].copy_(value)
                else:
                    scalars.setdefault(names[id(param)], {})[state_key] = _copy(value)
        flat[key] = per_key
    return flat, scalars


def load_flat_optim_state(
    root: nn.Module,
    optim: torch.optim.Optimizer,
    flat: FlatState,
    scalars: Mapping[str, Mapping[str, Any]],
    param_groups: list[dict[str, Any]],
) -> None:
    """Load flat shards and scalars (as from :func:`flat_optim_state`) into ``optim``.

    ``param_groups``' hyperparameters replace ``optim``'s (same number of groups).
    """
    optim.load_state_dict(flat_optim_state_dict(root, optim, flat, scalars, param_groups))


def flat_optim_state_dict(
    root: nn.Module,
    optim: torch.optim.Optimizer,
    flat: FlatState,
    scalars: Mapping[str, Mapping[str, Any]],
    param_groups: list[dict[str, Any]],
) -> dict[str, Any]:
    """The state dict :func:`load_flat_optim_state` loads into ``optim`` (built, not
    loaded: ``optim`` is unchanged)."""
    names, local = _names(root), optim.state_dict()
    index = {id(p): i for i, p in enumerate(p for g in optim.param_groups for p in g["params"])}
    state: dict[int, dict[str, Any]] = {}
    for key, unit in named_units(root).items():
        handle = unit.handle
        for i, param in enumerate(handle.sharded_params):
            if id(param) not in index:
                continue
            a, b = handle.layout.piece(i, handle.rank)
            if names[id(param)] not in scalars:
                continue  # no state saved for this parameter
            entry = {k: _copy(v) for k, v in scalars[names[id(param)]].items()}
            entry.update({k: t[a:b].clone() for k, t in flat.get(key, {}).items()})
            state[index[id(param)]] = entry
    groups = [
        {**saved, "params": own["params"]}
        for saved, own in zip(param_groups, local["param_groups"])
    ]
    return {"state": state, "param_groups": groups}


def gather_full(
    root: nn.Module, optim: torch.optim.Optimizer, recipient_rank: int = 0
) -> dict[str, Any] | None:
    """All-gather ``optim``'s state into the optimizer state dict of the unwrapped model.

    A collective over the root's process group; the result (full-shape tensors, the
    same indices and ``param_groups`` as ``optim.state_dict()``) is returned on group
    rank ``recipient_rank``, None elsewhere.
    """
    flat, scalars = flat_optim_state(root, optim)
    local = optim.state_dict()
    order = [p for g in optim.param_groups for p in g["params"]]
    position = {id(p): i for i, p in enumerate(order)}
    names = _names(root)
    full: dict[int, dict[str, Any]] = {}
    for key, unit in named_units(root).items():
        handle = unit.handle
        gathered = {}
        for state_key in sorted(flat[key]):
            out = handle.local_shard.new_empty(handle.layout.padded)
            all_gather_flat(out, flat[key][state_key], unit.process_group).wait()
            gathered[state_key] = out
        for i, (param, offset) in enumerate(zip(handle.sharded_params, handle.layout.offsets)):
            name, info = names[id(param)], handle.infos[i]
            if id(param) not in position or name not in scalars:
                continue
            entry = dict(scalars[name])
            for state_key, out in gathered.items():
                entry[state_key] = out[offset : offset + info.numel].view(info.shape).clone()
            full[position[id(param)]] = entry
    if next(iter(named_units(root).values())).rank != recipient_rank:  # the root's
        return None
    return {"state": full, "param_groups": local["param_groups"]}


def shard_full(
    root: nn.Module,
    full: Mapping[str, Any],
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """This rank's share of an unwrapped model's optimizer state dict (no communication).

    Index ``k`` of ``full`` is matched to a parameter through ``optim``'s parameter
    order when given, else through ``param_names`` in ``full``'s groups (optimizers
    built from ``named_parameters()``), else through ``root.parameters()``'s order.

    Raises:
        ValueError: a full state tensor's shape does not match its parameter.
    """
    params = _params_in_order(root, full, optim)
    state: dict[int, dict[str, Any]] = {}
    for k, entry in full["state"].items():
        unit, i = _owner(root, params[int(k)])
        handle, info = unit.handle, unit.handle.infos[i]
        lo, _ = handle.layout.shard_range(handle.rank)
        a, b = handle.layout.piece(i, handle.rank)
        start = lo + a - handle.layout.offsets[i] if b > a else 0
        state[k] = {
            key: _cut(value, info.shape, start, b - a, key)
            if _is_tensor_state(value)
            else _copy(value)
            for key, value in entry.items()
        }
    return {"state": state, "param_groups": list(full["param_groups"])}


def _copy(value: Any) -> Any:
    """A copy of a tensor (a 0-dim ``step`` must not be shared between optimizers)."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _is_tensor_state(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _cut(value: torch.Tensor, shape: torch.Size, start: int, length: int, key: str) -> torch.Tensor:
    if value.shape != shape:
        raise ValueError(
            f"optimizer state {key!r} has shape {tuple(value.shape)} != {tuple(shape)}"
        )
    return value.reshape(-1)[start : start + length].clone()


def _params_in_order(
    root: nn.Module, full: Mapping[str, Any], optim: torch.optim.Optimizer | None
) -> list[nn.Parameter]:
    if optim is not None:
        return [p for g in optim.param_groups for p in g["params"]]
    groups = full["param_groups"]
    if all("param_names" in g for g in groups):
        by_name = dict(root.named_parameters())
        return [by_name[n] for g in groups for n in g["param_names"]]
    return list(root.parameters())


def _owner(root: nn.Module, param: nn.Parameter) -> tuple[UnitRuntime, int]:
    for unit in named_units(root).values():
        for i, sharded in enumerate(unit.handle.sharded_params):
            if sharded is param:
                return unit, i
    raise ValueError("a parameter of the optimizer state dict is not a sharded parameter of root")
