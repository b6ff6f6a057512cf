"""shardkit.memory: measured bytes per category and the ZeRO formulas, by hand."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shardkit import memory
from shardkit.memory import (
    ModelStateBytes,
    heap_trim_point,
    heap_trims,
    model_state_bytes,
    set_heap_trim,
    trim_heap,
    zero_memory_estimate,
)


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)  # 40 fp32 elements
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: one storage
        self.norm = torch.nn.BatchNorm1d(4)  # weight 4, bias 4; buffers 4 + 4 + 1 (int64)


def test_linear_parameters_gradients_and_adam_state() -> None:
    model = torch.nn.Linear(4, 2)  # 10 fp32 elements = 40 bytes
    assert model_state_bytes(model) == ModelStateBytes(40, 0, 0, 0)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    got = model_state_bytes(model, opt)
    # exp_avg + exp_avg_sq per param (80 bytes) + two scalar fp32 'step' tensors (8 bytes)
    assert got == ModelStateBytes(parameters=40, gradients=40, optimizer_state=88, buffers=0)
    assert got.total == 168
    assert got.as_dict()["total"] == 168


def test_tied_weights_and_buffers_counted_once() -> None:
    got = model_state_bytes(Tied())
    assert got.parameters == (40 + 8) * 4
    assert got.buffers == (4 + 4) * 4 + 8


def test_view_charged_for_whole_storage() -> None:
    flat = torch.zeros(100)
    module = torch.nn.Module()
    module.a = torch.nn.Parameter(flat[:10])
    module.b = torch.nn.Parameter(flat[10:30])
    assert model_state_bytes(module).parameters == 400
    half = torch.nn.Linear(4, 4).to(torch.bfloat16)  # 20 elements x 2 bytes
    assert model_state_bytes(half).parameters == 40


def test_meta_and_empty_count_zero() -> None:
    assert model_state_bytes(torch.nn.Linear(4, 4, device="meta")).total == 0
    assert model_state_bytes(torch.nn.Linear(0, 4)).parameters == 16  # bias only


@pytest.mark.parametrize(
    ("stage", "world", "expected"),
    [
        # psi = 1000 parameters, mixed precision Adam: 2 + 2 + 12 bytes
        (0, 4, 16_000),
        (1, 4, 4_000 + 12_000 / 4),
        (2, 4, 2_000 + 14_000 / 4),
        (3, 4, 16_000 / 4),
        (3, 1, 16_000),
    ],
)
def test_zero_formulas_mixed_precision(stage: int, world: int, expected: float) -> None:
    assert zero_memory_estimate(1000, world, stage).total == pytest.approx(expected)


def test_zero_paper_example_7_5b_on_64_gpus() -> None:
    # ZeRO paper, figure 1: psi = 7.5B, N = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB
    gb = 1e9
    totals = [zero_memory_estimate(7.5e9, 64, s).total / gb for s in range(4)]
    assert totals == pytest.approx([120.0, 31.40625, 16.640625, 1.875])


def test_zero_fp32_and_custom_k() -> None:
    est = zero_memory_estimate(100, 2, 2, mixed_precision=False)
    assert (est.parameters, est.gradients, est.optimizer_state) == (400, 200, 400)
    sgd = zero_memory_estimate(100, 4, 1, mixed_precision=False, optimizer_bytes_per_param=4)
    assert sgd.optimizer_state == 100


def test_zero_bad_input() -> None:
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        zero_memory_estimate(10, 2, 4)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        zero_memory_estimate(10, 0, 1)
    with pytest.raises(ValueError, match="num_params must be >= 0"):
        zero_memory_estimate(-1, 2, 1)


def test_buffer_account_counts_now_and_peak() -> None:
    from shardkit.memory import buffer_account, buffer_pools, reset_buffer_peaks

    account = buffer_account("test_memory pool")
    assert buffer_account("test_memory pool") is account  # one account per name
    account.add(100)
    account.add(50)
    account.acquired(100)
    account.acquired(50)
    account.released(100)
    stats = buffer_pools()["test_memory pool"]
    assert (stats.buffers, stats.capacity_bytes, stats.resident, stats.resident_bytes) == (
        2,
        150,
        1,
        50,
    )
    assert (stats.peak_resident, stats.peak_resident_bytes) == (2, 150)
    reset_buffer_peaks()  # the peaks start again from what is resident now
    stats = buffer_pools()["test_memory pool"]
    assert (stats.peak_resident, stats.peak_resident_bytes) == (1, 50)
    account.released(50)
    account.remove(100)
    account.remove(50)
    assert buffer_pools()["test_memory pool"].buffers == 0


_TRIM_SCRIPT = """
import json, torch
from shardkit.memory import heap_trims, trim_heap

def rss_mib():
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("VmRSS")).split()[1]) / 1024

blocks, pins = [], []
for _ in range(1600):  # 100 MiB
    blocks.append(torch.ones(16 * 1024))
    pins.append(torch.ones(16))
before = heap_trims()
del blocks
freed = rss_mib()
ran = trim_heap()
trimmed = rss_mib()
after = heap_trims()
print(json.dumps({
    "ran": ran, "freed": freed, "trimmed": trimmed,
    "counts": [after.points - before.points, after.trimmed - before.trimmed],
    "seconds": after.seconds - before.seconds,
    "pins": all(torch.equal(p, torch.ones(16)) for p in pins),
}))
"""


@pytest.mark.skipif(not heap_trims().available, reason="glibc's malloc_trim only")
def test_trim_heap_gives_free_heap_pages_back() -> None:
    # In a fresh process (the heap of this one depends on the tests before: small pins
    # landing in old holes let free() shrink the heap's top by itself, so the trim had
    # nothing left to give back and this test failed in the full suite): 64 KiB blocks
    # stay in the heap (below glibc's mmap threshold), a small block kept after each
    # pins the heap's top, so free() alone returns nothing to the system.
    done = subprocess.run(
        [sys.executable, "-c", _TRIM_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["ran"] is True
    assert r["freed"] - r["trimmed"] > 60, r  # the free pages left the resident set
    assert r["counts"] == [0, 1] and r["seconds"] > 0  # a trim, not a trim point
    assert r["pins"]  # live blocks untouched


def test_trim_points_follow_the_switch_and_are_no_ops_off_glibc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = heap_trims()
    assert before.mode == "step" and before.enabled  # the default: one step in 8
    assert before.every == memory.STEP_TRIM_EVERY == 8
    set_heap_trim("step")  # restarts the count: the 8th step point trims
    assert heap_trim_point() is False  # a unit's point does not trim in "step" mode
    trimmed = [heap_trim_point("step") for _ in range(17)]
    assert [i + 1 for i, t in enumerate(trimmed) if t] == ([8, 16] if before.available else [])
    with pytest.raises(ValueError, match="mode must be one of"):
        set_heap_trim("always")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="every must be an int >= 1"):
            set_heap_trim("step", every=bad)  # type: ignore[arg-type]
    for off in ("off", False):  # regression (fresh-user test): every=5 with "off" passed
        with pytest.raises(ValueError) as err:
            set_heap_trim(off, every=5)
        assert str(err.value) == (
            f'set_heap_trim: every=5 with mode={off!r} ("off": no trim point trims, so '
            'there is nothing to count); drop every, or use mode "step" or "unit"'
        )
        assert heap_trims().mode == "step" and heap_trims().every == 8  # unchanged
    previous = set_heap_trim(True)
    try:
        assert previous == "step" and heap_trims().mode == "unit" and heap_trims().every == 1
        assert heap_trim_point() is before.available
        set_heap_trim("step", every=1)
        assert heap_trims().every == 1 and heap_trim_point("step") is before.available
        monkeypatch.setattr(memory, "_MALLOC_TRIM", None)  # as on macOS, Windows or musl
        assert heap_trim_point("step") is False and trim_heap() is False
    finally:
        set_heap_trim(previous)
    after = heap_trims()
    assert not after.available and after.mode == "step" and after.every == 8
    assert after.points == before.points + 21
    assert after.trimmed == before.trimmed + 4 * int(before.available)  # 8, 16, unit, step
    monkeypatch.setattr(memory.sys, "platform", "darwin")
    assert memory._find_malloc_trim() is None
