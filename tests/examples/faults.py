"""Fault injection for the main job's tests: callbacks that ``train_gpt.main`` installs.

In the tests' own process (a rank of the pool)::

    train_gpt.main(argv, callbacks=[nan_loss_at(step=5, rank=1)])

and under torchrun, this file is the script (it takes the fault flags, passes the rest
to ``train_gpt.main``)::

    torchrun ... tests/examples/faults.py --fault-kill-at-step 4 --fault-rank 1 <job flags>
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
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
    """``train_gpt.main`` with the faults of ``--fault-kill-at-step N --fault-rank R``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault-kill-at-step", type=int, required=True)
    parser.add_argument("--fault-rank", type=int, default=0)
    faults, rest = parser.parse_known_args(argv)
    return train_gpt.main(rest, callbacks=[kill_at(faults.fault_kill_at_step, faults.fault_rank)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
