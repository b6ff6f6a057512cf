"""Fault injection for the main job's tests: callbacks that ``train_gpt.main`` installs.

In the tests' own process (a rank of the pool)::

    train_gpt.main(argv, callbacks=[nan_loss_at(step=5, rank=1)])

and under torchrun, this file is the script (it takes the fault flags, passes the rest
to ``train_gpt.main``)::

    torchrun ... tests/examples/faults.py --fault-kill-at-step 4 --fault-rank 1 <job flags>
    torchrun ... tests/examples/faults.py --fault-kill-node-at-step 6 <job flags>
    torchrun ... tests/examples/faults.py --fault-hold-at-step 8 --fault-hold-world-size 1 ...
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn

from tests.examples import EXAMPLES_DIR

assert EXAMPLES_DIR.is_dir()  # importing tests.examples puts the examples on sys.path
import train_gpt  # noqa: E402


def kill_at(step: int, rank: int) -> train_gpt.Callback:
    """SIGKILL rank ``rank`` in step ``step + 1``, between its backward pass and its
    optimizer step (an optimizer step pre-hook); only on torchrun's first attempt
    (``TORCHELASTIC_RESTART_COUNT`` unset or 0), so the restarted job runs through."""

    def install(run: train_gpt.Run) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if run.env.rank != rank or not first_attempt:
            return

        def pre_step(*_: Any) -> None:
            if run.step == step:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)

        run.strategy.optimizer.register_step_pre_hook(pre_step)

    return install


def kill_node_at(step: int) -> train_gpt.Callback:
    """SIGKILL this node in step ``step + 1`` (before its optimizer step): its torchrun
    agent (the parent process of every worker) first, then this worker; on the agent's
    first attempt only. torchrun starts each worker in a session of its own, so
    killing the agent alone would leave its workers running."""

    def install(run: train_gpt.Run) -> None:
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return

        def pre_step(*_: Any) -> None:
            if run.step == step:
                sys.stdout.flush()
                os.kill(os.getppid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

        run.strategy.optimizer.register_step_pre_hook(pre_step)

    return install


def hold_at(step: int, world_size: int, limit_s: float = 120.0) -> train_gpt.Callback:
    """At world size ``world_size``, stop before step ``step + 1`` (after the
    checkpoints up to step ``step`` are written) for up to ``limit_s`` seconds: the
    time for another node to join, whose arrival makes torchrun restart this worker."""

    def install(run: train_gpt.Run) -> None:
        if run.env.world_size != world_size:
            return

        def pre_step(*_: Any) -> None:
            if run.step == step:
                sys.stdout.flush()
                deadline = time.monotonic() + limit_s
                while time.monotonic() < deadline:
                    time.sleep(0.1)

        run.strategy.optimizer.register_step_pre_hook(pre_step)

    return install


def nan_loss_at(step: int, rank: int) -> train_gpt.Callback:
    """Make the training loss of step ``step`` NaN on rank ``rank`` (a forward hook on
    the strategy's module; evaluation forwards are left alone)."""

    def install(run: train_gpt.Run) -> None:
        if run.env.rank != rank:
            return

        def after_forward(module: nn.Module, _: Any, output: Any) -> Any:
            if not module.training or run.step + 1 != step:
                return None
            logits, loss = output
            return logits, loss * torch.tensor(float("nan"), device=loss.device)

        run.strategy.module.register_forward_hook(after_forward)

    return install


def main(argv: list[str]) -> int:
    """``train_gpt.main`` with the faults of ``--fault-kill-at-step N --fault-rank R``,
    ``--fault-kill-node-at-step N`` and ``--fault-hold-at-step N --fault-hold-world-size W``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault-kill-at-step", type=int, default=None)
    parser.add_argument("--fault-rank", type=int, default=0)
    parser.add_argument("--fault-kill-node-at-step", type=int, default=None)
    parser.add_argument("--fault-hold-at-step", type=int, default=None)
    parser.add_argument("--fault-hold-world-size", type=int, default=1)
    faults, rest = parser.parse_known_args(argv)
    callbacks = []
    if faults.fault_kill_at_step is not None:
        callbacks.append(kill_at(faults.fault_kill_at_step, faults.fault_rank))
    if faults.fault_kill_node_at_step is not None:
        callbacks.append(kill_node_at(faults.fault_kill_node_at_step))
    if faults.fault_hold_at_step is not None:
        callbacks.append(hold_at(faults.fault_hold_at_step, faults.fault_hold_world_size))
    return train_gpt.main(rest, callbacks=callbacks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
