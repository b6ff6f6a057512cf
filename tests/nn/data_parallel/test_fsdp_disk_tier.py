"""FSDP's disk tier: parity with the plain model, byte counters, crash safety, refusals.

Tiny GPT (a non-Sequential tree; the LM head tied to the token embedding) wrapped as one
unit, one unit per block (nested under the root) or by size; AdamW and SGD with
momentum, three steps; the FSDP model sees ``1 / N`` of each global batch.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest

from shardkit.testing import assert_state_dicts_close
from tests.nn.data_parallel import fsdp_disk_workers as w

GRID = {
    1: [
        {"nesting": "flat", "optim": "adamw"},
        {"nesting": "block", "optim": "sgd", "prefetch": False},
    ],
    2: [
        {"nesting": "block", "optim": "adamw"},
        {"nesting": "size", "optim": "sgd"},
        {"nesting": "block", "optim": "adamw", "raf": False},
        {"nesting": "size", "optim": "adamw", "generations": "unit", "write_behind": 0},
    ],
}


@pytest.mark.parametrize("world_size", [1, 2])
def test_parity_and_byte_counters(rank_pool: Any, world_size: int, tmp_path: Path) -> None:
    configs = GRID[world_size]
    per_rank = rank_pool(world_size).run(w.disk_parity_grid, configs, str(tmp_path))
    for cfg, result in zip(configs, per_rank[0]):
        for step, (got, want) in enumerate(zip(result["losses"], result["ref_losses"])):
            assert abs(got - want) < 1e-5, f"{cfg}: step {step} loss {got} != {want}"
        assert_state_dicts_close(result["state"], result["ref_state"], atol=2e-5, rtol=1e-4)
    for rank_results in per_rank:
        for cfg, result in zip(configs, rank_results):
            # per step: every shard read for forward and for backward + step, optimizer
            # state read from step 2 on; shard and state written once
            assert result["stats"] == result["expected"], cfg
            assert result["resident_after_step"] == [0, 0, 0], cfg  # nothing left in memory
            # one generation on disk between steps: shard + state per unit, the manifest
            units = result["units"]
            assert len(result["files"]) == 2 * units + 1, result["files"]
            assert all(f.endswith(".g3") for f in result["files"] if f != "manifest.json")
            if cfg.get("generations") == "unit":
                # one generation, plus the new files of the unit written and not yet
                # committed and of the one being written (write-behind off), plus the
                # previous files of the unit whose commit is in flight (deleted by it)
                # and the temporary file of a write in flight
                assert units >= 5 and result["most_files"] <= 2 * units + 7, (
                    result["most_files"],
                    units,
                )
            else:  # two whole generations before the step's commit
                assert result["most_files"] == 4 * units, (result["most_files"], units)


def test_crash_mid_step_leaves_previous_generation(rank_pool: Any, tmp_path: Path) -> None:
    for result in rank_pool(2).run(w.crash_and_resume, str(tmp_path)):
        assert result["error"] == "disk full (simulated)"
        assert not [f for f in result["files_after_crash"] if f.endswith(".tmp")]
        assert result["generation"] == 2
        assert not [f for f in result["files_after_open"] if ".g3" in f]  # half a step, gone
        assert result["losses"] == result["straight"]  # step 3 redone: the same loss
        assert_state_dicts_close(result["state"], result["straight_state"], atol=0, rtol=0)


def test_unit_generations_crash_leaves_whole_files_and_is_refused(
    rank_pool: Any, tmp_path: Path
) -> None:
    """generations='unit': a crash between two unit commits of step 2 leaves every file
    the manifest names whole, the two committed units at step 2 (byte-equal to the
    uninterrupted run's), the step marked unfinished, and resume refused by name."""
    out = rank_pool(1).run(w.crash_between_unit_commits, str(tmp_path))[0]
    assert out["crashed_in_step"]
    ahead = [entries[0] for entries in out["unit_commits"]]
    assert len(ahead) == 2 and out["unfinished"] == {"generation": 2, "units": sorted(ahead)}
    assert out["generation"] == 1 and not out["missing"] and out["sizes_ok"]
    assert len(out["ahead_equal_straight"]) == 4 and all(out["ahead_equal_straight"])
    assert sum(f.endswith(".g1") for f in out["named"]) == len(out["named"]) - 4
    assert "ValueError" in out["resume"], out["resume"]
    assert "left in the middle of step 2 with generations='unit'" in out["resume"]
    assert all(entry in out["resume"] for entry in ahead), out["resume"]


def test_killed_process_resumes_from_previous_generation(rank_pool: Any, tmp_path: Path) -> None:
    killed, init_file = tmp_path / "killed", tmp_path / "init"
    process = multiprocessing.get_context("spawn").Process(
        target=w.killed_mid_step, args=(str(killed), str(init_file))
    )
    process.start()
    process.join(120)
    assert process.exitcode == 17
    left = os.listdir(killed / "rank0")
    assert any(".g3" in f for f in left)  # half-written files left
    assert [f for f in left if f.startswith(".unit") and f.endswith(".tmp")], left
    resumed = rank_pool(1).run(w.resume_after_kill, str(killed))[0]
    # regression: the killed write's temporary file stayed after the resumed run
    assert not [f for f in resumed["files"] if f.endswith(".tmp")], resumed["files"]
    straight = rank_pool(1).run(w.straight_run, str(tmp_path / "straight"), 3)[0]
    assert resumed["generation"] == 2
    assert resumed["loss"] == straight["losses"][2]
    assert_state_dicts_close(resumed["state"], straight["state"], atol=0, rtol=0)


def test_refusals(rank_pool: Any, tmp_path: Path) -> None:
    for out in rank_pool(2).run(w.misuse, str(tmp_path)):
        assert "RuntimeError" in out["no_optimizer"] and "disk.optimizer(" in out["no_optimizer"]
        assert (
            "is on a disk tier but the FSDP unit wrapping GPT is in memory"
            in (out["root_in_memory"])
        )
        assert "without a backward since the last one" in out["step_without_backward"]
        assert "without a backward since the last one" in out["double_step"]
        assert out["changed"] == "True"
        assert "not written to the disk tier" in out["load_state_dict"]
        assert "a second backward before optimizer.step()" in out["second_backward"]
        for what in (
            "local_state_dict",
            "load_local_state_dict",
            "save_fsdp_sharded",
            "load_fsdp_sharded",
            "gather_optim",
            "shard_optim",
            "clip",
        ):
            assert out[what].startswith("RuntimeError: ") and (
                "not available with disk_offload" in out[what]
            ), (what, out[what])
        assert "no global gradient norm" in out["clip"]
        assert "ValueError" in out["hybrid"] and "HYBRID_SHARD" in out["hybrid"]
        assert (
            "does not match the disk_offload directory: stored numels"
            in (out["resume_other_model"])
        )
        assert "has no manifest.json" in out["resume_fresh"]
        assert "already holds a model; pass resume=True" in out["fresh_over_used"]
        # regression: None gave "'<' not supported", 1.5 and True were taken as bytes
        want = "must be an int >= 0 (bytes; 0 turns it off), got"
        for key in ("read_ahead_bytes=-1", "read_ahead_bytes=None", "read_ahead_bytes=1.5"):
            name, value = key.split("=")
            assert out[key] == f"ValueError: {name} {want} {value}", out[key]
        assert out["read_ahead_bytes=True"] == f"ValueError: read_ahead_bytes {want} True"
        assert out["write_behind_bytes=None"] == f"ValueError: write_behind_bytes {want} None"


def test_hyperparameters_edited_after_building_reach_the_steps(
    rank_pool: Any, tmp_path: Path
) -> None:
    """Regression: a hyperparameter not passed to disk.optimizer() (momentum) set in
    param_groups[0], and a scheduler's lr, were silently ignored by the units' steps."""
    for out in rank_pool(2).run(w.edited_hyperparameters, str(tmp_path)):
        assert max(out["diffs"]) < 1e-5, out["diffs"]
        assert out["hyper"]["momentum"] == 0.9 and out["hyper"]["lr"] == 0.1 * 0.5**3


def test_training_goes_on_after_a_refused_second_backward(rank_pool: Any, tmp_path: Path) -> None:
    """Regression: the refusal fired inside the first unit's gradient reduction, leaving
    units mid-backward, so the next (legal) backward stepped nothing and the following
    optimizer.step() raised 'without a backward'."""
    for out in rank_pool(2).run(w.recover_after_second_backward, str(tmp_path)):
        assert "a second backward before optimizer.step()" in out["refused"]
        assert out["diff"] < 1e-5, out["diff"]


def test_resume_after_a_backward_that_raised(rank_pool: Any, tmp_path: Path) -> None:
    """Regression: autograd dropped the finalize of a backward that raised after some
    units stepped; the units stayed mid-backward and every call was refused as "during
    the forward or backward". Now a clear refusal says to resume, which gives the last
    whole step."""
    for out in rank_pool(2).run(w.resume_after_raising_backward, str(tmp_path)):
        assert out["raised"].startswith("FloatingPointError"), out["raised"]
        assert "DiskOffload(directory, resume=True)" in out["refused"], out["refused"]
        assert out["diff"] < 1e-5, out["diff"]


def test_shards_are_read_and_written_in_place(rank_pool: Any, tmp_path: Path) -> None:
    """Regression: each unit's local shard lives in a page-aligned buffer whose memory
    is given back between uses, so direct I/O moves it in place. Before, the shard's
    storage was resized to 0 and back (heap memory, not aligned) and every byte of every
    shard read and write went through a bounce buffer: here 3 x 258 KiB per step."""
    out = rank_pool(1).run(w.in_place_io, str(tmp_path))[0]
    assert out["aligned"] and out["resident_between_steps"] == [0, 0, 0]
    assert out["shard_bytes"] == 4 * (128 * 256 + 256 + 256 * 128 + 128)
    # only the last partial page of each of the 3 files read and 2 written per step
    # bounces, and at step 1 the fresh AdamW state (2 moments of the shard's size),
    # packed with a copy; from step 2 on it is written from its read buffer
    shard, tails = out["shard_bytes"], 5 * 4096
    assert 2 * shard <= out["bounced"][0] < 2 * shard + tails, out["bounced"]
    assert all(b < tails for b in out["bounced"][1:]), out["bounced"]


ACCUMULATED = [
    {"nesting": "block", "optim": "adamw"},
    {"nesting": "block", "optim": "adamw", "raf": False, "generations": "unit"},
    {"nesting": "flat", "optim": "sgd"},
]


def test_no_sync_accumulation_matches_the_plain_model(rank_pool: Any, tmp_path: Path) -> None:
    """Micro-batches accumulated inside no_sync, then one synchronised backward that
    steps: the plain model accumulating both, after every step. Regression: each unit's
    optimizer state was read ahead in the no_sync backward too, and held until the
    synchronised one (the whole model's optimizer state in memory)."""
    per_rank = rank_pool(2).run(w.accumulated_parity, ACCUMULATED, str(tmp_path))
    for rank_results in per_rank:
        for cfg, out in zip(ACCUMULATED, rank_results):
            assert max(out["diffs"]) < 2e-5, (cfg, out["diffs"])
            assert out["held_after_no_sync"] == [0, 0, 0], (cfg, out)
            assert out["held_after_step"] == [0, 0, 0], (cfg, out)


def test_kept_units_are_prefetched_for_their_step(rank_pool: Any, tmp_path: Path) -> None:
    """Regression: the last block and the root keep their full parameters from forward
    to backward, so nothing prefetched them, and their steps read the shard and the
    optimizer state on the training thread (0.36 s of an 8.6 s step at 8 x 2048). Now
    only the root's shard, first in the forward, is read there."""
    for per_step in rank_pool(2).run(w.reads_on_training_thread, str(tmp_path)):
        assert per_step[1:] == [["unit2.params"], ["unit2.params"]], per_step


def test_forward_reads_the_first_steps_states_within_the_budget(
    rank_pool: Any, tmp_path: Path
) -> None:
    """A forward followed by a stepping backward reads the optimizer state of the units
    that step first (the last block first), within read_ahead_bytes; a no_grad or
    no_sync forward reads none; the step uses the states read ahead (parity)."""
    for out in rank_pool(2).run(w.states_read_in_forward, str(tmp_path)):
        assert out["order"][0] == "unit1" and out["order"][-1] == "unit2", out["order"]
        first = out["sizes"][0]
        assert first > 0
        assert (out["no_grad"], out["no_sync"], out["budget_0"]) == (0, 0, 0), out
        assert out["budget_first"] == first, out
        assert first < out["budget_all"] <= sum(out["sizes"]), out
        assert out["diff"] < 2e-5 and out["after_step"] == 0, out


def test_zero_grad_drops_gradients_accumulated_in_no_sync(rank_pool: Any, tmp_path: Path) -> None:
    """Regression (found by test_fsdp_disk_state_machine.py): ``optimizer.zero_grad()``
    after a micro-batch inside no_sync did nothing (DiskOptimizer.zero_grad was a no-op),
    so the next backward stepped with the dropped micro-batch's gradient too."""
    for out in rank_pool(2).run(w.zero_grad_after_no_sync, str(tmp_path)):
        assert out["dropped"] < 2e-5 and out["kept"] < 2e-5, out


def test_a_frozen_unit_holds_no_optimizer_state(rank_pool: Any, tmp_path: Path) -> None:
    """Regression (found by test_fsdp_disk_state_machine.py): a unit with no trainable
    parameter (the last block, trained, then frozen) had its optimizer state read ahead
    for a step it never takes, and held it from one step to the next."""
    for out in rank_pool(2).run(w.frozen_block, str(tmp_path)):
        assert out["held"] == [0, 0, 0, 0], out
        assert max(out["diffs"]) < 2e-5, out
