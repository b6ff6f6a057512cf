"""The main job end to end: torchrun on 2 ranks, exact resume, bad input."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import gpt_checkpoint
import pytest
import torch
import train_gpt

from shardkit.checkpoint.manifest import save_checkpoint
from shardkit.models import GPT, gpt_config
from tests.examples import EXAMPLES_DIR

TINY = ["--model-size", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1"]
TINY += ["--sample-bytes", "0"]  # the sample is checked in test_train_gpt_outputs


def _metrics(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / "metrics.json").read_text())


def _tiny_params(seq_len: int) -> int:
    return GPT(gpt_config("tiny", block_size=seq_len)).num_parameters()


def test_torchrun_two_ranks_loss_falls(tmp_path: Path) -> None:
    """The real launch path: torchrun, env:// rendezvous, DDP over 2 ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    args = [*TINY, "--steps", "12", "--eval-every", "6", "--save-every", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, str(EXAMPLES_DIR / "train_gpt.py"), *args, "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = _metrics(tmp_path)
    n = _tiny_params(32)
    assert (m["world_size"], m["strategy"], m["param_count"]) == (2, "ddp", n)
    assert f"{n:,} parameters" in proc.stdout
    assert not (tmp_path / "sample.txt").exists() and "sample (prompt" not in proc.stdout  # 0
    assert [s for s, _ in m["train_loss"]] == list(range(1, 13))
    assert [s for s, _ in m["val_loss"]] == [0, 6, 12]
    val = [v for _, v in m["val_loss"]]
    assert val[0] > 5.0  # about ln(256) = 5.55 at initialisation
    assert val[-1] < val[0] - 1.0, val
    assert m["train_loss"][-1][1] < m["train_loss"][0][1] - 1.0
    # DDP keeps the full model state on each rank: fp32 params and grads, AdamW's two
    # moments, and one 4-byte step counter per parameter tensor.
    n_tensors = len(list(GPT(gpt_config("tiny", block_size=32)).parameters()))
    for b in m["model_state_bytes"]:
        assert (b["parameters"], b["gradients"]) == (4 * n, 4 * n)
        assert b["optimizer_state"] == 8 * n + 4 * n_tensors
    assert "r0 " in proc.stdout and "r1 " in proc.stdout


def _run_main(argvs: list[list[str]]) -> list[int]:
    """On each pool rank: run the job once per command line; the exit codes."""
    return [train_gpt.main(argv) for argv in argvs]


def _write_foreign_checkpoint(out_dir: Path) -> None:
    """A checkpoint of another program (per-rank files, no universal layout)."""
    save_checkpoint(out_dir, 3, {"rank0.pt": {}}, layout={"strategy": "ddp"})


def _losses_close(a: list[list[float]], b: list[list[float]], rtol: float) -> None:
    assert [s for s, _ in a] == [s for s, _ in b]
    for (step, x), (_, y) in zip(a, b, strict=True):
        assert abs(x - y) <= rtol * abs(x), (step, x, y)


def test_resume_reproduces_losses_exactly(rank_pool: Any, tmp_path: Path) -> None:
    """Run 8 steps straight; run 3 steps then resume to 8: the same losses, bitwise.

    Elastic: a checkpoint written by 1 rank (this process, ``--batch-size 8``: global
    batch 8) resumes on 2 ranks at ``--batch-size 4`` (8 = 4 x 1 x 2) and ends on the
    same losses to float rounding (the same global batches, reduced in another order);
    at ``--batch-size 3`` the global batch 8 does not split over 2 ranks: exit 2 on
    every rank. A checkpoint of another program and other model shapes: exit 2 (no
    hang); ``--resume`` with no checkpoint starts at step 0.
    """
    common = [*TINY, "--steps", "8", "--eval-every", "4", "--save-every", "3"]
    full, split, foreign = tmp_path / "full", tmp_path / "split", tmp_path / "foreign"
    fresh, grown, refused = tmp_path / "fresh", tmp_path / "grown", tmp_path / "refused"
    _write_foreign_checkpoint(foreign)
    one_rank = [*common, "--batch-size", "8", "--stop-after", "3"]
    assert train_gpt.main([*one_rank, "--out-dir", str(grown)]) == 0  # 1 rank, in process
    shutil.copytree(grown, refused)
    codes = rank_pool(2).run(
        _run_main,
        [
            [*common, "--out-dir", str(full)],
            [*common, "--out-dir", str(split), "--stop-after", "3"],
            [*common, "--out-dir", str(split), "--resume"],
            [*common, "--out-dir", str(foreign), "--resume"],
            [*common, "--out-dir", str(fresh), "--resume"],  # nothing to resume: step 0
            [*common, "--out-dir", str(full), "--resume", "--seq-len", "16"],  # other shapes
            [*common, "--out-dir", str(grown), "--resume"],  # 1 rank -> 2 ranks
            [*common, "--out-dir", str(refused), "--resume", "--batch-size", "3"],
        ],
        timeout_s=240,
    )
    assert codes == [[0, 0, 0, 2, 0, 2, 0, 2]] * 2  # bad resumes end every rank
    g = _metrics(grown)
    assert (g["start_step"], g["world_size"], g["global_batch"], g["grad_accum"]) == (3, 2, 8, 1)
    _losses_close(g["train_loss"], _metrics(full)["train_loss"], rtol=1e-5)
    _losses_close(g["val_loss"], _metrics(full)["val_loss"], rtol=1e-5)
    a, b = _metrics(full), _metrics(split)
    assert _metrics(fresh)["train_loss"] == a["train_loss"]
    assert (a["start_step"], b["start_step"], b["step"]) == (0, 3, 8)
    assert b["train_loss"] == a["train_loss"]  # steps 4..8 were computed after resuming
    assert b["val_loss"] == a["val_loss"]
    assert sorted(p.name for p in split.glob("ckpt-*")) == ["ckpt-000006", "ckpt-000008"]
    assert (split / "latest").read_text().strip() == "ckpt-000008"
    model_a, model_b = torch.load(full / "model.pt"), torch.load(split / "model.pt")
    assert model_a.keys() == model_b.keys()
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)
    with pytest.raises(gpt_checkpoint.InputError, match=r"--seq-len 32 \(this run: 16\)"):
        shapes = {"model_size": "tiny", "seq_len": 16}
        gpt_checkpoint.check_resumable(full / "ckpt-000008", 0, shapes)
    with pytest.raises(gpt_checkpoint.InputError, match="holds no main-job state"):
        gpt_checkpoint.check_resumable(foreign / "ckpt-000003", 0, shapes)


def test_global_batch_arithmetic() -> None:
    """global batch = micro batch x accumulation x data-parallel size; refusals show it."""
    plan = train_gpt.batch_plan(train_gpt.parse_args(["--batch-size", "4"]), 2)
    assert (plan.global_batch, plan.accumulation, plan.rows) == (8, 1, 4)
    config = train_gpt.parse_args(["--batch-size", "2", "--grad-accum", "3"])
    assert train_gpt.batch_plan(config, 2).global_batch == 12
    resumed = train_gpt.batch_plan(config, 1, saved=12)  # the checkpoint's wins
    assert (resumed.global_batch, resumed.accumulation) == (12, 6)
    with pytest.raises(gpt_checkpoint.InputError) as err:
        train_gpt.batch_plan(config, 5, saved=12)
    assert str(err.value) == (
        "--resume: the checkpoint's global batch 12 does not split over 5 data-parallel "
        "rank(s): global batch = --batch-size 2 x grad-accum x 5 ranks, and 12 / (2 x 5) "
        "= 1.2 is not a whole number; launch a data-parallel size that divides 6 "
        "(12 / --batch-size 2)"
    )
    with pytest.raises(gpt_checkpoint.InputError, match="use a --batch-size that divides 4"):
        train_gpt.batch_plan(train_gpt.parse_args(["--batch-size", "3"]), 2, saved=8)
    with pytest.raises(
        gpt_checkpoint.InputError,
        match="trained at global batch 8, this run asks --global-batch 16",
    ):
        pass_16 = train_gpt.parse_args(["--global-batch", "16"])
        train_gpt.batch_plan(pass_16, 2, saved=8)
    with pytest.raises(gpt_checkpoint.InputError, match="not --grad-accum 3; give one"):
        both = train_gpt.parse_args(["--global-batch", "16", "--grad-accum", "3"])
        train_gpt.batch_plan(both, 1)


def _bad_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "empty.txt").write_text("")
    (tmp / "notext").mkdir()
    (tmp / "notext" / "a.md").write_text("no .txt here")
    (tmp / "short.txt").write_text("x" * 500)
    return [
        (["--strategy", "nope"], "unknown --strategy 'nope'; choose one of ['ddp'"),
        (["--data", str(tmp / "missing.txt")], "missing.txt: no such file or directory"),
        (["--data", str(tmp / "empty.txt")], "the text is empty"),
        (["--data", str(tmp / "notext")], "the directory has no .txt files"),
        (["--data", str(tmp / "short.txt"), "--seq-len", "64"], "validation split has 50"),
        (["--data", str(tmp / "short.txt"), "--seq-len", "600"], "training split has 450"),
        (["--steps", "0"], "--steps: must be >= 1, got 0"),
        (["--model-size", "huge"], "invalid choice: 'huge'"),
    ]


def test_bad_input_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in _bad_inputs(tmp_path):
        code = train_gpt.main([*argv, "--out-dir", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 2, argv
        assert err.startswith("train_gpt.py: error: ") and err.count("\n") == 1, err
        assert message in err, err
    assert not (tmp_path / "out").exists()


def test_resume_with_another_schedule_warns_with_the_lr_jump() -> None:
    """Regression (fresh-user test): ``--resume --steps 12`` from a run of ``--steps 8``
    changed the LR schedule without a word (factor 0.100 -> 0.363 at step 8)."""
    saved = {"steps": 8, "warmup": 1}
    same = train_gpt.parse_args(["--steps", "8", "--warmup-steps", "1"])
    assert train_gpt.schedule_change(saved, same, 8) is None
    assert train_gpt.schedule_change(None, same, 8) is None  # an older checkpoint
    longer = train_gpt.parse_args(["--steps", "12", "--warmup-steps", "1"])
    before, after = train_gpt.lr_factor(8, 1, 8), train_gpt.lr_factor(8, 1, 12)
    assert (round(before, 3), round(after, 3)) == (0.1, 0.363)
    assert train_gpt.schedule_change(saved, longer, 8) == (
        "--steps 12 --warmup-steps 1 differ from the checkpoint's 8 and 1: the LR schedule "
        "changes, at step 8 the factor on --lr goes from 0.100 to 0.363. To continue the "
        "same schedule, resume with the checkpoint's --steps (and --stop-after to end earlier)"
    )


def test_offload_dir_that_is_a_file_is_a_launch_error(tmp_path: Path) -> None:
    """Regression (fresh-user test): ``--offload-dir`` naming a regular file ended in a
    ``ValueError`` traceback on every rank, not the one-line refusal (exit 2)."""
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    env = train_gpt.Env(rank=0, world_size=1, device=torch.device("cpu"), owns_group=False)
    bad = train_gpt.parse_args(["--strategy", "offload", "--offload-dir", str(afile)])
    assert train_gpt.launch_error(bad, env) == (
        f"--offload-dir {afile} is not a directory (a disk-tier directory to create or reuse)"
    )
    fresh = train_gpt.parse_args(["--strategy", "offload", "--offload-dir", str(tmp_path / "d")])
    assert train_gpt.launch_error(fresh, env) is None


def test_resume_into_a_checkpoint_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression (fresh-user test): ``--resume --out-dir runs/x/ckpt-000003`` (the
    checkpoint itself, not the run directory holding it) found no ``latest`` there,
    started at step 0 and trained into the checkpoint directory. Now: one line naming
    it and its parent, exit 2, nothing written."""
    _write_foreign_checkpoint(tmp_path)
    ckpt = tmp_path / "ckpt-000003"
    before = sorted(p.name for p in ckpt.iterdir())
    env = train_gpt.Env(rank=0, world_size=1, device=torch.device("cpu"), owns_group=False)
    expected = (
        f"--resume: --out-dir {ckpt} is a checkpoint directory (it holds manifest.json), "
        f"not a run directory; use the run directory that holds it and 'latest': "
        f"--out-dir {tmp_path}"
    )
    config = train_gpt.parse_args(["--resume", "--out-dir", str(ckpt)])
    assert train_gpt.launch_error(config, env) == expected
    fresh = train_gpt.parse_args(["--out-dir", str(ckpt)])  # no --resume: not this check
    assert train_gpt.launch_error(fresh, env) is None
    assert train_gpt.launch_error(train_gpt.parse_args(["--resume"]), env) is None
    assert train_gpt.main([*TINY, "--resume", "--out-dir", str(ckpt)]) == 2
    assert capsys.readouterr().err == f"train_gpt.py: error: {expected}\n"
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_resume_with_no_step_left_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression (fresh-user test): ``--resume --steps 2`` from a checkpoint at step 3
    ended at step 3 with only the schedule warning, and its summary showed the step-0
    validation loss as the final one. Now: one line that no step is left, and the
    summary gives the checkpoint's last losses with their steps."""
    common = [*TINY, "--eval-every", "0", "--warmup-steps", "1", "--out-dir", str(tmp_path)]
    assert train_gpt.main([*common, "--steps", "6", "--stop-after", "3"]) == 0
    history = _metrics(tmp_path)
    (_, train3), (val_step, val0) = history["train_loss"][-1], history["val_loss"][-1]
    assert val_step == 0  # --eval-every 0: only step 0 was validated before step 6
    capsys.readouterr()
    assert train_gpt.main([*common, "--steps", "2", "--resume"]) == 0
    out = capsys.readouterr().out
    left = (
        "--resume: the checkpoint is at step 3 and --steps is 2: no step left to run; "
        "this run trains nothing (a --steps above 3 continues the training)\n"
    )
    assert left in out, out
    assert (
        f"done: step 3, no step ran; the checkpoint's last losses: train {train3:.4f} "
        f"(step 3), val {val0:.4f} (step 0), "
    ) in out, out
    m = _metrics(tmp_path)
    assert (m["start_step"], m["step"], m["train_loss"]) == (3, 3, history["train_loss"])


def test_no_step_left_and_final_losses() -> None:
    """The two messages of a resume with nothing to run, and the summary's losses."""
    config = train_gpt.parse_args(["--steps", "10", "--stop-after", "6"])
    assert train_gpt.no_step_left(5, config) is None
    assert train_gpt.no_step_left(6, config) == (
        "--resume: the checkpoint is at step 6 and --stop-after is 6: no step left to "
        "run; this run trains nothing (a --stop-after above 6 continues the training)"
    )
    assert train_gpt.no_step_left(12, config) is not None
    assert "step 12 and --steps is 10" in str(train_gpt.no_step_left(12, config))
    ran = train_gpt.History(train_loss=[[1, 5.0], [2, 4.0]], val_loss=[[0, 5.5], [2, 4.5]])
    assert (
        train_gpt.final_losses(ran, 2) == "train loss 5.0000 -> 4.0000, val loss 5.5000 -> 4.5000"
    )
    assert train_gpt.final_losses(ran, 0) == (
        "no step ran; the checkpoint's last losses: train 4.0000 (step 2), val 4.5000 (step 2)"
    )
    empty = train_gpt.History()
    assert train_gpt.final_losses(empty, 0) == "no step ran, and the checkpoint records no loss"


def _main_outputs(argvs: list[list[str]]) -> list[tuple[int, str, str]]:
    """On each pool rank: run the job once per command line; the exit code, stdout and
    stderr of each."""
    results = []
    for argv in argvs:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = train_gpt.main(argv)
        results.append((code, out.getvalue(), err.getvalue()))
    return results


def test_resume_refusals_print_once_and_after_no_banner(rank_pool: Any, tmp_path: Path) -> None:
    """Regressions (fresh-user test), on 2 ranks: a resume refused in the job (another
    program's checkpoint; a global batch the new size cannot split) printed its error
    line on every rank, and the global-batch refusal came after a banner showing this
    launch's global batch (6 = 3 x 1 x 2) as if it would run. Now: the line on rank 0
    only, exit 2 on both, no banner; an accepted resume's banner shows the checkpoint's
    global batch that runs (8 = 2 x 2 x 2, not --batch-size 2's 4)."""
    foreign, batch8 = tmp_path / "foreign", tmp_path / "batch8"
    _write_foreign_checkpoint(foreign)
    saved = ["--steps", "8", "--save-every", "3", "--stop-after", "3", "--eval-every", "0"]
    assert train_gpt.main([*TINY, *saved, "--batch-size", "8", "--out-dir", str(batch8)]) == 0
    resume = [*TINY, *saved, "--resume"]
    results = rank_pool(2).run(
        _main_outputs,
        [
            [*resume, "--out-dir", str(foreign)],
            [*resume, "--out-dir", str(batch8), "--batch-size", "3"],
            [*resume, "--out-dir", str(batch8), "--batch-size", "2"],  # 8 = 2 x 2 x 2
        ],
        timeout_s=120,
    )
    assert [[code for code, _, _ in rank] for rank in results] == [[2, 2, 0]] * 2
    (_, _, foreign0), (_, out0, split0), (_, resumed0, _) = results[0]
    assert foreign0.startswith(f"train_gpt.py: error: --resume: {foreign / 'ckpt-000003'}")
    assert foreign0.count("\n") == 1, foreign0
    assert split0.startswith(
        "train_gpt.py: error: --resume: the checkpoint's global batch 8 does not split "
        "over 2 data-parallel rank(s)"
    )
    assert split0.count("\n") == 1, split0
    assert "parameters |" not in out0 and "global batch 6" not in out0, out0
    assert "| global batch 8 = 2 x 2 micro-batch(es) x 2 data-parallel rank(s), 32 " in resumed0
    assert "global batch 4" not in resumed0, resumed0  # this launch's own, 2 x 1 x 2
    assert [(out, err) for _, out, err in results[1][:2]] == [("", "")] * 2  # rank 1: silent
