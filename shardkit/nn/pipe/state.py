"""State of a pipeline spread over ranks: per-stage state dicts and a consolidated one.

Stage modules made by :func:`stage_module` keep the plain model's layer names, so the
whole model's state dict is the union of the stages' state dicts, and a stage loads
its part by picking its own keys from the whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

__all__ = ["consolidated_state_dict", "load_stage_state_dict", "unwrap"]


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside a data-parallel wrapper (or ``module`` itself): torch
    ``DistributedDataParallel``, or a wrapper with ``no_sync()``, ``reduce()`` and
    ``.module`` (shardkit's ``ShardedDataParallel``)."""
    inner = getattr(module, "module", None)
    accumulating = all(callable(getattr(module, n, None)) for n in ("no_sync", "reduce"))
    if isinstance(inner, nn.Module) and (
        isinstance(module, DistributedDataParallel) or accumulating
    ):
        return inner
    return module


def consolidated_state_dict(
    module: nn.Module,
    *,
    process_group: ProcessGroup | None = None,
    dst: int = 0,
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict, gathered from every stage onto stage ``dst``.

    Collective over the pipeline's ``process_group`` (default: world): every stage
    calls it with its stage module (possibly DDP-wrapped). Tensors are copied to CPU.

    Args:
        transform: ``transform(key, tensor)`` applied to each of this stage's tensors,
            in key order, before the gather: e.g. a tensor-parallel part all-gathered
            to the full tensor (a collective over the tensor-parallel group, whose
            ranks hold the same stage and so call it for the same keys). Default None.

    Returns:
        On rank ``dst`` of the group: the merged state dict, keys as in the plain
        model. Elsewhere: None.

    Raises:
        ValueError: two stages hold the same key (the layers overlap), naming the keys.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None
    state = unwrap(module).state_dict()
    if transform is not None:
        state = {k: transform(k, v) for k, v in sorted(state.items())}
    local = {k: v.detach().cpu().clone() for k, v in state.items()}
    is_dst = dist.get_rank(group) == dst
    parts: list[dict[str, torch.Tensor] | None] = (
        [None] * dist.get_world_size(group) if is_dst else []
    )
    dist.gather_object(
        local, parts if is_dst else None, dst=dist.get_global_rank(group, dst), group=group
    )
    if not is_dst:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        assert part is not None
        overlap = sorted(set(merged) & set(part))
        if overlap:
            raise ValueError(f"stages overlap: keys {overlap[:5]} are held by two stages")
        merged.update(part)
    return merged


def load_stage_state_dict(module: nn.Module, full_state: Mapping[str, torch.Tensor]) -> None:
    """Load this stage's part of a whole-model state dict into ``module``.

    Raises:
        KeyError: keys of the stage missing from ``full_state``, named.
    """
    target = unwrap(module)
    keys = target.state_dict().keys()
    missing = [k for k in keys if k not in full_state]
    if missing:
        raise KeyError(f"the state dict lacks this stage's keys {missing[:5]}")
    target.load_state_dict({k: full_state[k] for k in keys})
