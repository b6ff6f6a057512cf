"""Elastic training of the main job: lose a node, go on smaller, grow back.

Two torchrun agents on loopback are the two "nodes" (``--nnodes 1:2``, one rank each,
c10d rendezvous on 127.0.0.1, ``--max-restarts 3``), as in ``docs/elastic.md``:

1. both train (world size 2, global batch 8 = 4 x 1 x 2) and checkpoint at step 3;
2. node B dies in step 5 (its agent and its worker SIGKILLed, a hook of
   ``tests/examples/faults.py``); A's worker fails on the next collective, A's agent
   restarts it, the rendezvous closes with A alone after ``last_call_timeout``, and
   the job resumes from step 3 at world size 1 (global batch 8 = 4 x 2 x 1);
3. at world size 1 the worker holds after the step-6 checkpoint (another hook) until
   node B comes back: a new agent joins, A's agent sees the waiting node and
   restarts its worker, and both resume from step 6 at world size 2 and finish.

The run ends where the uninterrupted 2-rank run ends, to float rounding: the same
global batches (``BatchSampler`` draws each step's global batch from the seed and the
step), reduced in another order.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import pytest
import train_gpt

from shardkit.checkpoint.manifest import read_manifest
from tests.examples import faults

TINY = ["--model-size", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1"]
TINY += ["--sample-bytes", "0"]  # the sample is checked in test_train_gpt_outputs
JOB = [*TINY, "--steps", "12", "--eval-every", "6", "--save-every", "3"]
FAULTS = Path(faults.__file__)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch.distributed.run") is None,
    reason="torchrun (torch.distributed.run) is not available",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agent(
    port: int, out_dir: Path, log: IO[str], host: bool, *flags: str
) -> subprocess.Popen[str]:
    """One node: a torchrun agent with one worker, in a session of its own."""
    conf = f"is_host={int(host)},last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2"]
    cmd += ["--nproc-per-node", "1", "--max-restarts", "3"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    cmd += ["--rdzv-id", "elastic-test", "--rdzv-conf", conf, "--local-addr", "127.0.0.1"]
    cmd += [str(FAULTS), *JOB, "--resume", "--out-dir", str(out_dir), *flags]
    cmd += ["--fault-hold-at-step", "6", "--fault-hold-world-size", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # a fresh store per round (gpt_dist.py)
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )


def _wait_for(
    what: str, ready: Callable[[], bool], alive: subprocess.Popen[str], log: Path
) -> None:
    deadline = time.monotonic() + 300
    while not ready():
        if alive.poll() is not None:
            pytest.fail(f"{what}: node A ended ({alive.returncode}):\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within 300 s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def _saved_by_one_rank(out_dir: Path, step: int) -> bool:
    latest = out_dir / "latest"
    if not latest.is_file() or latest.read_text().strip() != f"ckpt-{step:06d}":
        return False
    return read_manifest(out_dir / f"ckpt-{step:06d}").world_size == 1


def _metrics(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / "metrics.json").read_text())


def _uninterrupted(argv: list[str]) -> int:
    return train_gpt.main(argv)


def test_lose_a_node_shrink_and_grow_back(rank_pool: Any, tmp_path: Path) -> None:
    out, port = tmp_path / "elastic", _free_port()
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b", "b2")}
    agents: list[subprocess.Popen[str]] = []
    times = [time.monotonic()]
    reference = tmp_path / "reference"  # the same job, never interrupted, on 2 ranks
    # run alongside the agents (they mostly wait: rendezvous, restarts, the exit barrier)
    background = ThreadPoolExecutor(1)
    ref_codes = background.submit(
        rank_pool(2).run, _uninterrupted, [*JOB, "--out-dir", str(reference)], timeout_s=240
    )
    try:
        with logs["a"].open("w") as a_log, logs["b"].open("w") as b_log:
            agents.append(_agent(port, out, a_log, True))
            time.sleep(0.5)  # A hosts the rendezvous store
            agents.append(_agent(port, out, b_log, False, "--fault-kill-node-at-step", "4"))
            shrunk = lambda: _saved_by_one_rank(out, 6)  # noqa: E731
            _wait_for("resume at world size 1", shrunk, agents[0], logs["a"])
            assert agents[1].wait(timeout=30) == -signal.SIGKILL  # node B is gone
            times.append(time.monotonic())
            with logs["b2"].open("w") as b2_log:  # node B comes back
                agents.append(_agent(port, out, b2_log, False))
                _wait_for("metrics.json", (out / "metrics.json").is_file, agents[0], logs["a"])
                times.append(time.monotonic())
                assert ref_codes.result() == [0, 0]  # the reference run
                times.append(time.monotonic())
                assert agents[0].wait(timeout=300) == 0, logs["a"].read_text()[-3000:]
                assert agents[2].wait(timeout=300) == 0, logs["b2"].read_text()[-3000:]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
        background.shutdown(wait=True)
    printed = logs["a"].read_text() + logs["b2"].read_text()
    assert f"resumed from {out / 'ckpt-000003'} at step 3" in printed, printed[-3000:]
    assert "elastic resume: saved by 2 rank(s) with --strategy ddp, now 1" in printed
    assert f"resumed from {out / 'ckpt-000006'} at step 6" in printed
    assert "elastic resume: saved by 1 rank(s) with --strategy ddp, now 2" in printed
    m, r = _metrics(out), _metrics(reference)
    assert (m["step"], m["start_step"], m["world_size"]) == (12, 6, 2)
    assert (m["global_batch"], m["grad_accum"]) == (8, 1)
    assert [s for s, _ in m["train_loss"]] == list(range(1, 13))
    assert r["train_loss"][:3] == m["train_loss"][:3]  # up to the step-3 checkpoint: bitwise
    for (step, got), (_, want) in zip(m["train_loss"], r["train_loss"], strict=True):
        assert abs(got - want) <= 1e-4 * want, (step, got, want)
    (_, final), (_, final_ref) = m["val_loss"][-1], r["val_loss"][-1]
    print(  # the numbers of docs/elastic.md (pytest -s shows them)
        f"\nelastic: final val {final!r} (uninterrupted {final_ref!r}, relative "
        f"{abs(final - final_ref) / final_ref:.2e}); train step 12 {m['train_loss'][-1][1]!r} "
        f"(uninterrupted {r['train_loss'][-1][1]!r}); seconds: to world size 1 at step 6 "
        f"{times[1] - times[0]:.0f}, grown back and done {times[2] - times[1]:.0f}, "
        f"reference done {times[3] - times[2]:.0f} later, agents exited "
        f"{time.monotonic() - times[3]:.0f}"
    )
    assert abs(final - final_ref) <= 1e-4 * final_ref, (final, final_ref)  # target: 1%


def _runs(argvs: list[list[str]]) -> list[int]:
    return [train_gpt.main(argv) for argv in argvs]


PAIRS = [  # (saved on 2 ranks, its flags, resumed on 1 rank)
    ("fsdp", [], "oss"),
    ("sdp", [], "fsdp"),
    ("hsdp", ["--shard-size", "2"], "ddp"),
    ("oss", [], "sdp"),
    ("pipe", [], "fsdp"),  # two stages -> the plain GPT's keys (examples/gpt_wrappers.GPTKeys)
    ("ddp", [], "offload"),
    ("ddp", ["--tp", "2", "--global-batch", "4"], "ddp"),  # tp 2 x dp 1 (accumulation 2)
]


def test_resume_other_strategy_and_world_size(rank_pool: Any, tmp_path: Path) -> None:
    """A checkpoint of each saving strategy on 2 ranks (one with ``--tp 2``) resumes
    under another strategy (without tensor parallelism) on 1 rank (this process; gradient accumulation 2 keeps the global batch 4) and ends on
    the losses of the uninterrupted ddp run on 2 ranks, to float rounding."""
    job = [*TINY, "--batch-size", "2", "--steps", "6", "--eval-every", "3", "--save-every", "3"]
    first = []
    for i, (saved, flags, _) in enumerate(PAIRS):
        out = str(tmp_path / f"{i}-{saved}")
        first.append([*job, "--strategy", saved, *flags, "--stop-after", "3", "--out-dir", out])
    reference = [*job, "--out-dir", str(tmp_path / "reference")]
    codes = rank_pool(2).run(_runs, [*first, reference], timeout_s=300)
    assert codes == [[0] * (len(PAIRS) + 1)] * 2
    r = _metrics(tmp_path / "reference")
    for i, (saved, _, resumed) in enumerate(PAIRS):
        out = tmp_path / f"{i}-{saved}"
        assert train_gpt.main([*job, "--strategy", resumed, "--resume", "--out-dir", str(out)]) == 0
        m = _metrics(out)
        assert (m["start_step"], m["world_size"], m["strategy"]) == (3, 1, resumed)
        assert (m["global_batch"], m["grad_accum"]) == (4, 2)
        for name in ("train_loss", "val_loss"):
            for (step, got), (_, want) in zip(m[name], r[name], strict=True):
                assert abs(got - want) <= 1e-4 * want, (saved, resumed, name, step, got, want)
