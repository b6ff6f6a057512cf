"""The full state read from an old-format checkpoint, and its universal checkpoint.

Each old-format reader (:mod:`.fsdp`, :mod:`.oss`, :mod:`.tensor_parallel`) returns a
:class:`LegacyState`: whole tensors under the plain model's keys, the optimizer state
of each parameter and the param groups. :func:`write_universal` saves it with
:func:`~shardkit.checkpoint.universal.save_universal` in one process (world size 1),
through a module that holds the tensors and a stand-in for the optimizer that held
the state: the one writer of the format writes the converted checkpoint too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardkit.checkpoint.manifest import load_tensors_only
from shardkit.checkpoint.universal import save_universal

__all__ = ["LegacyState", "open_records", "rank_files", "write_universal"]


@dataclass
class LegacyState:
    """What an old-format checkpoint holds, whole.

    Attributes:
        format: the old format's tag.
        world_size: ranks that saved it.
        params: first key -> full tensor; aliases: other key of a tied tensor -> first.
        buffers: key -> full tensor.
        optim_state: first key -> that parameter's optimizer state (tensors shaped
            like the parameter, and scalars), as ``torch.optim`` keeps it.
        param_groups: ``[{"hyper": {...}, "keys": [first keys]}]``; empty: no optimizer.
        notes: what the format did not record.
    """

    format: str
    world_size: int
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    optim_state: dict[str, dict[str, Any]] = field(default_factory=dict)
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add_param(self, keys: Sequence[str], value: torch.Tensor) -> None:
        """A parameter under its keys (the first holds it, the others are aliases)."""
        self.params[keys[0]] = value
        self.aliases.update({k: keys[0] for k in keys[1:]})

    def set_single_group(self, groups: Sequence[dict[str, Any]], fmt: str) -> None:
        """Every parameter in the one saved param group ``groups[0]``.

        Raises:
            ValueError: several groups (the format does not say which parameter each held).
        """
        if len(groups) != 1:
            raise ValueError(
                f"format {fmt} does not record which parameters each of its {len(groups)} "
                "param groups held; convert supports one param group for it (load the "
                "checkpoint with the release that wrote it, then save_universal)"
            )
        hyper = {k: v for k, v in groups[0].items() if k != "params"}
        self.param_groups = [{"hyper": hyper, "keys": list(self.params)}]


def rank_files(ckpt: Path, pattern: re.Pattern[str]) -> list[Path]:
    """The shard files ``<name>-<r>-of-<N>`` of one save in ``ckpt``, in rank order.

    Raises:
        ValueError: files of several world sizes, or a rank's file missing.
    """
    found: dict[tuple[int, int], Path] = {}
    for entry in ckpt.iterdir():
        match = pattern.fullmatch(entry.name)
        if match:
            found[(int(match.group(1)), int(match.group(2)))] = entry
    sizes = sorted({n for _, n in found})
    if len(sizes) != 1:
        raise ValueError(f"{ckpt}: expected the shard files of one save, found world sizes {sizes}")
    (n,) = sizes
    missing = [r for r in range(n) if (r, n) not in found]
    if missing:
        raise ValueError(f"{ckpt}: shard files of ranks {missing} (of {n}) missing")
    return [found[(r, n)] for r in range(n)]


def open_records(files: Sequence[Path]) -> list[dict[str, Any]]:
    """Each file loaded memory-mapped, tensors and plain containers only.

    Raises:
        CheckpointUnsafeError: a file holds another object.
        ValueError: a file holds something other than a dict.
    """
    records = [load_tensors_only(p, map_location="cpu", mmap=True) for p in files]
    for path, record in zip(files, records):
        if not isinstance(record, dict):
            raise ValueError(f"{path} holds a {type(record).__name__}, expected a dict")
    return records


def _holder(state: LegacyState) -> tuple[nn.Module, dict[str, nn.Parameter]]:
    """A module whose state dict is ``state``'s tensors under their keys (a tied
    parameter registered under each of its keys), and its parameters by first key."""
    root = nn.Module()

    def parent(key: str) -> tuple[nn.Module, str]:
        *path, name = key.split(".")
        module = root
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        return module, name

    params = {}
    for key, value in state.params.items():
        params[key] = nn.Parameter(value, requires_grad=value.is_floating_point())
        module, name = parent(key)
        module.register_parameter(name, params[key])
    for alias, key in state.aliases.items():
        module, name = parent(alias)
        module.register_parameter(name, params[key])
    for key, value in state.buffers.items():
        module, name = parent(key)
        module.register_buffer(name, value)
    return root, params


_CANDIDATES = ("AdamW", "Adam", "SGD", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam")


def infer_optimizer_class(hyper: dict[str, Any]) -> str | None:
    """The ``torch.optim`` class whose defaults have exactly the keys of ``hyper``,
    the one agreeing on most values when several do (AdamW over Adam for a decoupled
    weight decay); None when none has those keys."""
    probe = [torch.zeros(1, requires_grad=True)]
    best: tuple[int, str] | None = None
    for name in _CANDIDATES:
        defaults = getattr(torch.optim, name)(probe).defaults
        if set(defaults) != set(hyper):
            continue
        agree = sum(1 for k, v in defaults.items() if v == hyper[k])
        if best is None or agree > best[0]:
            best = (agree, name)
    return None if best is None else best[1]


@dataclass
class _SavedOptimizer:
    """What ``save_universal`` reads of an optimizer: its groups, its state, and the
    class that stepped it."""

    param_groups: list[dict[str, Any]]
    state: dict[torch.Tensor, dict[str, Any]]
    optimizer_class: type


def write_universal(
    state: LegacyState, out: Path, step: int, optimizer_class: str | None = None
) -> Path:
    """Save ``state`` as a universal checkpoint ``out/ckpt-<step>`` (one process).

    Args:
        optimizer_class: the name of the optimizer class that stepped it (recorded in
            the manifest: loading into another class is refused); default None: the
            ``torch.optim`` class its hyperparameters match.

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: optimizer state whose class is not given and cannot be inferred.
    """
    module, params = _holder(state)
    optimizer = None
    if state.param_groups:
        name = optimizer_class or infer_optimizer_class(state.param_groups[0]["hyper"])
        if name is None:
            raise ValueError(
                f"the optimizer's hyperparameters {sorted(state.param_groups[0]['hyper'])} "
                "match no torch.optim class: name it with --optimizer CLASS"
            )
        groups = [
            {**group["hyper"], "params": [params[k] for k in group["keys"]]}
            for group in state.param_groups
        ]
        by_param: dict[torch.Tensor, dict[str, Any]] = {
            params[k]: s for k, s in state.optim_state.items()
        }
        stepped = type(name, (torch.optim.Optimizer,), {})
        optimizer = _SavedOptimizer(groups, by_param, stepped)
    return save_universal(out, step, module, optimizer)
