"""Optimizer state and hyperparameters in the universal checkpoint.

Saving: for a written piece whose ``param`` has optimizer state, every state tensor
shaped like ``param`` contributes the piece's range (:func:`state_slices`); a number
or a 0-dim tensor (Adam's ``step``) is a scalar. Loading creates or overwrites
``optimizer.state[param][name]`` the same way.

[Note: per-tensor optimizer state]
Some optimizers keep state of another shape than the parameter, one per whole tensor:
Adafactor's factored second moment (``row_var`` of shape ``(..., rows, 1)``,
``col_var`` of shape ``(..., 1, cols)``; Shazeer and Stern 2018, section 3). Such an
optimizer steps whole tensors only (OSS's owner, ShardedDataParallel's, FSDP's
``WholeTensorOptimizer`` owner, a plain model), so the rank holding the parameter
whole holds the state whole. It is saved as one piece with a shard descriptor of its
own, ``TensorView(state.shape)``, elements ``[0, numel)``, by the writer of the
parameter's element 0 (:class:`PerTensorState`); the saved pieces of a state whose
descriptor's global shape is not the key's are per-tensor state
(:func:`state_shape`). Loading gives the whole state to every optimizer that holds the
parameter whole, at any world size and wrapper, and refuses (before anything is
written) one that holds a piece of it. Param groups'
hyperparameters travel as JSON with the keys of their parameters
(:func:`group_records`, :func:`plan_hyperparameters`, :func:`restore_hyperparameters`), so a resumed run gets lr,
betas and weight decay per group back, whatever the new layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardkit.checkpoint.universal.layout import ParamEntry
from shardkit.checkpoint.universal.shardfile import SavedPiece, SavedScalar, dtype_name
from shardkit.distributed.shard_descriptor import TensorView

__all__ = [
    "PerTensorState",
    "entry_offset",
    "group_keys",
    "group_records",
    "holds_whole",
    "hyperparameter_problems",
    "hyperparameters",
    "is_per_tensor",
    "merge_group_keys",
    "optimizer_class",
    "optimizer_params",
    "plan_hyperparameters",
    "restore_hyperparameters",
    "state_shape",
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


@dataclass(frozen=True)
class PerTensorState:
    """An optimizer state tensor kept per whole tensor (see ``[Note: per-tensor
    optimizer state]``), saved whole: ``view`` is ``TensorView(tuple(tensor.shape))``."""

    view: TensorView
    tensor: torch.Tensor


def holds_whole(entry: ParamEntry) -> bool:
    """Whether ``entry``'s param is the whole original tensor (not a tensor-parallel
    part, not a flat shard's piece): the optimizer holding it may keep per-tensor state."""
    param = entry.param
    return (
        param is not None
        and entry.view.split_dim is None
        and param.numel() == math.prod(entry.view.global_shape)
    )


def state_slices(
    entry: ParamEntry, state: Mapping[str, Any]
) -> Iterator[tuple[str, torch.Tensor | SavedScalar | PerTensorState]]:
    """What to save of ``entry``'s param's optimizer state (``state``:
    ``optimizer.state[param]``): ``(name, piece of the state tensor)`` for element-wise
    state, ``(name, scalar)`` for a number or a 0-dim tensor (a one-element ``step``
    always, also for a 0-dim param), ``(name, PerTensorState)`` for a tensor of
    another shape when ``param`` is whole (:func:`holds_whole`) and ``entry`` holds its
    element 0 (so one rank writes it; see ``[Note: per-tensor optimizer state]``).

    Raises:
        ValueError: state of another shape on a param that is a piece of its tensor
            (the optimizer would not be exact there), or a non-number.
    """
    param = entry.param
    assert param is not None
    offset, n = entry_offset(entry), entry.stop - entry.start
    whole = holds_whole(entry)
    for name, value in sorted(state.items()):
        # "step" is a counter, whatever the param's shape (torch's optimizers name it so;
        # a 0-dim param's 0-dim step would otherwise look element-wise and load as a
        # 1-element tensor into a 1-D FSDP shard)
        counter = name == "step" and isinstance(value, torch.Tensor) and value.numel() == 1
        tensor = isinstance(value, torch.Tensor)
        if tensor and value.shape == param.shape and not counter:
            yield name, value.detach().reshape(-1)[offset : offset + n]
        elif tensor and value.numel() == 1 and (counter or value.ndim == 0 or not whole):
            yield name, SavedScalar(entry.key, name, value.item(), dtype_name(value.dtype))
        elif tensor and whole:
            if entry.start == 0:
                yield name, PerTensorState(TensorView(tuple(value.shape)), value.detach())
        elif isinstance(value, (bool, int, float)):
            yield name, SavedScalar(entry.key, name, value, None)
        else:
            what = tuple(value.shape) if tensor else type(value).__name__
            raise ValueError(
                f"{entry.key!r}: optimizer state {name!r} is {what}, the parameter "
                f"{tuple(param.shape)} of which this optimizer holds "
                f"{'a tensor-parallel part' if entry.view.split_dim is not None else 'a piece'}"
                f" ({param.numel()} of {math.prod(entry.view.global_shape)} elements): "
                "state of another shape than the parameter is saved only where the "
                "optimizer holds the whole tensor (OSS, ShardedDataParallel, "
                "WholeTensorOptimizer over FSDP, a plain model)"
            )


def state_shape(key_shape: tuple[int, ...], pieces: Sequence[SavedPiece]) -> tuple[int, ...]:
    """The global shape the saved ``pieces`` of one optimizer state of a key of shape
    ``key_shape`` must cover: the key's for element-wise state; for per-tensor state
    (pieces of one unsplit descriptor of another shape, see ``[Note: per-tensor
    optimizer state]``) the state's own."""
    shapes = {p.view.global_shape for p in pieces}
    if len(shapes) == 1 and all(p.view.split_dim is None for p in pieces):
        return next(iter(shapes))
    return tuple(key_shape)


def is_per_tensor(key_shape: Sequence[int], pieces: Sequence[SavedPiece]) -> bool:
    """Whether ``pieces`` (one optimizer state of a key of shape ``key_shape``) are
    per-tensor state (see :func:`state_shape`)."""
    return bool(pieces) and state_shape(tuple(key_shape), pieces) != tuple(key_shape)


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
