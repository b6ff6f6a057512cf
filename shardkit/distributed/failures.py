"""A collective that cannot complete: an error naming the wrapper, operation and ranks.

When a peer never joins a collective (it skipped a forward, its process died, or it
runs another model and issues other collectives), torch raises after the process
group's timeout, or as soon as the connection closes, with a backend message such as
``[.../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv
operation to complete`` or ``Connection closed by peer``: it names neither the
wrapper nor the step of training that was waiting. :func:`collective_context`
re-raises such an error as :class:`CollectiveError` naming the wrapper, the operation,
this rank and the group size, with the usual causes, the original error chained.

Only failures of the communication itself are translated (torch's
``DistBackendError`` / ``DistNetworkError`` and the backends' timeout and
closed-connection messages); any other error passes unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

__all__ = ["CollectiveError", "collective_context", "is_communication_failure"]

# Backend messages of a peer that did not answer (gloo, NCCL, the TCP store).
_FAILURE = re.compile(
    r"timed out|timeout|connection (closed|reset|refused)|broken pipe|peer|"
    r"socket|aborted|watchdog",
    re.IGNORECASE,
)

HINT = (
    "a peer did not complete this collective. Usual causes: a rank skipped a "
    "forward, backward or optimizer step (rank-dependent control flow, an "
    "early exit, a different number of batches per rank), a rank died (look at its "
    "log for the first error), or the ranks run different models or options"
)


class CollectiveError(RuntimeError):
    """A collective of a shardkit wrapper failed: a peer timed out or disconnected.

    Attributes:
        wrapper: the wrapper (e.g. ``"OSS"``).
        operation: what it was doing (e.g. ``"broadcast of updated parameters"``).
        rank: this rank in the wrapper's process group (-1 if unknown).
        world_size: the group's size (-1 if unknown).
    """

    def __init__(self, wrapper: str, operation: str, rank: int, world_size: int, cause: str):
        self.wrapper, self.operation = wrapper, operation
        self.rank, self.world_size = rank, world_size
        super().__init__(
            f"{wrapper}: {operation} failed on rank {rank} of a group of {world_size}: "
            f"{HINT}. Backend error: {cause}"
        )

    def __reduce__(self) -> tuple[object, ...]:  # picklable, for the test harness
        cause = str(self).split("Backend error: ", 1)[-1]
        return (type(self), (self.wrapper, self.operation, self.rank, self.world_size, cause))


def is_communication_failure(error: BaseException) -> bool:
    """True for torch's distributed backend errors and timeout / closed-connection messages."""
    if isinstance(error, CollectiveError):
        return False
    distributed_error = getattr(dist, "DistError", None)
    if distributed_error is not None and isinstance(error, distributed_error):
        return True
    return isinstance(error, RuntimeError) and bool(_FAILURE.search(str(error)))


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    try:
        return dist.get_rank(group), dist.get_world_size(group)
    except (RuntimeError, ValueError):  # the group is gone (destroyed after the failure)
        return -1, -1


@contextmanager
def collective_context(
    wrapper: str, operation: str, group: dist.ProcessGroup | None = None
) -> Iterator[None]:
    """Translate a communication failure in the body into :class:`CollectiveError`.

    Wrap both where a collective is issued and where its work is waited on (an
    asynchronous collective fails in ``wait()``).

    Example::

        with collective_context("OSS", "broadcast of updated parameters", group):
            work = dist.broadcast(buffer, src, group=group, async_op=True)
            work.wait()

    Args:
        wrapper: the wrapper's name, e.g. ``"FullyShardedDataParallel"``.
        operation: the operation, e.g. ``"all-gather of parameters"``.
        group: the process group of the collective; default None (the world group).

    Raises:
        CollectiveError: the body raised a communication failure (chained).
    """
    try:
        yield
    except RuntimeError as err:
        if not is_communication_failure(err):
            raise
        rank, size = _rank_and_size(group)
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CollectiveError(wrapper, operation, rank, size, first_line) from err
