"""Gradient compression (shardkit.distributed.compression): bytes, exactness, training.

Everything distributed runs in one ``pool.run`` on 2 ranks (:func:`run_all`):

- bytes counted with ``benchmarks.comm`` for every compressor and collective kind,
  against the formulas of the module's [Note: bytes sent];
- identity: bitwise the values of the path without a compressor (ShardedDataParallel,
  OSS's reduce-to-owner hook, torch DDP's built-in all-reduce);
- a rank-1 sum recovered exactly by rank-1 PowerSGD; error feedback's telescoping sum;
- a small regression MLP (teacher-student, SGD, 60 steps, fixed seed) trained with
  each lossy compressor: the held-out loss within a stated tolerance of the
  uncompressed run, and rank-1 PowerSGD without error feedback measurably worse.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks import comm
from shardkit.distributed.compression import (
    BF16Compressor,
    GradCompressor,
    IdentityCompressor,
    Int8Compressor,
    OnlyOnGroups,
    PowerSGDCompressor,
    get_compressor,
    powersgd_elements,
    register_ddp_comm_hook,
)
from shardkit.nn import ShardedDataParallel
from shardkit.optim import OSS, register_reduce_to_owner_hook
from shardkit.testing import RankPool

WORLD = 2
SHAPES = [(64, 32), (32,), (16, 48)]  # 2848 elements: two matrices and a vector
STEPS = 60
LR = 0.2

# --- rank side -----------------------------------------------------------------------


def _count(fn: Callable[[], Any]) -> dict[str, Any]:
    comm.counter.reset()
    with comm.counter.counting():
        fn()
    return comm.counter.snapshot()


def _unit_checks() -> dict[str, Any]:
    """Counted bytes of each compressor's collectives, exactness checks."""
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    numel = sum(math.prod(s) for s in SHAPES)
    g = torch.randn(numel)
    out: dict[str, Any] = {"numel": numel}
    compressors: dict[str, GradCompressor] = {
        "identity": IdentityCompressor(),
        "bf16": BF16Compressor(),
        "powersgd": PowerSGDCompressor(rank=2),
        "int8": Int8Compressor(block_size=256),
    }
    for name, c in compressors.items():
        out[f"{name}/all_reduce"] = _count(
            lambda c=c: c.all_reduce(g.clone(), key="k", shapes=SHAPES)
        )
        flat = torch.randn(4096)  # N * 2048: chunks are whole blocks
        out[f"{name}/all_reduce_4096"] = _count(lambda c=c, flat=flat: c.all_reduce(flat, key="f"))
        output = torch.empty(2048)
        out[f"{name}/reduce_scatter"] = _count(
            lambda c=c, flat=flat, output=output: c.reduce_scatter(output, flat.clone(), key="rs")
        )
        out[f"{name}/reduce"] = _count(lambda c=c: c.reduce(g.clone(), 0, key="r", shapes=SHAPES))

    # identity is torch's collectives, bitwise
    exact = g.clone()
    dist.all_reduce(exact)
    out["identity_all_reduce_equal"] = torch.equal(
        IdentityCompressor().all_reduce(g.clone()), exact
    )
    rs_in = torch.randn(4096)
    rs_ref = torch.empty(2048)
    dist.reduce_scatter_single(rs_ref, rs_in.clone())
    rs_out = IdentityCompressor().reduce_scatter(torch.empty(2048), rs_in.clone())
    out["identity_reduce_scatter_equal"] = torch.equal(rs_out, rs_ref)
    red_ref = g.clone()
    dist.reduce(red_ref, dst=1)
    red = IdentityCompressor().reduce(g.clone(), 1)
    out["identity_reduce_equal"] = bool(torch.equal(red, red_ref)) if rank == 1 else True

    # lossy results are the same on every rank, and close to the sum
    for name in ("bf16", "int8", "powersgd"):
        c = get_compressor(name)
        assert c is not None
        got = c.all_reduce(g.clone(), key="close", shapes=SHAPES)
        out[f"{name}/result"] = got
        out[f"{name}/rel_error"] = float((got - exact).norm() / exact.norm())
    int8_rs = Int8Compressor().reduce_scatter(torch.empty(2048), rs_in.clone(), key="x")
    out["int8/rs_max_error"] = float((int8_rs - rs_ref).abs().max())

    # rank-1 PowerSGD recovers a sum of rank-1 matrices u v_w^T exactly
    gen = torch.Generator().manual_seed(7)  # the same u on every rank
    u = torch.randn(40, 1, generator=gen)
    v = torch.randn(1, 24)
    m = (u @ v).reshape(-1)
    m_sum = m.clone()
    dist.all_reduce(m_sum)
    got = PowerSGDCompressor(rank=1).all_reduce(m.clone(), key="r1", shapes=[(40, 24)])
    out["powersgd_rank1_error"] = float((got - m_sum).abs().max() / m_sum.abs().max())

    # error feedback: sum of the outputs + the ranks' residuals = sum of the inputs
    c = PowerSGDCompressor(rank=1)
    total_out, total_in = torch.zeros(numel), torch.zeros(numel)
    for step in range(5):
        gs = torch.randn(numel, generator=torch.Generator().manual_seed(10 * step + rank))
        summed = gs.clone()
        dist.all_reduce(summed)
        total_in += summed
        total_out += c.all_reduce(gs, key="ef", shapes=SHAPES)
    residual = c._errors["ef"].clone()
    dist.all_reduce(residual)
    out["ef_telescoping_error"] = float((total_out + residual - total_in).abs().max())
    out["powersgd_state_bytes"] = c.state_bytes()

    # OnlyOnGroups: compress over the chosen group, exact over the others
    solo = [dist.new_group([r]) for r in range(WORLD)]
    world_pair = dist.new_group(list(range(WORLD)))
    routed = OnlyOnGroups(BF16Compressor(), [world_pair], otherwise=IdentityCompressor())
    out["routed/world"] = _count(lambda: routed.all_reduce(g.clone(), None))
    out["routed/solo_pick"] = type(routed.pick(solo[rank])).__name__
    routed_solo = OnlyOnGroups(BF16Compressor(), [solo[0], solo[1]])
    out["routed_solo/world"] = _count(lambda: routed_solo.all_reduce(g.clone(), None))

    # errors that need a process group
    try:
        PowerSGDCompressor().all_reduce(g.clone(), shapes=SHAPES)
        out["no_key_error"] = ""
    except ValueError as error:
        out["no_key_error"] = str(error)
    return out


class Teacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * step + rank))


def _train(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train a student MLP on a teacher's outputs through ``cfg["path"]``; the
    held-out loss, the final parameters and the bytes counted at one step."""
    torch.manual_seed(0)
    teacher, model = Teacher(), Teacher()
    rank = dist.get_rank()
    compressor = get_compressor(cfg.get("compression"), **cfg.get("kwargs", {}))
    path = cfg["path"]
    opt: torch.optim.Optimizer
    if path == "sdp":
        opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=LR)
        front: nn.Module = ShardedDataParallel(model, opt, grad_compression=compressor)
    elif path == "oss":
        front = DDP(model)
        opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=LR)
        register_reduce_to_owner_hook(front, opt, grad_compression=compressor)  # type: ignore[arg-type]
    else:
        front = DDP(model)
        if compressor is not None:
            register_ddp_comm_hook(front, compressor)  # type: ignore[arg-type]
        else:
            comm.count_ddp(front)  # DDP's own all-reduce, counted (same values)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    counted: dict[str, Any] = {}
    for step in range(STEPS):
        x = _batch(step, rank)
        with torch.no_grad():
            y = teacher(x)
        loss = (front(x) - y).pow(2).mean()
        if step == 2:  # after DDP rebuilt its buckets
            counted = _count(loss.backward)
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
    x_eval = torch.randn(256, 32, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        eval_loss = float((model(x_eval) - teacher(x_eval)).pow(2).mean())
    result: dict[str, Any] = {
        "eval_loss": eval_loss,
        "params": [p.detach().clone() for p in model.parameters()],
        "counted": counted,
        "shapes": [tuple(p.shape) for p in model.parameters()],
    }
    if path == "sdp":
        reducer = front._reducer  # type: ignore[union-attr]
        result["buckets"] = [([tuple(p.shape) for p in b.params]) for b in reducer.buckets]
    return result


def run_all(configs: list[dict[str, Any]]) -> dict[str, Any]:
    comm.install()
    torch.set_num_threads(1)
    results: dict[str, Any] = {"unit": _unit_checks()}
    for cfg in configs:
        results[cfg["name"]] = _train(cfg)
    return results


TRAIN = [
    {"name": "sdp-none", "path": "sdp"},
    {"name": "sdp-identity", "path": "sdp", "compression": "identity"},
    {"name": "sdp-bf16", "path": "sdp", "compression": "bf16"},
    {"name": "sdp-powersgd", "path": "sdp", "compression": "powersgd", "kwargs": {"rank": 1}},
    {
        "name": "sdp-powersgd-noef",
        "path": "sdp",
        "compression": "powersgd",
        "kwargs": {"rank": 1, "error_feedback": False},
    },
    {"name": "sdp-int8", "path": "sdp", "compression": "int8", "kwargs": {"block_size": 64}},
    {"name": "oss-none", "path": "oss"},
    {"name": "oss-identity", "path": "oss", "compression": "identity"},
    {"name": "oss-bf16", "path": "oss", "compression": "bf16"},
    {"name": "ddp-none", "path": "ddp"},
    {"name": "ddp-identity", "path": "ddp", "compression": "identity"},
    {"name": "ddp-bf16", "path": "ddp", "compression": "bf16"},
    {"name": "ddp-powersgd", "path": "ddp", "compression": "powersgd", "kwargs": {"rank": 1}},
    {
        "name": "ddp-powersgd-noef",
        "path": "ddp",
        "compression": "powersgd",
        "kwargs": {"rank": 1, "error_feedback": False},
    },
]


@pytest.fixture(scope="module")
def results(rank_pool: Callable[[int], RankPool]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = rank_pool(WORLD).run(run_all, TRAIN)
    return out


# --- bytes ---------------------------------------------------------------------------


def _payload(snapshot: dict[str, Any], kind: str) -> int:
    return int(snapshot["payload_bytes"].get(kind, 0))


def test_bytes_of_each_compressor(results: list[dict[str, Any]]) -> None:
    unit = results[0]["unit"]
    n = unit["numel"]
    assert n == 2848
    assert unit["identity/all_reduce"]["payload_bytes"] == {"all_reduce": 4 * n}
    # bf16: exactly half of fp32's bytes, for every kind
    assert unit["bf16/all_reduce"]["payload_bytes"] == {"all_reduce": 2 * n}
    assert _payload(unit["bf16/reduce"], "reduce") * 2 == _payload(
        unit["identity/reduce"], "reduce"
    )
    assert _payload(unit["bf16/reduce_scatter"], "reduce_scatter") == 2 * 4096
    assert _payload(unit["identity/reduce_scatter"], "reduce_scatter") == 4 * 4096
    # PowerSGD rank 2: r(m + n) per matrix, the vector as it is, in two all-reduces
    elements = 32 + 2 * (64 + 32) + 2 * (16 + 48)
    assert powersgd_elements(SHAPES, 2) == elements == 352
    assert unit["powersgd/all_reduce"]["payload_bytes"] == {"all_reduce": 4 * elements}
    assert unit["powersgd/all_reduce"]["calls"] == {"all_reduce": 2}
    assert unit["powersgd/reduce"]["payload_bytes"] == {"all_reduce": 4 * elements}
    # int8, 4096 elements over 2 ranks: chunks of 2048 = 8 blocks of 256, 8 fp32 scales
    row = 2048 + 4 * 8
    assert unit["int8/all_reduce_4096"]["payload_bytes"] == {
        "all_to_all": WORLD * row,
        "all_gather": WORLD * row,
    }
    exact_volume = unit["identity/all_reduce_4096"]["total_volume_bytes"]
    assert exact_volume == 2 * (WORLD - 1) / WORLD * 4 * 4096
    ratio = unit["int8/all_reduce_4096"]["total_volume_bytes"] / exact_volume
    assert ratio == (1 + 4 / 256) / 4 == 0.25390625
    rs_ratio = (
        unit["int8/reduce_scatter"]["total_volume_bytes"]
        / unit["identity/reduce_scatter"]["total_volume_bytes"]
    )
    assert rs_ratio == 0.25390625
    assert unit["int8/reduce_scatter"]["calls"] == {"all_to_all": 1}
    # 2848 elements: chunks of 1424 padded to 1536 (6 blocks)
    assert _payload(unit["int8/all_reduce"], "all_to_all") == WORLD * (1536 + 4 * 6)


def test_identity_and_routing(results: list[dict[str, Any]]) -> None:
    for r in results:
        unit = r["unit"]
        assert unit["identity_all_reduce_equal"]
        assert unit["identity_reduce_scatter_equal"]
        assert unit["identity_reduce_equal"]
        n = unit["numel"]
        assert unit["routed/world"]["payload_bytes"] == {"all_reduce": 2 * n}  # compressed
        assert unit["routed_solo/world"]["payload_bytes"] == {"all_reduce": 4 * n}  # exact
        assert unit["routed/solo_pick"] == "IdentityCompressor"
        assert "needs a key" in unit["no_key_error"]


def test_lossy_results_agree_and_are_close(results: list[dict[str, Any]]) -> None:
    a, b = results[0]["unit"], results[1]["unit"]
    for name in ("bf16", "int8", "powersgd"):
        assert torch.equal(a[f"{name}/result"], b[f"{name}/result"]), name
    assert a["bf16/rel_error"] < 4e-3  # bf16: 8 bits of mantissa
    assert a["int8/rel_error"] < 2e-2  # 127 levels per block of 256
    assert a["int8/rs_max_error"] < 0.05
    assert 0.3 < a["powersgd/rel_error"] < 1.0  # rank 2 of random matrices: lossy
    assert a["powersgd_rank1_error"] < 1e-5  # a rank-1 sum is recovered
    assert a["ef_telescoping_error"] < 1e-4  # nothing lost, only delayed
    # residual (2848 fp32) + warm-start Qs (32 x 1 and 48 x 1 fp32)
    assert a["powersgd_state_bytes"] == 4 * (2848 + 32 + 48)


# --- wrappers ------------------------------------------------------------------------


def _same_params(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))


@pytest.mark.parametrize("path", ["sdp", "oss", "ddp"])
def test_identity_is_bitwise_the_plain_path(results: list[dict[str, Any]], path: str) -> None:
    for r in results:
        assert _same_params(r[f"{path}-identity"], r[f"{path}-none"])
        # (sdp: the used flags go in a reduce of their own: one more call, same bytes)
        identity, plain = r[f"{path}-identity"]["counted"], r[f"{path}-none"]["counted"]
        assert identity["payload_bytes"] == plain["payload_bytes"]


def test_wrapper_bytes(results: list[dict[str, Any]]) -> None:
    r = results[0]
    buckets = r["sdp-none"]["buckets"]
    numels = [sum(math.prod(s) for s in b) for b in buckets]
    flags = sum(len(b) for b in buckets)
    # ShardedDataParallel: buffer = gradients + one used flag per parameter (fp32)
    assert _payload(r["sdp-none"]["counted"], "reduce") == 4 * (sum(numels) + flags)
    assert _payload(r["sdp-identity"]["counted"], "reduce") == 4 * (sum(numels) + flags)
    assert _payload(r["sdp-bf16"]["counted"], "reduce") == 2 * sum(numels) + 4 * flags
    power = sum(powersgd_elements(b, 1) for b in buckets)
    assert _payload(r["sdp-powersgd"]["counted"], "all_reduce") == 4 * power
    assert _payload(r["sdp-powersgd"]["counted"], "reduce") == 4 * flags
    # 64 x 32 and 16 x 64 matrices, 64 + 16 bias elements
    assert power == (64 + 32) + (16 + 64) + 64 + 16
    # OSS's reduce-to-owner hook and the DDP adapter: bf16 is exactly half
    oss_plain = r["oss-none"]["counted"]["payload_bytes"]
    assert oss_plain["reduce"] == 4 * 3152
    assert r["oss-bf16"]["counted"]["payload_bytes"] == {"reduce": 2 * 3152}
    assert r["ddp-none"]["counted"]["payload_bytes"] == {"all_reduce": 4 * 3152}
    assert r["ddp-bf16"]["counted"]["payload_bytes"] == {"all_reduce": 2 * 3152}
    assert r["ddp-powersgd"]["counted"]["payload_bytes"] == {"all_reduce": 4 * power}


# --- training ------------------------------------------------------------------------


def test_training_with_compression(results: list[dict[str, Any]]) -> None:
    r = results[0]
    loss = {name: res["eval_loss"] for name, res in r.items() if name != "unit"}
    for other in results[1:]:  # every rank ends with the same model
        for name in loss:
            assert other[name]["eval_loss"] == loss[name], name
    base = loss["sdp-none"]
    assert loss["ddp-none"] == pytest.approx(base, rel=1e-5)
    # half precision and int8: within 1 % of the uncompressed run after 60 steps
    for name in ("sdp-bf16", "oss-bf16", "ddp-bf16", "sdp-int8"):
        assert loss[name] == pytest.approx(base, rel=1e-2), name
    # rank-1 PowerSGD with error feedback: within 25 %; without it: at least 2x worse
    for path in ("sdp", "ddp"):
        ef, no_ef = loss[f"{path}-powersgd"], loss[f"{path}-powersgd-noef"]
        assert ef == pytest.approx(base, rel=0.25), (path, ef, base)
        assert no_ef > 2.0 * ef, (path, no_ef, ef)


# --- local checks --------------------------------------------------------------------


def test_local_errors_and_names() -> None:
    with pytest.raises(ValueError, match="unknown gradient compression"):
        get_compressor("zip")
    assert get_compressor(None) is None
    c = BF16Compressor()
    assert get_compressor(c) is c
    with pytest.raises(ValueError, match="rank must be >= 1"):
        PowerSGDCompressor(rank=0)
    with pytest.raises(ValueError, match="block_size"):
        Int8Compressor(block_size=0)
    with pytest.raises(ValueError, match="shapes"):
        IdentityCompressor().all_reduce(torch.zeros(10), shapes=[(3, 3)])
    with pytest.raises(ValueError, match="1-D"):
        IdentityCompressor().all_reduce(torch.zeros(2, 5))
    with pytest.raises(TypeError, match="float"):
        IdentityCompressor().all_reduce(torch.zeros(5, dtype=torch.int64))
    # a matrix is compressed only when r (m + n) < m n; 3-D pieces are m x (d2 d3)
    assert powersgd_elements([(4, 3, 2)], 1) == 4 + 6
    assert powersgd_elements([(2, 2)], 1) == 4  # 1 * (2 + 2) == 4: sent as it is
    assert powersgd_elements([(100,), (8, 8)], 2) == 100 + 2 * 16
