"""Running a schedule across ranks: ``ScheduleGPipe`` and ``Schedule1F1B``.

Each rank runs the action list of its stage (:mod:`shardkit.nn.pipe.schedule`) on
its :class:`PipelineStage`; ranks coordinate only through the sends and receives the
actions make. The first stage splits the input into micro-batches, the last splits
the target the same way and computes the loss of each micro-batch, weighted by its
share of rows, so the step's loss and gradients are those of the whole mini-batch
(for a ``loss_fn`` that averages over its micro-batch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from shardkit.distributed.consistency import verify_consistent
from shardkit.nn.pipe.microbatch import Batch, TensorOrTensors, gather, scatter
from shardkit.nn.pipe.schedule import Action, Phase, gpipe_actions, one_f_one_b_actions
from shardkit.nn.pipe.stage import LossFn, PipelineStage, weighted_loss

__all__ = ["Schedule1F1B", "ScheduleGPipe"]


@contextlib.contextmanager
def _abort_on_error(stage: PipelineStage) -> Iterator[None]:
    """An error in the body tells the neighbour stages (:meth:`PipelineStage.abort`)."""
    try:
        yield
    except Exception as error:
        stage.abort(error)
        raise


class _PipelineSchedule:
    """Shared runner: splits, runs an action list, returns the mini-batch loss."""

    def __init__(self, stage: PipelineStage, chunks: int, loss_fn: LossFn | None = None) -> None:
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1 (micro-batches per step); got {chunks}")
        self.stage = stage
        self.chunks = chunks
        self.loss_fn = loss_fn
        verify_consistent(  # one small all-gather: a mismatch raises instead of hanging
            [],
            what=f"{type(self).__name__} (stage {stage.index} of {stage.num_stages})",
            group=stage.group,
            options={
                "schedule": type(self).__name__,
                "chunks": chunks,
                "num_stages": stage.num_stages,
            },
        )

    def _run(
        self,
        actions: Sequence[Action],
        inputs: TensorOrTensors | None,
        target: TensorOrTensors | None,
    ) -> torch.Tensor | None:
        stage = self.stage
        if stage.is_first and inputs is None:
            raise ValueError("the first stage needs the inputs: call step(inputs, ...)")
        if stage.is_last and (target is None or self.loss_fn is None):
            raise ValueError("the last stage needs loss_fn (at construction) and target (in step)")
        batches = scatter(inputs, self.chunks) if inputs is not None and stage.is_first else []
        targets = scatter(target, self.chunks) if target is not None and stage.is_last else []
        targets = [t.with_tensors([x.to(stage.device) for x in t.tensors]) for t in targets]
        rows = sum(len(t) for t in targets)
        losses: list[torch.Tensor] = []
        stage.begin_step(self.chunks)
        with _abort_on_error(stage):
            for n, (phase, i) in enumerate(actions):
                if phase is Phase.FORWARD:
                    out = stage.forward(i, batches[i] if batches else None)
                    if stage.is_last:
                        assert self.loss_fn is not None
                        weight = len(targets[i]) / rows
                        loss = weighted_loss(self.loss_fn, out, targets[i], weight)
                        stage.set_loss(i, loss)
                        losses.append(loss.detach())
                else:
                    stage.backward(i, last=n == len(actions) - 1)
        stage.end_step()
        return torch.stack(losses).sum() if losses else None

    def forward(self, inputs: TensorOrTensors | None = None) -> TensorOrTensors | None:
        """Inference: the output of the whole pipeline (on the last stage; None elsewhere),
        micro-batched, without autograd. The first stage passes ``inputs``."""
        stage = self.stage
        batches = scatter(inputs, self.chunks) if inputs is not None and stage.is_first else []
        if stage.is_first and not batches:
            raise ValueError("the first stage needs the inputs: call forward(inputs)")
        outputs: list[Batch] = []
        stage.begin_step(self.chunks)
        with torch.no_grad(), _abort_on_error(stage):
            for i in range(self.chunks):
                outputs.append(stage.forward(i, batches[i] if batches else None))
        stage.end_step()
        return gather(outputs) if stage.is_last else None


class ScheduleGPipe(_PipelineSchedule):
    """GPipe fill-drain across ranks: all forwards of a step, then all backwards.

    Example:
        >>> loss = ScheduleGPipe(stage, chunks=8, loss_fn=F.cross_entropy).step(x, target=y)  # doctest: +SKIP

    Args:
        stage: this rank's :class:`PipelineStage`.
        chunks: micro-batches per step (>= 1, <= the batch size).
        loss_fn: ``loss_fn(output, target) -> scalar``, the mean over a micro-batch;
            needed on the last stage.

    Construction is a collective over the stage's group: every stage checks that all
    use the same schedule class, ``chunks`` and number of stages (one small
    all-gather).

    Raises:
        ValueError: ``chunks`` < 1.
        ConsistencyError: the stages disagree on the schedule, ``chunks`` or the
            number of stages (on every rank, naming each rank's value).

    Memory: each stage keeps the activations of all ``chunks`` micro-batches at the turn
    from forward to backward. Source: Huang et al. 2019 (GPipe), section 2.2.
    """

    def step(
        self, inputs: TensorOrTensors | None = None, *, target: TensorOrTensors | None = None
    ) -> torch.Tensor | None:
        """One training step's forward and backward (gradients accumulate in ``.grad``).

        With ``p = 3`` stages and ``m = 4`` micro-batches (time runs right; a backward
        takes about two forward slots)::

            stage 0  F0 F1 F2 F3 .. .. .. .. .. .. B0 B0 B1 B1 B2 B2 B3 B3
            stage 1  .. F0 F1 F2 F3 .. .. .. B0 B0 B1 B1 B2 B2 B3 B3 ..
            stage 2  .. .. F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3 .. .. ..

        Every stage runs ``F0 .. F(m-1)`` then ``B0 .. B(m-1)``; with equal stages the
        idle slots (the bubble) are a fraction ``(p - 1) / (m + p - 1)`` of the step,
        and every stage holds all ``m`` micro-batches' activations at the turn.

        Args:
            inputs: first stage: the mini-batch (tensor or tuple, ``(B, ...)``); others:
                None.
            target: last stage: the targets ``(B, ...)``, split like the inputs.

        Returns:
            Last stage: the mini-batch loss (detached, the row-weighted mean of the
            micro-batch losses); other stages: None.

        Raises:
            ValueError: a missing input / target / loss_fn, or ``B < chunks``.
            StageFailedError: another stage raised during the step; the message names
                it (``stage 1 (rank 1) failed: <error>``). Any error raised here is sent
                to the neighbour stages first (:mod:`shardkit.nn.pipe.failure`).
            CollectiveError: a neighbour stage timed out or disconnected (named).
        """
        actions = gpipe_actions(self.stage.index, self.stage.num_stages, self.chunks)
        return self._run(actions, inputs, target)


class Schedule1F1B(_PipelineSchedule):
    """1F1B (PipeDream-Flush) across ranks: bounded activation memory, same bubble as GPipe.

    Arguments as :class:`ScheduleGPipe`. Memory: stage ``s`` of ``p`` keeps at most
    ``p - s`` micro-batches of activations (GPipe: ``chunks``). Source: Narayanan et al.
    2021 (PipeDream-2BW / PipeDream-Flush), section 2.2; Fan et al. 2021 (DAPPLE).
    """

    def step(
        self, inputs: TensorOrTensors | None = None, *, target: TensorOrTensors | None = None
    ) -> torch.Tensor | None:
        """One training step's forward and backward (gradients accumulate in ``.grad``).

        With ``p = 3`` stages and ``m = 4`` micro-batches (a backward takes about two
        forward slots)::

            stage 0  F0 F1 F2 .. .. .. .. B0 B0 F3 B1 B1 .. B2 B2 .. B3 B3
            stage 1  .. F0 F1 .. .. B0 B0 F2 B1 B1 F3 B2 B2 .. B3 B3 ..
            stage 2  .. .. F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .. .. ..

        Stage ``s`` runs ``p - s - 1`` warm-up forwards, then one forward and one
        backward in turn (oldest micro-batch first), then the remaining backwards: the
        same length and bubble as GPipe, but stage ``s`` holds at most ``p - s``
        micro-batches' activations (3, 2, 1 here; GPipe: 4, 4, 4).

        Arguments, returns and errors as :meth:`ScheduleGPipe.step`.
        """
        actions = one_f_one_b_actions(self.stage.index, self.stage.num_stages, self.chunks)
        return self._run(actions, inputs, target)
