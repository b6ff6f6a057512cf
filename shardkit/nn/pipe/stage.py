"""One pipeline stage per rank: forward and backward of micro-batches with send/recv.

A :class:`PipelineStage` owns the layers of one stage and the tensors in flight:
for each micro-batch between its forward and its backward, the received input
(whose ``.grad`` becomes the gradient sent back) and the output (or, on the last
stage, the loss). Schedules (``ScheduleGPipe``, ``Schedule1F1B``) decide the order.

[Note: data parallelism inside a stage]
A stage module may be wrapped in torch ``DistributedDataParallel`` over a second
process group (its replicas). DDP reduces gradients when a backward follows a
forward that ran outside ``no_sync``, which a pipeline (many forwards, then
interleaved backwards) cannot arrange; so every forward runs under ``no_sync`` and
the last backward of a step first calls the reducer's ``prepare_for_backward``, as
``torch.distributed.pipelining`` does. The gradient of all micro-batches is then
all-reduced once, during the last backward.

A wrapper with FairScale's gradient-accumulation pair, ``no_sync()`` and ``reduce()``
(shardkit's ``ShardedDataParallel``), runs every forward and backward of the step under
``no_sync`` and reduces once, with ``reduce()``, after the last backward.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function

from shardkit.distributed.failures import CollectiveError, is_communication_failure
from shardkit.nn.pipe.checkpoint import CheckpointMode, run_checkpointed
from shardkit.nn.pipe.failure import (
    StageFailedError,
    abort_header,
    abort_tensors,
    header_abort_reason,
    read_abort,
)
from shardkit.nn.pipe.microbatch import Batch, check_value
from shardkit.nn.pipe.p2p import P2P, PendingRecv, TensorMeta

__all__ = ["PipelineStage", "StageState"]

LossFn = Callable[..., torch.Tensor]


class StageState(enum.Enum):
    """Where a stage is in a schedule step."""

    IDLE = "idle"  #: between steps: nothing in flight, all sends finished
    RUNNING = "running"  #: inside a step: micro-batches may be in flight
    FAILED = "failed"  #: a step raised; the neighbours were told (see :mod:`.failure`)


@dataclass
class _InFlight:
    """A micro-batch between its forward and its backward on this stage."""

    inputs: list[torch.Tensor]  # received tensors that require grad
    outputs: list[torch.Tensor] = field(default_factory=list)  # outputs that require grad
    loss: torch.Tensor | None = None  # last stage: the weighted micro-batch loss
    grads: PendingRecv | None = None  # the output gradients, posted when the output left


class PipelineStage:
    """The part of a pipeline that runs on this rank, and its communication.

    Example (2 ranks, each holding half of ``model``)::

        group = dist.new_group([0, 1])
        part = stage_module(model, balance=[2, 2], index=dist.get_rank(group))
        stage = PipelineStage(part, process_group=group)
        loss = Schedule1F1B(stage, chunks=4, loss_fn=F.cross_entropy).step(x, target=y)

    Args:
        module: this stage's layers (an ``nn.Module`` taking and returning a tensor or a
            tuple of tensors), optionally wrapped in ``DistributedDataParallel``.
        process_group: the pipeline's group; stage ``i`` is rank ``i`` in it. Default:
            the world group.
        device: where activations are received; default the device of the module's
            first parameter (``cpu`` without parameters).
        checkpoint: ``"never"`` (default) or ``"always"``: re-materialize each
            micro-batch's activations during its backward.

    Attributes:
        index: this stage's rank in ``process_group``; ``num_stages`` its size.
        peak_in_flight: the most micro-batches alive at once during the last step
            (GPipe: ``chunks``; 1F1B: at most ``num_stages - index``).
        wait_s: seconds this stage spent blocked in receives during the last step
            (see :class:`P2P`); ``wait_s / step time`` measures its bubble.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: ProcessGroup | None = None,
        device: torch.device | str | None = None,
        checkpoint: str = "never",
    ) -> None:
        self.group = process_group if process_group is not None else dist.group.WORLD
        assert self.group is not None
        self.index = dist.get_rank(self.group)
        self.num_stages = dist.get_world_size(self.group)
        self.module = module
        first = next(module.parameters(), None)
        self.device = (
            torch.device(device)
            if device is not None
            else (first.device if first is not None else torch.device("cpu"))
        )
        self.checkpoint = CheckpointMode.parse(checkpoint)
        self.p2p = P2P(self.group, self.device)
        self.state = StageState.IDLE
        self.peak_in_flight = 0
        self._in_flight: dict[int, _InFlight] = {}
        self._chunks: int | None = None  # micro-batches of the current step, when known
        self._next_header: PendingRecv | None = None  # posted ahead for the next input
        self._owed: list[torch.Tensor] | None = None  # inputs in backward (gradient owed)
        self._forwarding: list[torch.Tensor] | None = None  # inputs in forward

    @property
    def wait_s(self) -> float:
        """Seconds blocked in receives during the last (or current) step."""
        return self.p2p.wait_s

    @property
    def is_first(self) -> bool:
        """True on stage 0 (takes the pipeline's input)."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """True on the last stage (computes the loss)."""
        return self.index == self.num_stages - 1

    # step lifecycle ------------------------------------------------------------------
    def begin_step(self, chunks: int | None = None) -> None:
        """Enter a schedule step (nothing may be in flight). With ``chunks`` (the step's
        micro-batches) given, receives are posted ahead (see :mod:`.p2p`)."""
        if self.state is StageState.FAILED:
            raise RuntimeError(
                f"stage {self.index}: a previous step failed and left unmatched messages in "
                "the process group; destroy it and build a new group and stages"
            )
        if self._in_flight:
            raise RuntimeError(
                f"stage {self.index}: micro-batches {sorted(self._in_flight)} are still in flight"
            )
        self.state, self.peak_in_flight = StageState.RUNNING, 0
        self.p2p.wait_s = 0.0
        self._chunks = chunks
        if chunks is not None and not self.is_first:
            self._next_header = self.p2p.irecv_header(self.index - 1)

    def end_step(self) -> None:
        """Leave a step: wait for this stage's sends to finish."""
        self.p2p.wait()
        if self._in_flight:
            raise RuntimeError(
                f"stage {self.index}: step ended with micro-batches {sorted(self._in_flight)} "
                "forwarded but not backpropagated"
            )
        self.state = StageState.IDLE

    # forward ---------------------------------------------------------------------------
    def _receive_input(self, microbatch: int) -> Batch:
        """The input of ``microbatch``; then post the next micro-batch's header receive
        (after this one's tensors, in the order the previous stage sends them)."""
        prev, header, self._next_header = self.index - 1, self._next_header, None
        if header is None:
            header = self.p2p.irecv_header(prev)
        what = f"receive of the input of micro-batch {microbatch}"
        first = self._wait(header, what, prev)[0]
        reason = header_abort_reason(first)
        if reason is not None:
            raise StageFailedError(reason, f"stage {self.index}: {what}")
        atomic, metas = self.p2p.finish_header(first, prev)
        pending = self.p2p.irecv(metas, prev)
        if self._chunks is not None and microbatch + 1 < self._chunks:
            self._next_header = self.p2p.irecv_header(prev)
        tensors = self._wait(pending, what, prev)
        return Batch(tensors[0] if atomic else tuple(tensors))

    def _wait(self, pending: PendingRecv, what: str, peer: int) -> list[torch.Tensor]:
        """``pending.wait()``; a timeout or lost peer raises a :class:`CollectiveError`
        naming this stage, the operation and the peer stage."""
        try:
            return pending.wait()
        except RuntimeError as err:
            if not (isinstance(err, CollectiveError) or is_communication_failure(err)):
                raise
            cause = str(err).split("Backend error: ", 1)[-1].strip().splitlines()[0]
            rank = dist.get_global_rank(self.p2p.group, peer)
            raise CollectiveError(
                "PipelineStage",
                f"stage {self.index}: {what} from stage {peer} (rank {rank})",
                self.index,
                self.num_stages,
                cause,
            ) from err

    def _run_module(self, value: object) -> Batch:
        with self._no_sync():
            if self.checkpoint is CheckpointMode.ALWAYS and torch.is_grad_enabled():
                out = run_checkpointed(self.module, value)  # type: ignore[arg-type]
            else:
                out = self.module(value)
        return Batch(check_value(out, f"output of stage {self.index}"))

    def forward(self, microbatch: int, batch: Batch | None = None) -> Batch:
        """Forward of ``microbatch``: take ``batch`` (first stage) or receive it, run,
        send the output on (not on the last stage). Returns the output."""
        with record_function(f"Pipe::stage={self.index} forward micro_batch={microbatch}"):
            return self._forward(microbatch, batch)

    def _forward(self, microbatch: int, batch: Batch | None) -> Batch:
        if self.is_first:
            assert batch is not None, "the first stage needs its micro-batch"
            batch = batch.with_tensors([t.to(self.device) for t in batch.tensors])
        else:
            with record_function(f"Pipe::recv activations micro_batch={microbatch}"):
                batch = self._receive_input(microbatch)
        if torch.is_grad_enabled() and not self.is_first:
            self._forwarding = [t for t in batch.tensors if t.requires_grad]
        out = self._run_module(batch.value)
        if not self.is_last:
            with record_function(f"Pipe::send activations micro_batch={microbatch}"):
                self.p2p.send(out.tensors, self.index + 1, atomic=out.atomic)
        if torch.is_grad_enabled():
            inputs = [t for t in batch.tensors if t.requires_grad] if not self.is_first else []
            saved = _InFlight(inputs, [t for t in out.tensors if t.requires_grad])
            if not self.is_last:  # its gradient comes back in this order: post it now
                metas = [TensorMeta(tuple(t.shape), t.dtype, False) for t in saved.outputs]
                saved.grads = self.p2p.irecv(metas, self.index + 1)
            self._in_flight[microbatch] = saved
            self.peak_in_flight = max(self.peak_in_flight, len(self._in_flight))
        self._forwarding = None
        return out

    def set_loss(self, microbatch: int, loss: torch.Tensor) -> None:
        """Last stage: the (weighted) loss of ``microbatch`` that its backward starts from."""
        self._in_flight[microbatch].loss = loss

    # backward --------------------------------------------------------------------------
    def backward(self, microbatch: int, *, last: bool = False) -> None:
        """Backward of ``microbatch``: from its loss (last stage) or the received output
        gradient; then send the input gradient back (not on the first stage). ``last``
        marks the final backward of a step (data-parallel gradients reduce there)."""
        with record_function(f"Pipe::stage={self.index} backward micro_batch={microbatch}"):
            self._backward(microbatch, last)

    def _backward(self, microbatch: int, last: bool) -> None:
        oldest = min(self._in_flight, default=None)
        if microbatch != oldest:
            raise RuntimeError(
                f"stage {self.index}: backward of micro-batch {microbatch} before the oldest "
                f"in flight ({oldest}); gradients arrive in forward order"
            )
        saved = self._in_flight.pop(microbatch)
        self._owed = saved.inputs if not self.is_first else None
        if self.is_last:
            assert saved.loss is not None, f"micro-batch {microbatch} has no loss on the last stage"
            roots, grads = [saved.loss], None
        else:
            assert saved.grads is not None
            what = f"receive of the output gradient of micro-batch {microbatch}"
            with record_function(f"Pipe::recv gradients micro_batch={microbatch}"):
                grads = self._wait(saved.grads, what, self.index + 1)
            reason = read_abort(grads)
            if reason is not None:
                raise StageFailedError(reason, f"stage {self.index}: {what}")
            roots = saved.outputs
        if roots:
            self._prepare_reduction(roots, last)
            with self._no_sync(backward=True):
                torch.autograd.backward(roots, grads)
        if last and self._accumulates():
            self.module.reduce()  # type: ignore[operator]
        if not self.is_first:
            input_grads = [
                t.grad if t.grad is not None else torch.zeros_like(t) for t in saved.inputs
            ]
            with record_function(f"Pipe::send gradients micro_batch={microbatch}"):
                self.p2p.send(input_grads, self.index - 1)
        self._owed = None

    # failure (see the failure module) ------------------------------------------------
    def abort(self, error: BaseException) -> None:
        """Tell both neighbours that this stage's step failed with ``error``, in place of
        the next message each waits for; the stage enters ``FAILED``.

        A :class:`StageFailedError` (heard from a neighbour) is passed on unchanged, so
        every stage names the stage that failed first. Called by the schedules."""
        if self.state is StageState.FAILED:
            return
        self.state = StageState.FAILED
        if isinstance(error, StageFailedError):
            reason = error.reason
        else:
            rank = dist.get_global_rank(self.p2p.group, self.index)
            reason = f"stage {self.index} (rank {rank}) failed: {type(error).__name__}: {error}"
        owed = self._owed_gradient()
        try:
            if not self.is_last:
                self.p2p.send([abort_header(reason)], self.index + 1)
            if not self.is_first and owed is not None:
                metas = [TensorMeta(tuple(t.shape), t.dtype, False) for t in owed]
                self.p2p.send(abort_tensors(reason, metas), self.index - 1)
        except RuntimeError:  # a neighbour is gone already; the original error matters
            pass

    def _owed_gradient(self) -> list[torch.Tensor] | None:
        """The inputs whose gradient the previous stage waits for next (None: unknown)."""
        if self._owed is not None:
            return self._owed  # failed in the backward of the oldest micro-batch
        if self._in_flight:
            return self._in_flight[min(self._in_flight)].inputs
        return self._forwarding  # failed in the forward of the only micro-batch

    # data parallelism inside the stage (see the module note) -------------------------
    def _accumulates(self) -> bool:
        """A wrapper with ``no_sync()`` and ``reduce()`` (not DDP): see the module note."""
        return not isinstance(self.module, DistributedDataParallel) and all(
            callable(getattr(self.module, name, None)) for name in ("no_sync", "reduce")
        )

    @contextlib.contextmanager
    def _no_sync(self, backward: bool = False) -> Iterator[None]:
        """Forwards: DDP's or the wrapper's ``no_sync``; backwards: the wrapper's only."""
        ddp = isinstance(self.module, DistributedDataParallel) and not backward
        if ddp or self._accumulates():
            with self.module.no_sync():  # type: ignore[operator]
                yield
        else:
            yield

    def _prepare_reduction(self, roots: list[torch.Tensor], last: bool) -> None:
        if last and isinstance(self.module, DistributedDataParallel):
            self.module.reducer.prepare_for_backward(roots)


def weighted_loss(loss_fn: LossFn, output: Batch, target: Batch, weight: float) -> torch.Tensor:
    """``loss_fn(output, target) * weight``: a micro-batch mean loss times its share of rows."""
    return loss_fn(output.value, target.value) * weight
