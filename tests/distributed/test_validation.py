"""Bad parameters and double wrapping: each wrapper refuses them at construction, by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.validation import check_not_wrapped, check_parameters
from shardkit.nn import FullyShardedDataParallel, OffloadModel, ShardedDataParallel
from shardkit.nn.pipe import Pipe
from shardkit.optim import OSS


def _with_param(dtype: torch.dtype, device: str = "cpu") -> nn.Module:
    model = nn.Sequential(nn.Linear(2, 2))
    grad = dtype.is_floating_point or dtype.is_complex
    extra = nn.Parameter(torch.zeros(3, dtype=dtype, device=device), requires_grad=grad)
    model[0].register_parameter("extra", extra)
    return model


def _error(build: Callable[[], Any]) -> str:
    try:
        build()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "ok"


def _sdp(model: nn.Module) -> Any:
    """ShardedDataParallel over ``model``, its OSS over the parameters OSS accepts."""
    usable = [p for p in model.parameters() if p.dtype.is_floating_point and not p.is_meta]
    return ShardedDataParallel(model, OSS(usable or nn.Linear(1, 1).parameters(), lr=0.1))


def _empty_fsdp_trains() -> list[float]:
    """A root with no parameters, only a buffer: forward and backward run, gradients flow."""
    module = nn.Module()
    module.register_buffer("scale", torch.full((3,), 2.0 + dist.get_rank()))
    module.forward = lambda x: x * module.scale  # type: ignore[method-assign]
    wrapped = FullyShardedDataParallel(module)
    x = torch.ones(2, 3, requires_grad=True)
    wrapped(x).sum().backward()
    assert x.grad is not None
    return [float(x.grad.sum()), float(len(list(wrapped.parameters())))]


def _wrapper_cases() -> dict[str, Any]:
    """Every bad input of the distributed wrappers, on every rank (one pool.run)."""
    oss = OSS(nn.Linear(2, 2).parameters(), lr=0.1)
    sdp = _sdp(nn.Linear(2, 2))
    return {
        # frozen integer / bool parameters: OSS and ShardedDataParallel accept them (as
        # DDP and FairScale do); FSDP, which flattens every parameter, refuses them
        "oss-int": _error(lambda: OSS(_with_param(torch.int64).parameters(), lr=0.1)),
        "sdp-bool": _error(lambda: _sdp(_with_param(torch.bool))),
        "sdp-int": _error(lambda: _sdp(_with_param(torch.int32))),
        "fsdp-int": _error(lambda: FullyShardedDataParallel(_with_param(torch.int32))),
        "oss-complex": _error(lambda: OSS(_with_param(torch.complex64).parameters(), lr=0.1)),
        "sdp-complex": _error(lambda: _sdp(_with_param(torch.complex64))),
        "fsdp-complex": _error(lambda: FullyShardedDataParallel(_with_param(torch.complex64))),
        "oss-meta": _error(lambda: OSS(nn.Linear(2, 2, device="meta").parameters(), lr=0.1)),
        "sdp-meta": _error(lambda: _sdp(nn.Linear(2, 2, device="meta"))),
        "oss-of-oss": _error(lambda: OSS(oss, lr=0.1)),
        "oss-optim-oss": _error(lambda: OSS(nn.Linear(2, 2).parameters(), optim=OSS, lr=0.1)),
        "oss-same-params": _error(lambda: OSS(oss.param_groups[0]["params"], lr=0.1)),
        "sdp-of-sdp": _error(lambda: _sdp(sdp)),
        "sdp-inside": _error(lambda: _sdp(nn.Sequential(nn.Linear(2, 2), sdp))),
        "sdp-empty": _error(lambda: _sdp(nn.ReLU())),
        "fsdp-empty": _empty_fsdp_trains(),
    }


def test_wrappers_refuse_bad_parameters_and_double_wrapping(rank_pool: Any) -> None:
    per_rank = rank_pool(2).run(_wrapper_cases)
    errors = per_rank[0]
    for wrapper in ("oss", "sdp", "fsdp"):
        name = {"oss": "OSS", "sdp": "ShardedDataParallel", "fsdp": "FullyShardedDataParallel"}
        label = name[wrapper]
        # OSS names parameters by group position, the module wrappers by their names
        where = "param_groups[0][2]" if wrapper == "oss" else "0.extra"
        dtype = {"oss": "torch.int64", "sdp": "torch.bool", "fsdp": "torch.int32"}[wrapper]
        bad = errors[f"{wrapper}-{'bool' if wrapper == 'sdp' else 'int'}"]
        if wrapper == "fsdp":
            assert bad.startswith(f"TypeError: {label}: parameter `{where}` (shape (3,))"), bad
            assert f"has the dtype {dtype}" in bad and "need floating-point" in bad
            assert "register_buffer" in bad
        else:
            assert bad == "ok", bad
        cplx = errors[f"{wrapper}-complex"]
        assert cplx.startswith(f"TypeError: {label}: parameter `{where}`"), cplx
        assert "torch.complex64" in cplx and "torch.view_as_real" in cplx
        if wrapper == "fsdp":
            continue  # FSDP materialises meta modules itself (param_init_fn): its own tests
        meta = errors[f"{wrapper}-meta"]
        where = "param_groups[0][0]" if wrapper == "oss" else "weight"
        assert meta.startswith(f"ValueError: {label}: parameter `{where}` (shape (2, 2))"), meta
        assert "meta device" in meta and "module.to_empty(device=...)" in meta
    assert errors["sdp-int"] == "ok"
    assert errors["oss-of-oss"].startswith(
        "TypeError: OSS got an instance of OSS as its parameters"
    )
    assert "OSS(optim=OSS)" in errors["oss-optim-oss"]
    assert errors["oss-same-params"] == "ok"  # two OSS over one parameter list is allowed
    assert errors["sdp-of-sdp"].startswith(
        "ValueError: the module given to ShardedDataParallel is already a ShardedDataParallel"
    )
    assert "contains a ShardedDataParallel at `1`" in errors["sdp-inside"]
    assert errors["sdp-empty"].startswith(
        "ValueError: ShardedDataParallel: the module (ReLU) has no parameters"
    )
    # FSDP over a module without parameters works: x * scale, scale = 2 + rank on each
    # rank (its buffers are broadcast from rank 0 at the first forward)
    assert [r["fsdp-empty"] for r in per_rank] == [[12.0, 0.0], [12.0, 0.0]]


def test_single_process_wrappers_refuse_bad_parameters(tmp_path: Any) -> None:
    int_model = _with_param(torch.int64)
    with pytest.raises(TypeError, match=r"Pipe: parameter `0.extra` .* dtype torch.int64"):
        Pipe(int_model, balance=[1], devices=["cpu"])
    with pytest.raises(TypeError, match=r"OffloadModel: parameter `0.extra` .* torch.complex64"):
        OffloadModel(_with_param(torch.complex64), "cpu", num_slices=1)
    with pytest.raises(TypeError, match=r"OffloadModel: parameter `0.0.extra` .* torch.bool"):
        OffloadModel([_with_param(torch.bool)], "cpu")
    with pytest.raises(ValueError, match=r"Pipe: parameter `0.weight` .* meta device"):
        Pipe(nn.Sequential(nn.Linear(2, 2, device="meta")), balance=[1], devices=["cpu"])
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), balance=[2], devices=["cpu"])
    with pytest.raises(ValueError, match="given to Pipe is already a Pipe"):
        Pipe(pipe, balance=[2], devices=["cpu"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="contains a Pipe at `1`"):
        Pipe(nn.Sequential(nn.Linear(2, 2), pipe), balance=[2], devices=["cpu"])
    offload = OffloadModel(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), "cpu", num_slices=1)
    with pytest.raises(ValueError, match="given to OffloadModel is already an OffloadModel"):
        OffloadModel(offload, "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"contains an OffloadModel at `\[1\]`"):
        OffloadModel([nn.Linear(2, 2), offload], "cpu")
    # the disk tier still accepts a meta model (it materialises slice by slice)
    meta = nn.Sequential(nn.Linear(2, 2, device="meta"), nn.Linear(2, 2, device="meta"))
    disk = OffloadModel(meta, "cpu", offload_dir=tmp_path, num_slices=2)
    assert disk(torch.ones(1, 2)).shape == (1, 2)


def test_frozen_integer_parameters_only_where_allowed() -> None:
    frozen = [("step", nn.Parameter(torch.tensor([3, 3]), requires_grad=False))]
    with pytest.raises(
        TypeError, match=r"X: parameter `step` \(shape \(2,\)\) has the dtype torch.int64"
    ):
        check_parameters("X", frozen)
    check_parameters("X", frozen, allow_frozen_integer=True)
    check_parameters(
        "X",
        [("b", nn.Parameter(torch.ones(2, dtype=torch.bool), False))],
        allow_frozen_integer=True,
    )
    # complex stays refused, frozen or not; meta stays refused for frozen integers
    cplx = nn.Parameter(torch.zeros(2, dtype=torch.complex64), requires_grad=False)
    with pytest.raises(TypeError, match="complex dtype"):
        check_parameters("X", [("c", cplx)], allow_frozen_integer=True)
    meta = nn.Parameter(torch.zeros(2, dtype=torch.int64, device="meta"), requires_grad=False)
    with pytest.raises(ValueError, match="meta device"):
        check_parameters("X", [("m", meta)], allow_frozen_integer=True)
    # an integer parameter cannot require grad in torch, so no trainable one gets through
    with pytest.raises(RuntimeError, match="floating point"):
        nn.Parameter(torch.tensor([3, 3]), requires_grad=True)


def test_check_parameters_accepts_floating_point_and_allowed_meta() -> None:
    check_parameters("X", nn.Linear(2, 2).named_parameters())
    check_parameters("X", nn.Linear(2, 2, dtype=torch.bfloat16).named_parameters())
    check_parameters("X", nn.Linear(2, 2, device="meta").named_parameters(), allow_meta=True)
    check_parameters("X", [("empty", nn.Parameter(torch.zeros(0)))])  # zero-size is fine
    check_not_wrapped("X", [nn.Linear(2, 2), 3], Pipe)  # non-modules in a list are skipped
