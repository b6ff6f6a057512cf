"""Optimizer state and hyperparameters in the universal checkpoint (element-wise optimizers).

Saving: for a written piece whose ``param`` has optimizer state, every state tensor
shaped like ``param`` contributes the piece's range (:func:`state_slices`); a number
or a one-element tensor of another shape is a scalar (Adam's ``step``). Loading
creates or overwrites ``optimizer.state[param][name]`` the same way. Param groups'
hyperparameters travel as JSON with the keys of their parameters
(:func:`group_records`, :func:`plan_hyperparameters`, :func:`restore_hyperparameters`), so a resumed run gets lr,
betas and weight decay per group back, whatever the new layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from shardkit.checkpoint.universal.layout import ParamEntry
from shardkit.checkpoint.universal.shardfile import SavedScalar, dtype_name

__all__ = [
    "entry_offset",
    "group_keys",
    "group_records",
    "hyperparameter_problems",
    "hyperparameters",
    "merge_group_keys",
    "optimizer_class",
    "optimizer_params",
    "plan_hyperparameters",
    "restore_hyperparameters",
    "state_slices",
]

_PLAIN = (bool, int, float, str, type(None))


def entry_offset(entry: ParamEntry) -> int:
    """Where ``entry``'s piece starts inside the flattened ``entry.param`` (see
    ``ParamEntry.param_offset``).

    Raises:
        ValueError: the offset cannot be derived and was not given.
    """
    param = entry.param
    assert param is not None
    n = entry.stop - entry.start
    if entry.param_offset is not None:
        offset = entry.param_offset
    elif n == 0:
        offset = 0
    elif entry.tensor.untyped_storage().data_ptr() == param.untyped_storage().data_ptr():
        offset = int(entry.tensor.storage_offset() - param.storage_offset())
    elif param.numel() == n:
        offset = 0
    else:
        raise ValueError(
            f"{entry.key!r}: piece of {n} elements, its param has {param.numel()} and "
            "another storage: the adapter must give ParamEntry.param_offset"
        )
    if not 0 <= offset <= param.numel() - n:
        raise ValueError(
            f"{entry.key!r}: piece [{offset}, {offset + n}) outside its param of "
            f"{param.numel()} elements"
        )
    return offset


def state_slices(
    entry: ParamEntry, state: Mapping[str, Any]
) -> Iterator[tuple[str, torch.Tensor | SavedScalar]]:
    """``(name, piece of the state tensor)`` for element-wise state, ``(name, scalar)``
    for scalar state, of ``entry``'s param (``state``: ``optimizer.state[param]``); a
    one-element ``step`` is always a scalar (also for a 0-dim param).

    Raises:
        ValueError: state of another shape (a factored moment), or a non-number.
    """
    param = entry.param
    assert param is not None
    offset, n = entry_offset(entry), entry.stop - entry.start
    for name, value in sorted(state.items()):
        # "step" is a counter, whatever the param's shape (torch's optimizers name it so;
        # a 0-dim param's 0-dim step would otherwise look element-wise and load as a
        # 1-element tensor into a 1-D FSDP shard)
        counter = name == "step" and isinstance(value, torch.Tensor) and value.numel() == 1
        if isinstance(value, torch.Tensor) and value.shape == param.shape and not counter:
            yield name, value.detach().reshape(-1)[offset : offset + n]
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            yield name, SavedScalar(entry.key, name, value.item(), dtype_name(value.dtype))
        elif isinstance(value, (bool, int, float)):
            yield name, SavedScalar(entry.key, name, value, None)
        else:
            what = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"{entry.key!r}: optimizer state {name!r} is {what}, the parameter "
                f"{tuple(param.shape)}: the universal checkpoint holds element-wise "
                "state (shaped like the parameter) and scalars only"
            )


def optimizer_class(optimizer: Any) -> str:
    """The name of the class whose state the optimizer holds: a wrapper's inner
    optimizer (``OSS.optim``: ``"AdamW"``), or the class an optimizer steps with
    instances of and names in its ``optimizer_class`` attribute (OffloadModel's
    ``SlicedOptimizer``: ``"AdamW"``), else the optimizer's own class."""
    inner = getattr(optimizer, "optim", None)
    if isinstance(inner, torch.optim.Optimizer):
        return type(inner).__name__
    stepped = getattr(optimizer, "optimizer_class", None)
    if isinstance(stepped, type) and issubclass(stepped, torch.optim.Optimizer):
        return stepped.__name__
    return type(optimizer).__name__


def optimizer_param_key(index: int) -> str:
    """The key of an optimizer's parameter saved without a model (``OSS.save_sharded``:
    ``save_universal(root, step, None, oss)``): ``"params.<index>"``, ``index`` its
    position in a plain ``torch.optim`` state dict (the concatenated param groups)."""
    return f"params.{index}"


def optimizer_params(optimizer: Any) -> dict[int, int]:
    """``{id(param): group index}``: the tensors ``optimizer.state`` is keyed by, per
    param group: the optimizer's ``state_param_groups`` (a list of tensors per group)
    when it has one (a ``WholeTensorOptimizer`` keys the state of a whole-tensor group
    by the owner's whole copies), else ``optimizer.param_groups``."""
    held = getattr(optimizer, "state_param_groups", None)
    if held is None:
        held = [group["params"] for group in optimizer.param_groups]
    return {id(p): g for g, params in enumerate(held) for p in params}


def group_keys(entries: Iterable[ParamEntry], optimizer: Any) -> dict[int, list[str]]:
    """``{group index: keys}``: the keys of the entries whose param is in each group."""
    where = optimizer_params(optimizer)
    out: dict[int, list[str]] = {}
    for entry in entries:
        if entry.param is not None and id(entry.param) in where:
            keys = out.setdefault(where[id(entry.param)], [])
            if entry.key not in keys:
                keys.append(entry.key)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return list(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return None


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's JSON-able hyperparameters (tuples as lists, a one-element
    tensor as its number; other values are left out)."""
    out = {}
    for k, v in group.items():
        plain = _plain(v)
        if k != "params" and (v is None or plain is not None):
            out[k] = plain
    return out


def group_records(optimizer: Any, keys: Mapping[int, list[str]]) -> list[dict[str, Any]]:
    """Per param group: ``{"hyper": hyperparameters, "keys": keys of its params}``."""
    return [
        {"hyper": hyperparameters(group), "keys": list(keys.get(g, []))}
        for g, group in enumerate(optimizer.param_groups)
    ]


def merge_group_keys(per_rank: Iterable[Mapping[int, list[str]]]) -> dict[int, list[str]]:
    """The union of every rank's :func:`group_keys` (a rank lists only the keys of the
    pieces it holds: an FSDP rank whose flat shard holds no element of a parameter,
    an OSS rank that owns none of a group's parameters)."""
    out: dict[int, list[str]] = {}
    for keys in per_rank:
        for g, names in keys.items():
            merged = out.setdefault(int(g), [])
            merged.extend(k for k in names if k not in merged)
    return out


def plan_hyperparameters(
    keys: Mapping[int, list[str]], saved: list[dict[str, Any]]
) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """Which saved hyperparameters each param group gets: ``({group index: saved
    hyperparameters}, problems)``, the hyperparameters of the saved group holding the
    group's keys (``keys``: :func:`merge_group_keys` over every rank, so that every
    rank sets every group, also one it holds no piece of). A problem: a group whose
    keys were in saved groups with different hyperparameters (then that group is
    left out)."""
    saved_of = {key: g for g, record in enumerate(saved) for key in record["keys"]}
    plan: dict[int, dict[str, Any]] = {}
    problems = []
    for g, names in sorted(keys.items()):
        found = sorted({saved_of[k] for k in names if k in saved_of})
        hypers = [saved[i]["hyper"] for i in found]
        if any(h != hypers[0] for h in hypers):
            problems.append(
                f"param group {g} holds keys of saved groups {found} with different "
                f"hyperparameters: {hypers}"
            )
        elif hypers:
            plan[g] = hypers[0]
    return plan, problems


def hyperparameter_problems(optimizer: Any, plan: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """What :func:`restore_hyperparameters` could not set, checked before a load writes
    anything: a saved value other than a number for a hyperparameter this optimizer
    holds as a tensor (filled in place, e.g. a tensor ``lr``)."""
    problems = []
    for g, hyper in sorted(plan.items()):
        group = optimizer.param_groups[g]
        for k, v in sorted(hyper.items()):
            current = group.get(k)
            number = isinstance(v, (bool, int, float))
            if isinstance(current, torch.Tensor) and v is not None and not number:
                problems.append(
                    f"param group {g}: {k!r} is a tensor here, the checkpoint holds {v!r}"
                )
    return problems


def restore_hyperparameters(optimizer: Any, plan: Mapping[int, Mapping[str, Any]]) -> None:
    """Set each planned param group's hyperparameters (see :func:`plan_hyperparameters`)."""
    for g, hyper in plan.items():
        _set_group(optimizer.param_groups[g], hyper)


def _set_group(group: dict[str, Any], hyper: Mapping[str, Any]) -> None:
    for k, v in hyper.items():
        current = group.get(k)
        if isinstance(current, torch.Tensor) and v is not None:
            current.fill_(v)
        elif isinstance(current, tuple) and isinstance(v, list):
            group[k] = tuple(v)
        else:
            group[k] = v
