"""Deferred initialisation: a unit's parameters built on the meta device, materialised
one unit at a time, so no rank ever holds the whole model unsharded.

[Note: deferred initialisation]
A model built under ``torch.device("meta")`` has shapes and no memory. Each unit, when
it is constructed (``auto_wrap`` constructs the innermost first), materialises only
its own modules (not nested units', already sharded) on the compute device, initialises
them, flattens and shards them, and frees the full copy. Peak memory while wrapping is
the shards made so far plus one unit's full parameters, instead of the whole model on
every rank (the 2x-the-model construction peak of FairScale's FSDP). Rank 0's values
are broadcast to the other ranks afterwards, as for an eagerly built module, so ranks
agree whatever their random state.

Initialisation: ``param_init_fn(module)`` is called once per module that owns a meta
parameter or buffer, and must materialise that module's own tensors (for example
``module.to_empty(device=..., recurse=False)`` then an init). Without one, each such
module is moved with ``to_empty(recurse=False)`` and its ``reset_parameters()`` is
called (torch's modules all have one). A tied parameter (an LM head sharing the token
embedding's weight) is materialised once, by the first module that registers it, and
re-tied at its other places.

Source: torch FSDP1's ``param_init_fn`` and FSDP2's meta-device recipe
(``to_empty`` + ``reset_parameters``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from shardkit.nn.data_parallel.fully_sharded.sharing import walk_unit

__all__ = ["ParamInitFn", "has_meta", "materialize_unit"]

ParamInitFn = Callable[[nn.Module], None]


def _own_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from (p for p in module._parameters.values() if p is not None)
    yield from (b for b in module._buffers.values() if b is not None)


def has_meta(module: nn.Module, is_unit: Callable[[nn.Module], bool]) -> bool:
    """True when the unit's own tensors (not nested units') include meta tensors and its
    parameters are all on meta (a unit mixing meta and real parameters is left to the
    device check, which names both)."""
    owned = [m for _, m in walk_unit(module, is_unit)]
    params = [p for m in owned for p in m._parameters.values() if p is not None]
    return any(t.is_meta for m in owned for t in _own_tensors(m)) and all(p.is_meta for p in params)


def materialize_unit(
    module: nn.Module,
    is_unit: Callable[[nn.Module], bool],
    device: torch.device,
    param_init_fn: ParamInitFn | None,
) -> None:
    """Materialise and initialise the unit's meta parameters and buffers on ``device``.

    Args:
        module: the module the unit wraps; nested units are not entered.
        is_unit: True for a nested unit's module.
        device: where the full parameters go (the unit's compute device).
        param_init_fn: called on each module owning a meta tensor; default None:
            ``to_empty(device=device, recurse=False)`` and ``reset_parameters()``.

    Raises:
        ValueError: a module with meta tensors has no ``reset_parameters`` and no
            ``param_init_fn`` was given, or a tensor is still on meta afterwards.
    """
    done: dict[int, nn.Parameter] = {}  # id(meta parameter) -> its materialised one
    for name, mod in walk_unit(module, is_unit):
        for attr, param in mod._parameters.items():  # re-tie what an earlier module made
            if param is not None and id(param) in done:
                mod._parameters[attr] = done[id(param)]
        before = {attr: p for attr, p in mod._parameters.items() if p is not None and p.is_meta}
        if not any(t.is_meta for t in _own_tensors(mod)):
            continue
        _init_one(mod, name.rstrip(".") or type(module).__name__, device, param_init_fn)
        for attr, old in before.items():
            new = mod._parameters[attr]
            if new is not None:
                done[id(old)] = new
    left = [
        f"{prefix}{attr}"
        for prefix, mod in walk_unit(module, is_unit)
        for attr, t in [*mod._parameters.items(), *mod._buffers.items()]
        if t is not None and t.is_meta
    ]
    if left:
        raise ValueError(
            f"param_init_fn left {left[:3]} on the meta device: it must materialise the "
            "module it is given, e.g. module.to_empty(device=..., recurse=False) then init"
        )


def _init_one(
    mod: nn.Module, where: str, device: torch.device, param_init_fn: ParamInitFn | None
) -> None:
    if param_init_fn is not None:
        param_init_fn(mod)
        return
    reset = getattr(mod, "reset_parameters", None)
    if not callable(reset):
        raise ValueError(
            f"module `{where}` ({type(mod).__name__}) has parameters on the meta device and "
            "no reset_parameters() to initialise them: pass param_init_fn=... to "
            "FullyShardedDataParallel (a function that materialises and initialises one module)"
        )
    mod.to_empty(device=device, recurse=False)
    with torch.no_grad():
        reset()
