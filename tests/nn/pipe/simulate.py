"""An independent simulator of per-stage action lists, used to check schedules.

Time is discrete: a forward takes ``f`` units, a backward ``b``. A stage starts its next
action as soon as it is idle and the action's dependency is met: forward ``i`` on
stage ``s`` needs forward ``i`` on ``s - 1`` finished (sends never block); backward
``i`` on ``s`` needs forward ``i`` on ``s`` done and backward ``i`` on ``s + 1`` finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardkit.nn.pipe.schedule import Action, Phase


class Deadlock(AssertionError):
    pass


@dataclass
class Trace:
    finish: dict[tuple[Phase, int, int], int]  # (phase, microbatch, stage) -> finish time
    start: dict[tuple[Phase, int, int], int]
    peak_in_flight: list[int]
    makespan: int
    grid: list[list[str]]  # per stage, one cell per time unit


def simulate(per_stage: Sequence[Sequence[Action]], f: int = 1, b: int = 2) -> Trace:
    p = len(per_stage)
    pos = [0] * p
    busy_until = [0] * p
    finish: dict[tuple[Phase, int, int], int] = {}
    start: dict[tuple[Phase, int, int], int] = {}
    in_flight, peak = [0] * p, [0] * p
    grid: list[list[str]] = [[] for _ in range(p)]
    t = 0
    total = sum(len(a) for a in per_stage)
    while len(finish) < total:
        progressed = False
        for s in range(p):
            if busy_until[s] > t or pos[s] >= len(per_stage[s]):
                continue
            phase, i = per_stage[s][pos[s]]
            key = (phase, i, s)
            if key in start:
                raise AssertionError(f"{key} scheduled twice")
            if phase is Phase.FORWARD:
                dep = (Phase.FORWARD, i, s - 1) if s > 0 else None
            else:
                if (Phase.FORWARD, i, s) not in finish:
                    raise AssertionError(f"backward {i} before its forward on stage {s}")
                dep = (Phase.BACKWARD, i, s + 1) if s < p - 1 else None
            if dep is not None and finish.get(dep, 10**9) > t:
                continue
            cost = f if phase is Phase.FORWARD else b
            start[key], finish[key] = t, t + cost
            busy_until[s] = t + cost
            pos[s] += 1
            progressed = True
            if phase is Phase.FORWARD:
                in_flight[s] += 1
                peak[s] = max(peak[s], in_flight[s])
            grid[s].extend([f"{phase.value}{i}"] * cost)
        for s in range(p):
            if len(grid[s]) <= t:
                grid[s].append("..")
        for s in range(p):  # backwards release their activations when they end
            for (ph, _i, st), end in finish.items():
                if st == s and ph is Phase.BACKWARD and end == t + 1:
                    in_flight[s] -= 1
        if not progressed and all(u <= t for u in busy_until):
            waiting = {s: per_stage[s][pos[s]] for s in range(p) if pos[s] < len(per_stage[s])}
            raise Deadlock(f"deadlock at t={t}: stages wait on {waiting}")
        t += 1
    makespan = max(finish.values())
    for row in grid:
        del row[makespan:]
    return Trace(finish, start, peak, makespan, grid)
