"""Which parameters a unit takes, and the checks on them: tied weights, devices, dtypes.

A unit takes every parameter registered in its module's tree except those under a
nested unit (already wrapped, inside-out). A parameter registered at several places
(an LM head tied to the token embedding) is one parameter with several locations, and
must lie in one unit: a wrapping that puts its locations in two units raises
:class:`SharedParameterError` naming both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from shardkit.distributed.optim_guard import add_step_check, mark_replaced
from shardkit.distributed.shard_descriptor import view_of
from shardkit.nn.data_parallel.fully_sharded.flat_param import ParamInfo, ParamLocation
from shardkit.nn.module_tree import walk_unit
from shardkit.optim.whole_tensor import needs_whole_tensors

__all__ = [
    "SharedParameterError",
    "collect_params",
    "mark_taken",
    "refuse_whole_tensor_optimizer",
    "shared_parameter_names",
    "walk_unit",
]

# original parameter -> "<where it is>" of the unit that took it (for error messages)
_TAKEN = WeakIdKeyDictionary()
# sharded parameter -> None, for every sharded parameter made by any unit
_SHARDED = WeakIdKeyDictionary()


class SharedParameterError(ValueError):
    """A parameter shared by two modules would be split across two FSDP units."""


def collect_params(
    module: nn.Module, is_unit: Callable[[nn.Module], bool], unit_label: str
) -> list[ParamInfo]:
    """The unique parameters of the unit wrapping ``module``, in module order.

    Raises:
        ValueError: a parameter is already a sharded parameter (the module is wrapped).
        SharedParameterError: a parameter was taken by another unit (a split tie).
    """
    infos: dict[int, ParamInfo] = {}
    for prefix, mod in walk_unit(module, is_unit):
        for attr, param in mod._parameters.items():
            if param is None:
                continue
            name = f"{prefix}{attr}"
            _check_not_taken(param, name, unit_label)
            if id(param) not in infos:
                infos[id(param)] = ParamInfo(param.shape, param.requires_grad, view=view_of(param))
            infos[id(param)].locations.append(ParamLocation(mod, attr, name))
    return list(infos.values())


def _check_not_taken(param: nn.Parameter, name: str, unit_label: str) -> None:
    if param in _SHARDED:
        raise ValueError(
            f"parameter `{name}` of {unit_label} is already sharded by an FSDP unit: the "
            "module (or a part of it) is wrapped twice; wrap each module once"
        )
    if param in _TAKEN:
        raise SharedParameterError(
            f"parameter `{name}` of {unit_label} is the same tensor as {_TAKEN[param]}, which "
            "is already in another FSDP unit: a tied parameter must live in one unit. Wrap "
            "the common ancestor of both modules instead (auto_wrap does this), or untie them"
        )


def mark_taken(
    originals: list[nn.Parameter], infos: list[ParamInfo], unit_label: str, sharded: list[Any]
) -> None:
    """Record that a unit took ``originals`` (described by ``infos``) and made ``sharded``."""
    for param, info in zip(originals, infos):
        _TAKEN[param] = f"`{info.name}` of {unit_label}"
        mark_replaced(  # an optimizer built before wrapping would step nothing
            param,
            name=_TAKEN[param],
            wrapper="FullyShardedDataParallel",
            fix="the optimizer was built before wrapping and would step nothing. Build it "
            "after wrapping, from the wrapped model's parameters() or named_parameters()",
        )
    for param, info in zip(sharded, infos):
        _SHARDED[param] = f"`{info.name}` of {unit_label}, {tuple(info.shape)}"
    add_step_check(refuse_whole_tensor_optimizer)  # the one optimizer-step guard


def refuse_whole_tensor_optimizer(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """Optimizer step pre-hook: an optimizer that needs whole tensors (Muon, Adafactor,
    LAMB: :func:`shardkit.optim.needs_whole_tensors`) stepping FSDP's 1-D pieces would
    train another model silently; refused before its first update. Costs one class
    lookup for any other optimizer.

    Raises:
        ValueError: naming the parameter and the fix.
    """
    if not needs_whole_tensors(optimizer):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            where = _SHARDED.get(param)
            if where is not None:
                raise ValueError(
                    f"{type(optimizer).__name__} needs whole tensors but steps {where} as "
                    f"FSDP's 1-D piece of {param.numel()} elements: it would compute on the "
                    "piece, not the tensor. Use shardkit.optim.WholeTensorOptimizer(model, "
                    f"[{{'params': ..., 'optim': {type(optimizer).__name__}, ...}}, ...], "
                    "process_group=<FSDP's shard group>), which steps each parameter whole "
                    "on one owner rank"
                )


def check_same_device_and_dtype(infos: list[ParamInfo], module: nn.Module) -> None:
    """Raise ValueError naming the parameters if a unit mixes devices or dtypes."""
    for what in ("device", "dtype"):
        seen: dict[str, str] = {}
        for info in infos:
            loc = info.locations[0]
            value = str(getattr(loc.module._parameters[loc.attr], what))
            seen.setdefault(value, info.name)
        if len(seen) > 1:
            pairs = ", ".join(f"`{name}` on {value}" for value, name in seen.items())
            raise ValueError(
                f"an FSDP unit's parameters must share one {what}, but {type(module).__name__} "
                f"has {pairs}; move the module with .to(...) before wrapping"
            )


def shared_parameter_names(module: nn.Module) -> dict[str, list[str]]:
    """Parameters registered at more than one place: first name -> all dotted names.

    Used by auto-wrapping policies to keep tied parameters in one unit.
    """
    names: dict[int, list[str]] = {}
    for prefix, mod in walk_unit(module, lambda m: False):
        for attr, param in mod._parameters.items():
            if param is not None:
                names.setdefault(id(param), []).append(f"{prefix}{attr}")
    return {found[0]: found for found in names.values() if len(found) > 1}
