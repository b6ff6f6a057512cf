"""Schedules: the order in which (micro-batch, stage) tasks run.

Pure functions, no tensors: :func:`clock_cycles` for the single-process pipeline
(every partition advances one micro-batch per clock), :func:`gpipe_actions` and
:func:`one_f_one_b_actions` for one stage per rank (each rank runs its list in
order; a forward waits to receive its input, a backward its output gradient). The
schedules are drawn in the docstrings of the functions that run them:
``Pipeline.run`` (single process), ``ScheduleGPipe.step`` and ``Schedule1F1B.step``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import NamedTuple

__all__ = [
    "Action",
    "Phase",
    "bubble_fraction",
    "clock_cycles",
    "gpipe_actions",
    "one_f_one_b_actions",
]


class Phase(str, enum.Enum):
    """What a stage does with a micro-batch."""

    FORWARD = "F"  #: receive (or take) the input, run the stage, send the output
    BACKWARD = (
        "B"  #: receive (or compute) the output gradient, backpropagate, send the input gradient
    )


class Action(NamedTuple):
    """One task of a stage: ``phase`` on micro-batch ``microbatch``."""

    phase: Phase
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.phase.value}{self.microbatch}"


def _check(stages: int, chunks: int, stage: int | None = None) -> None:
    if stages < 1 or chunks < 1:
        raise ValueError(f"stages and chunks must be >= 1; got stages={stages}, chunks={chunks}")
    if stage is not None and not 0 <= stage < stages:
        raise ValueError(f"stage {stage} out of range for {stages} stages")


def clock_cycles(chunks: int, partitions: int) -> Iterator[list[tuple[int, int]]]:
    """Per clock tick, the ``(micro-batch, partition)`` pairs that can run together.

    Micro-batch ``i`` reaches partition ``j`` at tick ``i + j``; there are
    ``chunks + partitions - 1`` ticks (GPipe fill-drain, forward half). Within a tick
    the pairs go by increasing partition (torchgpipe's and FairScale's order, so layers
    are called in the same order as there): ``clock_cycles(3, 2)`` is
    ``[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]``.
    """
    _check(partitions, chunks)
    for k in range(chunks + partitions - 1):
        first, last = max(0, k - chunks + 1), min(k, partitions - 1)
        yield [(k - j, j) for j in range(first, last + 1)]


def gpipe_actions(stage: int, stages: int, chunks: int) -> list[Action]:
    """GPipe fill-drain for ``stage``: every forward, then every backward (in order).

    A stage holds the activations of all ``chunks`` micro-batches at the turn.
    """
    _check(stages, chunks, stage)
    forwards = [Action(Phase.FORWARD, i) for i in range(chunks)]
    return forwards + [Action(Phase.BACKWARD, i) for i in range(chunks)]


def one_f_one_b_actions(stage: int, stages: int, chunks: int) -> list[Action]:
    """1F1B (PipeDream-Flush) for ``stage``: warm-up forwards, then alternate, then drain.

    Stage ``s`` of ``p`` runs ``min(p - s - 1, m)`` warm-up forwards, then pairs of one
    forward and one backward (oldest micro-batch first) until the forwards run out,
    then the remaining backwards. At most ``p - s`` micro-batches of activations are
    alive on stage ``s`` (Narayanan et al. 2021, section 2.2).
    """
    _check(stages, chunks, stage)
    warmup = min(stages - stage - 1, chunks)
    actions = [Action(Phase.FORWARD, i) for i in range(warmup)]
    for i in range(chunks - warmup):
        actions += [Action(Phase.FORWARD, warmup + i), Action(Phase.BACKWARD, i)]
    actions += [Action(Phase.BACKWARD, i) for i in range(chunks - warmup, chunks)]
    return actions


def bubble_fraction(stages: int, chunks: int) -> float:
    """Idle share of a fill-drain pipeline with equal stages: ``(p - 1) / (m + p - 1)``."""
    _check(stages, chunks)
    return (stages - 1) / (chunks + stages - 1)
