"""Issue 20: FSDP's full parameters and gradients live in reused unit buffers.

- :class:`UnitBuffer` on CPU: release gives the pages back at once (the resident set
  drops), the tensor, its storage and its views stay valid and read zeros;
- the pools' bound, from :func:`shardkit.memory.buffer_pools`, on a 6-block GPT with
  prefetch: at most 3 parameter buffers (root + running + prefetched) and, with one
  reduction in flight, 3 gradient buffers (root + in flight + filling);
- a regression test for the trap of reusing buffers: autograd saves views of the full
  parameters (``weight.t()``), so gradients must match the plain model over several
  steps with a forward without backward and two live graphs in between;
- the heap trim points: one per unit reshard on CPU, trimming only when switched on.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardkit.memory import buffer_pools
from shardkit.nn.data_parallel.fully_sharded.unit_buffers import GRADIENTS, PARAMETERS, UnitBuffer
from tests.nn.data_parallel import fsdp_buffer_workers as w

MIB = 2**20


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def test_release_gives_pages_back_and_keeps_the_tensor() -> None:
    buf = UnitBuffer(8 * MIB, torch.float32, torch.device("cpu"), "test pool")  # 32 MiB
    view, ptr = buf.tensor[5:10].view(5, 1), buf.tensor.data_ptr()
    assert ptr % (2 * MIB) == 0  # huge-page aligned
    buf.acquire()
    before = _rss_mib()
    buf.tensor.fill_(3.0)
    filled = _rss_mib()
    buf.release()
    released = _rss_mib()
    assert filled - before > 28 and filled - released > 28, (before, filled, released)
    assert buf.tensor.data_ptr() == ptr and torch.equal(view, torch.zeros(5, 1))
    buf.acquire()
    buf.tensor[7] = 2.0
    assert view[2, 0].item() == 2.0  # a view made before sees the new contents


def test_accounting_counts_buffers_and_peaks() -> None:
    from shardkit.memory import reset_buffer_peaks

    pool = "test accounting"
    a = UnitBuffer(1000, torch.float32, torch.device("cpu"), pool)
    b = UnitBuffer(10, torch.bfloat16, torch.device("cpu"), pool)
    reset_buffer_peaks()
    a.acquire()
    b.acquire()
    b.acquire()  # already resident: counted once
    a.release()
    stats = buffer_pools()[pool]
    assert (stats.buffers, stats.capacity_bytes) == (2, 4020)
    assert (stats.resident, stats.resident_bytes) == (1, 20)
    assert (stats.peak_resident, stats.peak_resident_bytes) == (2, 4020)
    del a, b
    assert buffer_pools()[pool].buffers == 0 and buffer_pools()[pool].resident == 0


def test_empty_buffer_and_bad_size() -> None:
    empty = UnitBuffer(0, torch.float32, torch.device("cpu"), "test empty")
    empty.acquire()
    assert empty.tensor.shape == (0,)
    with pytest.raises(ValueError, match="numel >= 0; got -1"):
        UnitBuffer(-1, torch.float32, torch.device("cpu"), "test empty")


def test_pool_bound_on_six_block_gpt(rank_pool: Any) -> None:
    for r in rank_pool(2).run(w.pool_bound):
        params, grads, sizes = r["params"], r["grads"], r["unit_bytes"]
        root, blocks = sizes[0], sorted(sizes[1:])
        # Earlier tests' models may still be alive in this (shared) rank process, a few
        # of their buffers resident (a forward without backward): count this model's.
        zero = {"buffers": 0, "resident": 0, "resident_bytes": 0}
        p0, g0 = (
            vars(r["before"][k]) if k in r["before"] else zero for k in (PARAMETERS, GRADIENTS)
        )
        assert params.buffers - p0["buffers"] == 7 and grads.buffers - g0["buffers"] == 7
        # root + running block + prefetched block
        assert params.peak_resident - p0["resident"] == 3
        assert params.peak_resident_bytes - p0["resident_bytes"] == root + 2 * blocks[-1]
        assert 2 <= grads.peak_resident - g0["resident"] <= 3  # root + in flight + filling
        assert grads.peak_resident_bytes - g0["resident_bytes"] <= root + 2 * blocks[-1]
        # all given back after a step
        assert params.resident == p0["resident"] and grads.resident == g0["resident"]


def test_heap_trim_points_per_step_and_after_every_reshard(rank_pool: Any) -> None:
    for r in rank_pool(2).run(w.trim_points):
        (off, off_trimmed), (unit, unit_trimmed), (step, step_trimmed) = r["counts"]
        # a point per step (the root's forward) + per reshard: 6 blocks, forward and backward
        assert off == unit == step == 13 and off_trimmed == 0
        assert unit_trimmed == (12 if r["available"] else 0)
        assert step_trimmed == (1 if r["available"] else 0)  # the default mode, every=1
        assert r["eval_trims"] == 0  # a forward without backward is not a training step
        assert r["same_grads"]  # trimming gives back free pages only


@pytest.mark.parametrize("world", [1, 2])
def test_saved_views_stay_correct(rank_pool: Any, world: int) -> None:
    cfgs = [{"reshard_after_forward": True}, {"reshard_after_forward": False}]
    for r in rank_pool(world).run(w.saved_views_grid, cfgs):
        for cfg, result in zip(cfgs, r):
            assert max(result["diffs"]) < 2e-6, (world, cfg, result["diffs"])
            assert result["resident"] == 0
