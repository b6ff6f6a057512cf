"""Cross-rank consistency checks: one cheap collective at wrap time instead of a hang.

If one rank builds a different model (another width, a parameter in another order,
another dtype) or passes other sharding options, the first collective that depends
on those shapes either hangs until the process-group timeout or, worse, succeeds
with mismatched buffers and trains silently wrong. :func:`verify_consistent`
compares a digest of every rank's description with one ``all_gather_object`` of a
32-byte hash; only on a mismatch are the full descriptions gathered, to name the
first differing entry and the ranks that disagree. The error is raised on every rank,
so no rank is left waiting in a later collective.

[Note: a local error travels in the same exchange]
A wrapper also checks its own rank's inputs (:mod:`shardkit.distributed.validation`:
an integer or meta parameter, a failed deferred initialisation). Raised before the
exchange on one rank only, such an error would leave the other ranks waiting in the
exchange or in the first collective after it until the process-group timeout. So the
wrapper hands it to :func:`verify_consistent` as ``local_error``: each rank's gathered
item is its digest plus its error text (or None), the failing rank raises its own
error after the exchange, and every other rank raises :class:`PeerRejectedError`
naming that rank and its message. No extra collective.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardkit.distributed.collectives import group_size

__all__ = [
    "ConsistencyError",
    "PeerRejectedError",
    "describe_parameters",
    "local_checks",
    "verify_consistent",
]


class ConsistencyError(ValueError):
    """Ranks disagree on something that must be identical across them."""


class PeerRejectedError(ConsistencyError):
    """Another rank of the group refused its inputs at wrap time; this rank stops too.

    Attributes:
        rank: the first rank (of the group) that refused, e.g. 1.
        error: that rank's error as text, ``"TypeError: OSS: parameter ..."``.
    """

    def __init__(self, what: str, rank: int, error: str, others: Sequence[int]) -> None:
        self.rank = rank
        self.error = error
        also = f" (ranks {list(others)} refused theirs too)" if others else ""
        super().__init__(
            f"{what}: rank {rank} rejected its parameters: {error}{also}. Every rank stops "
            f"here so that none waits in a later collective; fix the inputs of rank {rank}."
        )


def describe_parameters(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """One line per parameter: ``name shape=(..) dtype=.. requires_grad=..``, in order."""
    return [
        f"{name} shape={tuple(t.shape)} dtype={t.dtype} requires_grad={t.requires_grad}"
        for name, t in named
    ]


def _first_difference(per_rank: Sequence[Sequence[str]]) -> tuple[int, dict[int, str]]:
    longest = max(len(d) for d in per_rank)
    for i in range(longest):
        entries = {r: (d[i] if i < len(d) else "<missing>") for r, d in enumerate(per_rank)}
        if len(set(entries.values())) > 1:
            return i, entries
    return longest, {}


def _raise_rejection(
    gathered: Sequence[tuple[str, str | None]], what: str, local_error: Exception | None
) -> None:
    """After the exchange: this rank's own error first, else the first peer's."""
    if local_error is not None:
        raise local_error
    refused = [(rank, error) for rank, (_, error) in enumerate(gathered) if error is not None]
    if refused:
        rank, error = refused[0]
        raise PeerRejectedError(what, rank, error, [r for r, _ in refused[1:]])


def verify_consistent(
    description: Sequence[str],
    *,
    what: str,
    group: dist.ProcessGroup | None = None,
    options: Mapping[str, Any] | None = None,
    local_error: Exception | None = None,
) -> None:
    """Raise on every rank of ``group`` unless all ranks pass the same ``description``.

    A collective: every rank of ``group`` must call it, also a rank whose own checks
    failed (pass the error as ``local_error``). Costs one ``all_gather_object`` of a
    32-byte digest (and a None) when the ranks agree.

    Args:
        description: lines that must match across ranks, e.g. from
            :func:`describe_parameters` (names, shapes, dtypes, order).
        what: the caller, for the message (e.g. ``"FullyShardedDataParallel"``).
        group: the process group; default None (the world group).
        options: settings that must match too (e.g. ``{"reshard_after_forward": True}``);
            compared by their ``repr``.
        local_error: an error this rank found in its own inputs before the exchange
            (e.g. from :func:`shardkit.distributed.validation.parameter_problem`);
            default None. It is raised here, on this rank, after the exchange, and the
            other ranks raise :class:`PeerRejectedError`. Without a process group it
            is raised at once.

    Raises:
        Exception: ``local_error``, when given.
        PeerRejectedError: another rank passed a ``local_error`` (naming the first
            such rank and its error text).
        ConsistencyError: naming the first differing entry, what each rank has, and
            the fix.
    """
    if not dist.is_available() or not dist.is_initialized() or group_size(group) == 1:
        if local_error is not None:  # no other rank to tell or to compare with
            raise local_error
        return
    lines = [f"option {k}={v!r}" for k, v in sorted((options or {}).items())] + list(description)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    error = None if local_error is None else f"{type(local_error).__name__}: {local_error}"
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (digest, error), group=group)
    _raise_rejection(gathered, what, local_error)
    if len({d for d, _ in gathered}) == 1:
        return
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, lines, group=group)
    index, entries = _first_difference(everyone)
    by_value: dict[str, list[int]] = {}
    for rank, entry in entries.items():
        by_value.setdefault(entry, []).append(rank)
    detail = "; ".join(f"ranks {ranks} have {entry!r}" for entry, ranks in by_value.items())
    raise ConsistencyError(
        f"{what}: ranks disagree at entry {index} of {max(len(e) for e in everyone)}: {detail}. "
        "Every rank must build the same model (same parameters, shapes, dtypes, order) "
        "and pass the same options before wrapping."
    )


@contextlib.contextmanager
def local_checks(
    what: str,
    group: dist.ProcessGroup | None,
    catch: tuple[type[Exception], ...] = (TypeError, ValueError),
) -> Iterator[None]:
    """Run this rank's own checks (no collective inside) so that an error raised in
    the block stops every rank of ``group`` at once (see [Note: a local error travels in
    the same exchange]).

    On success nothing is exchanged: the wrapper's own :func:`verify_consistent` call
    comes next. On an error of a type in ``catch``, this rank takes part in that
    exchange now, in its place, with the error as ``local_error``: it re-raises the
    error here and every other rank raises :class:`PeerRejectedError` from its own
    :func:`verify_consistent`.

    Args:
        what: the wrapper named in the other ranks' errors.
        group: the process group of the wrapper's exchange (None: the world group).
        catch: the error types that travel; default ``(TypeError, ValueError)``.

    Raises:
        Exception: the error raised in the block.
    """
    try:
        yield
    except catch as error:
        verify_consistent([], what=what, group=group, local_error=error)
        raise  # not reached: verify_consistent raises `error` on this rank
