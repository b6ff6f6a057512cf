"""The main job on 8 ranks over a mesh: hybrid sharding x tensor parallel and pipeline x
tensor parallel follow the plain GPT, and a checkpoint saved in one moves to the other.

One 8-rank pool runs, on each rank, in order:

- ``hsdp``: ``--dp-replicate 2 --dp-shard 2 --tp 2``, 2 steps, uninterrupted;
- ``pipe``: ``--pp 2 --tp 2`` (``dp_shard`` 2 inferred), 2 steps;
- ``saved``: as ``hsdp``, stopped after step 1 (its checkpoint written);
- ``resumed``: ``--pp 2 --tp 2 --resume`` from ``saved``'s checkpoint, step 2;

then 2 ranks resume ``saved``'s checkpoint under ``--strategy fsdp`` (``resumed2``,
2 micro-batches of 2 rows per rank: the same global batch).

Every run samples the same global batch of 8 rows per step (4 data-parallel ranks x 2),
as the plain GPT on one rank does (``--global-batch 8``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import train_gpt

COMMON = [
    *("--model-size", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1"),
    *("--steps", "2", "--eval-every", "0", "--sample-bytes", "0"),  # sample: test_train_gpt_outputs
]
HSDP = ["--dp-replicate", "2", "--dp-shard", "2", "--tp", "2"]
PIPE = ["--pp", "2", "--tp", "2", "--chunks", "2"]


def _losses(out_dir: Path) -> list[float]:
    metrics = json.loads((out_dir / "metrics.json").read_text())
    return [loss for _, loss in metrics["train_loss"]]


def _run_main(argvs: list[list[str]]) -> list[int]:
    return [train_gpt.main(argv) for argv in argvs]


def test_hsdp_tp_and_pipe_tp_on_eight_ranks_follow_the_plain_gpt_and_resume_across(
    rank_pool: Any, tmp_path: Path
) -> None:
    names = ("plain", "hsdp", "pipe", "saved", "resumed", "resumed2")
    d = {name: tmp_path / name for name in names}
    plain = [*COMMON, "--global-batch", "8", "--save-every", "0", "--out-dir", str(d["plain"])]
    assert train_gpt.main(plain) == 0  # 1 rank, in process: 4 micro-batches of 2 rows
    runs = [
        [*COMMON, *HSDP, "--save-every", "0", "--out-dir", str(d["hsdp"])],
        [*COMMON, *PIPE, "--save-every", "0", "--out-dir", str(d["pipe"])],
        [*COMMON, *HSDP, "--stop-after", "1", "--out-dir", str(d["saved"])],
    ]
    assert rank_pool(8).run(_run_main, runs, timeout_s=400) == [[0, 0, 0]] * 8
    shutil.copytree(d["saved"], d["resumed"])
    shutil.copytree(d["saved"], d["resumed2"])
    resume = [*COMMON, *PIPE, "--resume", "--out-dir", str(d["resumed"])]
    assert rank_pool(8).run(_run_main, [resume], timeout_s=200) == [[0]] * 8
    resume2 = [*COMMON, "--strategy", "fsdp", "--resume", "--out-dir", str(d["resumed2"])]
    assert rank_pool(2).run(_run_main, [resume2], timeout_s=200) == [[0]] * 2

    want = _losses(d["plain"])
    hsdp, pipe = _losses(d["hsdp"]), _losses(d["pipe"])
    assert len(want) == len(hsdp) == len(pipe) == 2
    assert abs(hsdp[0] - want[0]) < 1e-5, (hsdp, want)  # the same GPT and rows
    assert abs(pipe[0] - want[0]) < 1e-5, (pipe, want)
    assert abs(hsdp[1] - want[1]) < 1e-4 and abs(pipe[1] - want[1]) < 1e-4, (hsdp, pipe, want)
    resumed = json.loads((d["resumed"] / "metrics.json").read_text())
    assert resumed["start_step"] == 1 and resumed["args"]["pp"] == 2
    step2, step2_fsdp = _losses(d["resumed"])[-1], _losses(d["resumed2"])[-1]
    print(f"plain {want}, hsdp x tp {hsdp}, pipe x tp {pipe}, resumed {step2} / {step2_fsdp}")
    assert abs(step2 - hsdp[1]) < 1e-5, (step2, hsdp)  # as if never interrupted
    assert abs(step2_fsdp - hsdp[1]) < 1e-5, (step2_fsdp, hsdp)
