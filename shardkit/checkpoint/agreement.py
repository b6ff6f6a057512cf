"""A rank's failure during a collective save, carried to every rank by the next exchange.

[Note: one failure, every rank]
A collective save has agreement points: exchanges that every rank takes part in (the
all-gather of what each rank will write, the broadcast of rank 0's staging directory,
the all-gather of the written files' records, the broadcast of rank 0's commit). An
exception raised on one rank between two of them (disk full, permission denied, an
adapter's ``state_dict`` failing) must not leave the other ranks waiting in the next
exchange until the process group's timeout, then reporting a timeout instead of the
cause. So the rank catches it (any ``Exception``) and sends a :class:`RankFailure` in
place of its item of that exchange; after the exchange every rank sees the same
failures and raises, naming the failing ranks with the exception type and message,
the failing rank with its own exception chained. The happy path exchanges nothing
more: the failure travels in the exchange the save makes anyway.

A :class:`RankFailure` holds text only (the exception's class names and message), so
it pickles whatever the exception was (an exception whose ``__init__`` takes other
arguments than its message does not unpickle).
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from shardkit.distributed.collectives import global_rank

__all__ = ["RankFailure", "broadcast_outcome", "describe_failures", "gather_failures"]


@dataclass(frozen=True)
class RankFailure:
    """One rank's exception, as text.

    Attributes:
        rank: the failing rank in the save's process group, e.g. 1.
        kind: the exception's class name, e.g. ``"OSError"``.
        builtins: the built-in classes of its MRO, most derived first, e.g.
            ``("ValueError", "Exception", "BaseException")`` for a subclass of
            ``ValueError``.
        message: ``str`` of the exception.
    """

    rank: int
    kind: str
    builtins: tuple[str, ...]
    message: str

    @classmethod
    def of(cls, rank: int, error: BaseException) -> RankFailure:
        """The failure of ``rank`` raising ``error``."""
        mro = [c for c in type(error).__mro__ if issubclass(c, BaseException)]
        names = tuple(c.__name__ for c in mro if c.__module__ == builtins.__name__)
        return cls(rank, type(error).__name__, names, str(error))

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.kind}: {self.message}"


def describe_failures(gathered: Sequence[object]) -> str:
    """``"rank 1: OSError: disk full; rank 3: ..."`` for the :class:`RankFailure` items
    of ``gathered`` (one item per rank, rank order); ``""`` when there is none."""
    return "; ".join(str(item) for item in gathered if isinstance(item, RankFailure))


def gather_failures(
    rank: int, error: BaseException | None, groups: Sequence[dist.ProcessGroup | None]
) -> str:
    """Every rank's failure, known to every rank of ``groups``: ``error`` (None: this
    rank is fine) is all-gathered over the first group, the description of the result
    over the next one and so on (a shard group, then its replicas), so that every rank
    of the union returns the same text.

    Args:
        rank: the number that names this rank in the text (e.g. its global rank).
        error: this rank's exception, or None.
        groups: process groups (None: the world); a group of one rank is skipped.

    Returns:
        ``describe_failures`` of every failing rank (``"rank 1: OSError: ..."``), ``""``
        when no rank failed. One ``all_gather_object`` per group of more than one rank.
    """
    text = str(RankFailure.of(rank, error)) if error is not None else ""
    for group in groups:
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        if size == 1:
            continue
        every: list[object] = [None] * size
        dist.all_gather_object(every, text, group=group)
        text = "; ".join(dict.fromkeys(str(t) for t in every if t))  # each failure once
    return text


def broadcast_outcome(outcome: list[str], group: dist.ProcessGroup | None) -> None:
    """Overwrite ``outcome`` (a one-item list: ``""`` for success, else the reason) on
    every rank of ``group`` (None: the world) with its first rank's, in place; a no-op
    without a process group or on one rank."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.broadcast_object_list(outcome, src=global_rank(group, 0), group=group)
