"""The multi-rank harness: results, errors naming the rank, hangs timing out, no zombies."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from shardkit.testing import RankError, RankPool, RankTimeoutError, run_distributed
from shardkit.testing._rank import _bind_device


def _sum_of_ranks(offset: float) -> tuple[int, int, float, int]:
    t = torch.tensor([float(dist.get_rank()) + offset])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), float(t), torch.get_num_threads()


def _raise_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from {bad_rank}")
    return dist.get_rank()


def _raise_then_others_wait(bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        raise KeyError("rank failed before the collective")
    dist.all_reduce(torch.ones(1))  # the peer never joins: would hang without the harness


def _skip_collective_on_rank1() -> None:
    if dist.get_rank() != 1:
        dist.all_reduce(torch.ones(1))


def _exit_hard() -> None:
    if dist.get_rank() == 1:
        os._exit(7)
    dist.all_reduce(torch.ones(1))


def _random_draw() -> float:
    return float(torch.rand(1))


def _pid() -> int:
    return os.getpid()


def _env_and_cwd(name: str) -> tuple[str | None, str, str]:
    return os.environ.get(name), os.getcwd(), os.environ["RANK"]


def test_results_in_rank_order_and_one_thread(rank_pool) -> None:
    results = rank_pool(3).run(_sum_of_ranks, 0.5)
    # ranks 0 + 1 + 2 plus 3 * 0.5
    assert results == [(r, 3, 4.5, 1) for r in range(3)]


def test_raising_rank_is_named_with_its_traceback(rank_pool) -> None:
    pool = rank_pool(2)
    with pytest.raises(RankError) as info:
        pool.run(_raise_on_rank, 1)
    assert info.value.rank == 1
    assert "ValueError: boom from 1" in info.value.remote_traceback
    assert "rank 1 failed in _raise_on_rank" in str(info.value)
    # every rank reported, so the same group keeps working
    assert info.value.all_reported
    assert pool.run(_sum_of_ranks, 0.0)[0][2] == 1.0


def test_failure_while_peer_waits_fails_fast_and_pool_recovers(rank_pool) -> None:
    pool = rank_pool(2)
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        pool.run(_raise_then_others_wait, 0, timeout_s=60.0)
    assert info.value.rank == 0
    assert "KeyError" in info.value.remote_traceback
    assert time.monotonic() - start < 30.0  # grace period, not the 60 s timeout
    assert pool.run(_sum_of_ranks, 1.0)[1][2] == 3.0  # restarted transparently


def _hang_on_rank0() -> None:
    if dist.get_rank() == 0:
        time.sleep(3600)


def test_hang_times_out_and_kills_ranks() -> None:
    pool = RankPool(2, timeout_s=3.0, grace_s=1.0, straggler_s=1.0)
    try:
        pids = pool.run(_pid)
        with (
            pytest.raises(RankTimeoutError) as info,
            pytest.warns(RuntimeWarning, match=r"ranks \[0\] still running _hang_on_rank0 1 s"),
        ):
            pool.run(_hang_on_rank0)
        assert info.value.ranks == [0]
        assert "did not finish within 3.0 s running _hang_on_rank0" in str(info.value)
        # the hung rank's stacks, taken before it was killed, name the line it hung on
        assert list(info.value.stacks) == [0]
        assert "in _hang_on_rank0" in info.value.stacks[0]
        assert "time.sleep(3600)" not in info.value.stacks[0]  # faulthandler: no source
        assert "--- rank 0 stacks ---" in str(info.value)
        for pid in pids:  # no zombie or orphan left behind
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        pool.close()


def test_deadlocked_collective_fails_within_timeout() -> None:
    # grace 20 s: the harness backstop stays out of the way of gloo's own 3 s timeout
    pool = RankPool(2, timeout_s=3.0, grace_s=20.0)
    try:
        pool.run(_pid)  # start-up is not charged to a task's timeout
        start = time.monotonic()
        with pytest.raises((RankError, RankTimeoutError)) as info:
            pool.run(_skip_collective_on_rank1)
        # gloo's own timeout (set to the pool's) names the waiting rank and the operation
        assert isinstance(info.value, RankError)
        assert info.value.rank == 0
        assert "Timed out" in info.value.remote_traceback
        assert time.monotonic() - start < 3.0 + 20.0
    finally:
        pool.close()


def test_rank_that_dies_without_reporting_is_named() -> None:
    with pytest.raises(RankError) as info:
        run_distributed(_exit_hard, 2, timeout_s=60.0)
    assert info.value.rank == 1
    assert "exited with code 7" in info.value.remote_traceback


def test_ranks_see_the_parents_environment_and_directory_at_start(tmp_path, monkeypatch) -> None:
    # Ranks come from a fork server started earlier in the session, with its own
    # environment and directory: each group still gets the parent's as they are now.
    name = "SHARDKIT_TEST_LAUNCHER_ENV"
    monkeypatch.setenv(name, "first")
    monkeypatch.chdir(tmp_path)
    assert run_distributed(_env_and_cwd, 2, name) == [
        ("first", str(tmp_path), "0"),
        ("first", str(tmp_path), "1"),
    ]
    monkeypatch.setenv(name, "second")
    monkeypatch.delenv("RANK", raising=False)
    assert run_distributed(_env_and_cwd, 1, name) == [("second", str(tmp_path), "0")]
    monkeypatch.delenv(name)
    assert run_distributed(_env_and_cwd, 1, name)[0][0] is None


def _process_state() -> dict[str, object]:
    from torch.distributed.distributed_c10d import _get_default_group

    pg = _get_default_group()._get_backend(torch.device("cpu"))
    return {
        "env": os.environ.get("SHARDKIT_TEST_POISON"),
        "cwd": os.getcwd(),
        "dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "grad": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
        "forward_hooks": len(torch.nn.modules.module._global_forward_hooks),
        "timeout_s": pg.options._timeout.total_seconds(),
    }


def _poison_process_state(directory: str, fail: bool) -> None:
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _set_pg_timeout

    os.environ["SHARDKIT_TEST_POISON"] = "1"
    os.chdir(directory)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True)
    torch.autograd.set_detect_anomaly(True)
    torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    _set_pg_timeout(timedelta(seconds=7))
    if fail:
        raise RuntimeError("a task that fails after changing everything")


def test_a_task_cannot_change_what_the_next_one_sees(rank_pool, tmp_path) -> None:
    pool = rank_pool(2)
    clean = pool.run(_process_state)
    assert clean[0]["timeout_s"] == 120.0 and clean[0]["dtype"] == torch.float32
    for fail in (False, True):
        try:
            pool.run(_poison_process_state, str(tmp_path), fail)
        except RankError as err:
            assert fail and "a task that fails" in err.remote_traceback
        assert pool.run(_process_state) == clean


def test_seed_is_deterministic_and_equal_across_ranks(rank_pool) -> None:
    pool = rank_pool(2)
    a, b = pool.run(_random_draw, seed=3), pool.run(_random_draw, seed=3)
    assert a == b and a[0] == a[1]
    torch.manual_seed(3)
    assert a[0] == float(torch.rand(1))
    assert pool.run(_random_draw, seed=4) != a


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        RankPool(0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        RankPool(2, timeout_s=0)
    pool = RankPool(2)  # a per-call timeout of 0 killed every rank as a false hang
    with pytest.raises(ValueError, match="timeout_s must be > 0 seconds; got 0"):
        pool.run(_random_draw, timeout_s=0)
    assert not pool._procs  # refused before any rank started


def test_gloo_binds_no_device() -> None:
    assert _bind_device("gloo", 1) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_nccl_without_cuda_fails_at_start_up_naming_the_cause() -> None:
    with pytest.raises(RuntimeError, match=r"backend 'nccl' needs CUDA.*gloo"):
        _bind_device("nccl", 0)
    with pytest.raises(RankError, match="process-group start-up") as err:
        run_distributed(_pid, 1, backend="nccl", timeout_s=30)
    assert "needs CUDA" in err.value.remote_traceback


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
def test_nccl_binds_one_device_per_rank() -> None:
    device = _bind_device("nccl", 0)
    assert device == torch.device("cuda", 0) and torch.cuda.current_device() == 0
