"""Full (unsharded, unwrapped keys) and local (this rank's shards) state dicts.

[Note: keys without wrapper prefixes]
Each unit holds its module as ``_fsdp_wrapped_module``. ``state_dict()`` on the root
all-gathers every unit (``summon_full_params``) and calls the wrapped module's
``state_dict``; ``nn.Module.state_dict`` recurses through each child's ``state_dict``,
so a nested unit in gathering mode passes its prefix straight to its own wrapped
module and no ``_fsdp_wrapped_module.`` appears in a key. Loading goes the other way,
through the hooks of :mod:`shardkit.nn.prefix_hooks` (shared with
``checkpoint_wrapper``): a load pre-hook on each unit inserts ``_fsdp_wrapped_module.``
after the unit's prefix, and a post-hook strips it from the missing/unexpected key
lists, so errors show the unwrapped names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardkit.nn.data_parallel.fully_sharded.precision import original_buffer_dtypes
from shardkit.nn.data_parallel.fully_sharded.unit import (
    WRAPPED,
    UnitRuntime,
    named_units,
    summon,
    units_in,
)

__all__ = [
    "full_state_dict",
    "load_local_state_dict",
    "local_state_dict",
    "refuse_direct_state_dict",
]


def full_state_dict(
    root: nn.Module, unit: UnitRuntime, destination: Any, prefix: str, keep_vars: bool
) -> dict[str, Any]:
    """The state dict of the FSDP module ``root`` (whose runtime is ``unit``) with
    full tensors (see the module note)."""
    wrapped = getattr(root, WRAPPED)
    if unit.gathering_state_dict:  # nested: the root gathered already
        return wrapped.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
    units = units_in(root)
    casts = [cast for other in units for cast in other.buffer_casts]
    with summon(units, writeback=False), original_buffer_dtypes(casts):
        for other in units:
            other.gathering_state_dict = True
        try:
            raw = wrapped.state_dict(prefix=prefix, keep_vars=keep_vars)
        finally:
            for other in units:
                other.gathering_state_dict = False
        copies = _copy_tensors(raw, unit.config.state_dict_device)
    out: dict[str, Any] = {} if destination is None else destination
    if unit.config.state_dict_on_rank_0_only and unit.rank != 0:
        return out
    out.update(copies)
    return out


def refuse_direct_state_dict(unit: UnitRuntime, module: nn.Module, *_: Any) -> None:
    """State-dict pre-hook on the modules a unit wraps: their own ``state_dict()`` would
    return 1-D shard pieces under the full parameters' keys (DDP's ``model.module``
    habit), so it is refused unless the unit's full state dict is being built.

    Raises:
        RuntimeError: naming the calls that give the full or the sharded state.
    """
    if not unit.gathering_state_dict:
        raise RuntimeError(
            f"state_dict() of {type(module).__name__}, a module inside {unit.label}, would "
            "return this rank's 1-D shard pieces under the full parameters' names. Call "
            "model.state_dict() on the FullyShardedDataParallel model for the full state "
            "(or model.local_state_dict() for this rank's shards)"
        )


def _copy_tensors(raw: Mapping[str, Any], device: torch.device | None) -> dict[str, Any]:
    """Detached copies that outlive the full flat buffers; tied tensors stay tied.

    ``nn.Module.state_dict`` detaches each entry, so a parameter registered under two
    names (T5's ``shared`` / ``embed_tokens`` / ``lm_head``) comes as two tensor objects
    over the same memory. They get ONE copy, as ``state_dict()`` of the plain model
    shares one storage between them, so ``save_pretrained`` / safetensors see the tie
    and write the tensor once.
    """
    memo: dict[tuple[Any, ...], torch.Tensor] = {}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, torch.Tensor):
            alias = _alias_key(value)
            if alias not in memo:
                memo[alias] = value.detach().to(device=device, copy=True)
            value = memo[alias]
        out[key] = value
    return out


def _alias_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Equal for two tensors exactly when they view the same elements of one storage
    (an empty tensor aliases nothing: it is keyed by its own identity)."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return ("object", id(tensor))
    place = (tensor.untyped_storage().data_ptr(), tensor.device, tensor.storage_offset())
    return (*place, tensor.dtype, tensor.shape, tensor.stride())


def local_state_dict(root: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of this rank's local shards (``"<unit name>.flat_param"``, master dtype) and
    buffers (their original dtypes) of the FSDP module ``root``."""
    units = named_units(root)
    out = {key: unit.handle.local_shard.detach().clone() for key, unit in units.items()}
    with original_buffer_dtypes([cast for unit in units.values() for cast in unit.buffer_casts]):
        out.update({name: buf.detach().clone() for name, buf in root.named_buffers()})
    return out


@torch.no_grad()
def load_local_state_dict(root: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy shards and buffers from :func:`local_state_dict`'s output into ``root``;
    every key and shape is checked first, so an error leaves ``root`` unchanged.

    Raises:
        KeyError: keys differ (both lists named).
        ValueError: a shard's length differs (another world size or wrapping).
    """
    targets: dict[str, torch.Tensor] = {
        key: unit.handle.local_shard for key, unit in named_units(root).items()
    }
    targets.update(dict(root.named_buffers()))
    missing, unexpected = sorted(set(targets) - set(state)), sorted(set(state) - set(targets))
    if missing or unexpected:
        raise KeyError(f"local state dict keys differ: missing {missing}, unexpected {unexpected}")
    for key, target in targets.items():  # every shape before the first copy
        if target.shape != state[key].shape:
            raise ValueError(
                f"{key}: shape {tuple(state[key].shape)} != this rank's {tuple(target.shape)}; "
                "a local state dict loads only at the same world size and wrapping (use "
                "load_fsdp_sharded for another world size)"
            )
    for key, target in targets.items():
        target.copy_(state[key])
