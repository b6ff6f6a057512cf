"""Which compressor a reduction goes through: by process group (:class:`OnlyOnGroups`)
and by name (:func:`get_compressor`)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from shardkit.distributed.collectives import group_ranks
from shardkit.distributed.compression.half import BF16Compressor, FP16Compressor
from shardkit.distributed.compression.int8 import Int8Compressor
from shardkit.distributed.compression.interface import GradCompressor, IdentityCompressor, Shapes
from shardkit.distributed.compression.powersgd import PowerSGDCompressor

__all__ = ["OnlyOnGroups", "get_compressor"]


class OnlyOnGroups(GradCompressor):
    """Compress only the reductions over some process groups; exact elsewhere.

    For hybrid sharding: the cross-replica (cross-node) all-reduce goes through
    ``compressor``, the reduce-scatter inside a node through ``otherwise`` (exact).
    A group matches when it holds the same global ranks as one of ``groups`` (so a
    rank's own replica group matches whichever replica group it is in).

    Args:
        compressor: used for reductions over ``groups``.
        groups: the process groups to compress on (None stands for the world group).
        otherwise: used elsewhere; default :class:`IdentityCompressor` (exact).
    """

    def __init__(
        self,
        compressor: GradCompressor,
        groups: Iterable[dist.ProcessGroup | None],
        otherwise: GradCompressor | None = None,
    ) -> None:
        super().__init__(error_feedback=compressor.error_feedback)
        self.compressor = compressor
        self.otherwise = otherwise if otherwise is not None else IdentityCompressor()
        self._ranks = {
            tuple(group_ranks(g))
            for g in groups
            if g is None or isinstance(g, dist.ProcessGroup)  # not NON_GROUP_MEMBER (an int)
        }
        self.name = f"{compressor.name}-on-groups"
        self.exact = compressor.exact and self.otherwise.exact

    def __repr__(self) -> str:
        return f"OnlyOnGroups({self.compressor!r}, ranks={sorted(self._ranks)}, otherwise={self.otherwise!r})"

    def pick(self, group: dist.ProcessGroup | None) -> GradCompressor:
        """The compressor used for reductions over ``group``."""
        return self.compressor if tuple(group_ranks(group)) in self._ranks else self.otherwise

    def reset(self, key: Hashable = None) -> None:
        self.compressor.reset(key)
        self.otherwise.reset(key)

    def state_bytes(self) -> int:
        return self.compressor.state_bytes() + self.otherwise.state_bytes()

    def _all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None, key: Hashable, shapes: Shapes
    ) -> None:
        self.pick(group)._all_reduce(tensor, group, key, shapes)

    def _reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        group: dist.ProcessGroup | None,
        key: Hashable,
        shapes: Shapes,
    ) -> None:
        self.pick(group)._reduce(tensor, dst, group, key, shapes)

    def _reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup | None,
        key: Hashable,
        shapes: Shapes,
    ) -> None:
        self.pick(group)._reduce_scatter(output, input, group, key, shapes)


_BY_NAME = {
    "identity": IdentityCompressor,
    "fp16": FP16Compressor,
    "bf16": BF16Compressor,
    "powersgd": PowerSGDCompressor,
    "int8": Int8Compressor,
}


def get_compressor(spec: str | GradCompressor | None, **kwargs: Any) -> GradCompressor | None:
    """A compressor from a name (``"identity"``, ``"fp16"``, ``"bf16"``, ``"powersgd"``,
    ``"int8"``; ``kwargs`` go to its constructor), an instance (returned as it is) or
    None (None: no compression, the caller's own exact path).

    Raises:
        ValueError: an unknown name.
    """
    if spec is None or isinstance(spec, GradCompressor):
        return spec
    if spec not in _BY_NAME:
        raise ValueError(f"unknown gradient compression {spec!r}; choose from {sorted(_BY_NAME)}")
    compressor: GradCompressor = _BY_NAME[spec](**kwargs)
    return compressor


# torch DDP ----------------------------------------------------------------------------
