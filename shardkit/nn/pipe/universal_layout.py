"""Pipelines in the universal checkpoint: each stage writes its own layers.

- :class:`~shardkit.nn.pipe.PipelineStage` (one stage per rank): the stage module from
  :func:`~shardkit.nn.pipe.stage_module` keeps the plain ``nn.Sequential``'s layer
  names, so its state-dict keys are the original model's. A stage wrapped in a
  data-parallel wrapper (torch DDP, FSDP, ...) takes that wrapper's adapter (its
  replicas de-duplicated by it); a plain stage module is the only holder of its layers,
  so this rank writes all of them whole.
- :class:`~shardkit.nn.pipe.Pipe` (one process, one partition per device): keys
  ``partitions.<j>.<layer>...`` are the original ``<layer>...``; every tensor is
  written whole (by rank 0 of the world when ``torch.distributed`` is initialised).

After loading, nothing moves: each stage read its own layers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from shardkit.checkpoint.universal.adapters import PlainLayout, layout_of, tied_aliases
from shardkit.checkpoint.universal.layout import (
    LayoutAdapter,
    ParamEntry,
    aliases_of,
    register_layout,
    strategy_name,
)
from shardkit.checkpoint.universal.optim_state import optimizer_params
from shardkit.checkpoint.universal.whole import whole_entries
from shardkit.distributed.shard_descriptor import ranks_of, view_of
from shardkit.nn.pipe.pipe import Pipe
from shardkit.nn.pipe.stage import PipelineStage

__all__ = ["PipeLayout", "StageLayout"]

_PARTITION = re.compile(r"partitions\.\d+\.")


def _original_key(key: str) -> str:
    """A ``Pipe`` key without its ``partitions.<j>.``."""
    return _PARTITION.sub("", key, 1)


def _always(tensor: torch.Tensor, is_param: bool) -> bool:
    return True


class StageLayout:
    """The adapter of one :class:`PipelineStage` (see the module docstring).

    Args:
        stage: this rank's stage.
        optimizer: the optimizer over the stage module's parameters, or None.
    """

    def __init__(self, stage: PipelineStage, optimizer: Any = None) -> None:
        self.module = stage.module
        self.optimizer = optimizer
        inner = layout_of(stage.module, optimizer)
        # a plain stage module: its layers are on this rank only, not replicas to split
        self.inner: LayoutAdapter | None = None if type(inner) is PlainLayout else inner
        base = "pipe" if self.inner is None else f"pipe+{self.inner.strategy}"
        self.strategy = strategy_name(base, (view_of(p) for p in stage.module.parameters()))

    def entries(self) -> Iterable[ParamEntry]:
        """The stage's tensors (whole, or as its data-parallel wrapper lists them)."""
        if self.inner is not None:
            return self.inner.entries()
        held = optimizer_params(self.optimizer) if self.optimizer is not None else {}
        return whole_entries(self.module, held, _always)

    def aliases(self) -> dict[str, str]:
        """Tied keys within the stage, ``{other key: first key}``, for the manifest."""
        return aliases_of(self.inner) if self.inner is not None else tied_aliases(self.module)

    def after_load(self) -> None:
        """The inner wrapper's ``after_load``, if any."""
        if self.inner is not None:
            self.inner.after_load()


class PipeLayout:
    """The adapter of a single-process :class:`Pipe` (see the module docstring)."""

    def __init__(self, pipe: Pipe, optimizer: Any = None) -> None:
        self.pipe = pipe
        self.held = optimizer_params(optimizer) if optimizer is not None else {}
        self.writer = not dist.is_initialized() or dist.get_rank() == 0
        self.strategy = strategy_name("pipe", (view_of(p) for p in pipe.parameters()))

    def entries(self) -> Iterable[ParamEntry]:
        """Every tensor whole, under the original ``nn.Sequential``'s key."""
        writer = self.writer
        return whole_entries(
            self.pipe, self.held, lambda t, p: writer, _original_key, holders=ranks_of(None)
        )

    def aliases(self) -> dict[str, str]:
        """Tied keys, ``{other key: first key}``, under the original keys."""
        key = _original_key
        return {key(k): key(v) for k, v in tied_aliases(self.pipe).items()}

    def after_load(self) -> None:
        """Nothing: the partitions were filled in place."""


register_layout(PipelineStage, StageLayout)
register_layout(Pipe, PipeLayout)
