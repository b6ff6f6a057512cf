"""ShardedDataParallel + OSS against torch DDP + the plain optimizer, at 2 and 4 ranks.

Each rank builds the same model twice: one copy under ShardedDataParallel + OSS, one
under torch DDP + the plain optimizer, and runs the same loop on both (same local
micro-batches, same zero_grad call). Gradients after backward (owner ranks only hold
them) and parameters after every step must match DDP to fp32 rounding.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.memory import model_state_bytes
from shardkit.nn import ShardedDataParallel, ShardedDDP
from shardkit.optim import OSS
from shardkit.testing import (
    assert_same_across_ranks,
    assert_state_dicts_close,
    assert_tensors_close,
)


class Model(nn.Module):
    """Linear layers of varied sizes; optional BatchNorm, a rank-dependent and a dead branch."""

    def __init__(self, batchnorm: bool = False, branches: bool = False) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 24)
        self.norm = nn.BatchNorm1d(24) if batchnorm else nn.Identity()
        self.mid = nn.Linear(24, 24)
        self.head = nn.Linear(24, 3)
        self.branches = branches
        self.side = nn.Linear(24, 24)  # used on rank 0 only (when branches)
        if branches:
            self.dead = nn.Linear(24, 3)  # never used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.emb(x)))
        if not self.branches or dist.get_rank() == 0:
            h = h + self.side(h)
        return self.head(torch.tanh(self.mid(h)))


def micro_batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def groups(model: Model, two: bool) -> list[dict[str, Any]]:
    if not two:
        return [{"params": list(model.parameters())}]
    first = [*model.emb.parameters(), *model.side.parameters(), *model.norm.parameters()]
    ids = {id(p) for p in first}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": first, "lr": 0.05}, {"params": rest, "weight_decay": 0.1}]


CONFIGS: list[dict[str, Any]] = [
    {"name": "sgd", "optim": torch.optim.SGD, "kw": {"lr": 0.1, "momentum": 0.9}},
    {"name": "adamw-groups", "optim": torch.optim.AdamW, "kw": {"lr": 0.01}, "two": True},
    {"name": "accum2", "optim": torch.optim.SGD, "kw": {"lr": 0.1}, "accum": 2},
    {"name": "accum4-adamw", "optim": torch.optim.AdamW, "kw": {"lr": 0.01}, "accum": 4},
    {"name": "model-zero-grad", "optim": torch.optim.AdamW, "kw": {"lr": 0.01}, "zero": "model"},
    {
        "name": "zero-grad-keep",
        "optim": torch.optim.SGD,
        "kw": {"lr": 0.1, "momentum": 0.9},
        "zero": "zeros",
    },
    {"name": "branches", "optim": torch.optim.AdamW, "kw": {"lr": 0.01}, "branches": True},
    {"name": "frozen", "optim": torch.optim.SGD, "kw": {"lr": 0.1}, "frozen": True},
    {"name": "batchnorm", "optim": torch.optim.SGD, "kw": {"lr": 0.1}, "bn": True, "accum": 2},
    {"name": "two-backwards", "optim": torch.optim.SGD, "kw": {"lr": 0.1}, "backwards": 2},
    {"name": "two-forwards", "optim": torch.optim.AdamW, "kw": {"lr": 0.01}, "forwards": 2},
    {"name": "tiny-buckets", "optim": torch.optim.AdamW, "kw": {"lr": 0.01}, "bucket": 50},
    {"name": "no-buckets", "optim": torch.optim.SGD, "kw": {"lr": 0.1}, "bucket": 0},
    {"name": "eval-switch", "optim": torch.optim.SGD, "kw": {"lr": 0.1}, "bn": True, "eval": True},
    {  # FairScale's test_train_eval_change: the eval forward records a graph, unused
        "name": "eval-switch-grad",
        "optim": torch.optim.SGD,
        "kw": {"lr": 0.1, "momentum": 0.9},
        "eval": "grad",
    },
]


def _zero(cfg: dict[str, Any], module: nn.Module, opt: torch.optim.Optimizer) -> None:
    kind = cfg.get("zero", "optimizer")
    if kind == "model":
        module.zero_grad()
    else:
        opt.zero_grad(set_to_none=kind != "zeros")


def _backward(cfg: dict[str, Any], module: nn.Module, step: int) -> None:
    rank, accum = dist.get_rank(), cfg.get("accum", 1)
    for micro in range(accum):
        sync = micro == accum - 1
        ctx = contextlib.nullcontext() if sync else module.no_sync()  # type: ignore[operator]
        with ctx:
            x, y = micro_batch(step, micro, rank)
            if cfg.get("forwards"):
                out = module(x[:2]).sum() + module(x[2:]).sum()
                loss = out * 0.1 + (module(x) - y).pow(2).mean()
            else:
                loss = (module(x) - y).pow(2).mean()
            # Two backwards of one loss accumulate twice its gradient; torch DDP refuses a
            # second backward through one forward, so its reference is one backward of 2x.
            backwards = cfg.get("backwards", 1)
            if isinstance(module, DDP):
                (loss * backwards).backward()
            else:
                for _ in range(backwards):
                    loss.backward(retain_graph=True)


def _check_grads(model: nn.Module, ref: nn.Module, opt: OSS) -> None:
    owner = opt.param_to_rank
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        mine = owner.get(p) == opt.rank
        if mine and q.grad is not None:
            assert p.grad is not None, f"{name}: owner holds no gradient"
            assert_tensors_close(p.grad, q.grad, atol=1e-6, name=f"grad {name}")
        elif not mine:
            assert p.grad is None, f"{name}: non-owner rank {opt.rank} kept a gradient"


def _run(cfg: dict[str, Any], steps: int = 3) -> str:
    torch.manual_seed(0)
    model = Model(batchnorm=cfg.get("bn", False), branches=cfg.get("branches", False))
    if cfg.get("frozen"):
        model.mid.requires_grad_(False)
    ref = copy.deepcopy(model)
    opt = OSS(groups(model, cfg.get("two", False)), optim=cfg["optim"], **cfg["kw"])
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=cfg.get("bucket", 2**23))
    ref_opt = cfg["optim"](groups(ref, cfg.get("two", False)), **cfg["kw"])
    ddp = DDP(ref, find_unused_parameters=cfg.get("branches", False))
    for step in range(steps):
        for module in (sdp, ddp):
            _backward(cfg, module, step)
        _check_grads(model, ref, opt)
        for module, optimizer in ((sdp, opt), (ddp, ref_opt)):
            optimizer.step()
            _zero(cfg, module, optimizer)
            if cfg.get("eval"):
                module.eval()
                with torch.no_grad() if cfg["eval"] is True else contextlib.nullcontext():
                    module(micro_batch(step, 9, 0)[0])
                module.train()
        assert_state_dicts_close(model, ref, atol=1e-5)
    assert_same_across_ranks(
        model.state_dict() if not cfg.get("bn") else dict(model.named_parameters())
    )
    return cfg["name"]


def _grid(names: list[str] | None = None) -> list[str]:
    done = []
    for cfg in CONFIGS:
        if names is not None and cfg["name"] not in names:
            continue
        try:
            done.append(_run(cfg))
        except AssertionError as err:
            raise AssertionError(f"config {cfg['name']}: {err}") from err
    return done


@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_with_ddp(rank_pool, world_size: int) -> None:
    results = rank_pool(world_size).run(_grid)
    assert results[0] == [c["name"] for c in CONFIGS]


def _global_reference(model: Model, steps: int, unfreeze_at: int) -> Model:
    """The plain optimizer on the global batch (every rank's micro-batch 0)."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        if step == unfreeze_at:
            ref.mid.requires_grad_(True)
        xs, ys = zip(*(micro_batch(step, 0, r) for r in range(dist.get_world_size())))
        (ref(torch.cat(xs)) - torch.cat(ys)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return ref


def _refresh_memory_and_options() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    # auto refresh: a frozen layer becomes trainable at step 2
    torch.manual_seed(0)
    model = Model()
    model.mid.requires_grad_(False)
    ref = _global_reference(model, 4, unfreeze_at=2)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    sdp = ShardedDDP(model, opt, warn_on_trainable_params_changed=False)
    for step in range(4):
        if step == 2:
            model.mid.requires_grad_(True)
        x, y = micro_batch(step, 0, rank)
        (sdp(x) - y).pow(2).mean().backward()
        if step == 3:  # memory: gradients of this rank's shard only
            held = model_state_bytes(sdp).gradients
            owned = sum(p.numel() * 4 for p in opt.local_params())
            total = sum(p.numel() * 4 for p in model.parameters())
            largest = max(p.numel() * 4 for p in model.parameters())
            assert held == owned, (held, owned)
            assert abs(held - total / world) <= largest
            out["grad_bytes"] = held
        opt.step()
        opt.zero_grad()
    assert_state_dicts_close(model, ref, atol=1e-5)
    # manual reduce() after no_sync backwards, two OSS over disjoint parameters
    torch.manual_seed(0)
    model = Model()
    ref_model = copy.deepcopy(model)
    first = [*model.emb.parameters(), *model.side.parameters()]
    rest = [*model.mid.parameters(), *model.head.parameters()]
    opts = [OSS(first, optim=torch.optim.AdamW, lr=0.01), OSS(rest, lr=0.1)]
    sdp = ShardedDataParallel(model, opts)
    ddp = DDP(ref_model)
    ref_opts = [
        torch.optim.AdamW([*ref_model.emb.parameters(), *ref_model.side.parameters()], lr=0.01),
        torch.optim.SGD([*ref_model.mid.parameters(), *ref_model.head.parameters()], lr=0.1),
    ]
    for step in range(2):
        for micro in range(2):
            x, y = micro_batch(step, micro, rank)
            with sdp.no_sync():
                (sdp(x) - y).pow(2).mean().backward()
            ctx = ddp.no_sync() if micro == 0 else contextlib.nullcontext()
            with ctx:
                (ddp(x) - y).pow(2).mean().backward()
        sdp.reduce()
        for o in (*opts, *ref_opts):
            o.step()
            o.zero_grad()
    assert_state_dicts_close(model, ref_model, atol=1e-5)
    # reduce in fp16 / bf16: ranks identical, close to DDP
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(0)
        model = Model()
        ref_model = copy.deepcopy(model)
        opt = OSS(model.parameters(), lr=0.1)
        sdp = ShardedDDP(model, opt, reduce_fp16=True, reduce_dtype=dtype)
        ddp, ref_opt = DDP(ref_model), torch.optim.SGD(ref_model.parameters(), lr=0.1)
        for step in range(2):
            x, y = micro_batch(step, 0, rank)
            for module, o in ((sdp, opt), (ddp, ref_opt)):
                (module(x) - y).pow(2).mean().backward()
                o.step()
                o.zero_grad()
        assert_same_across_ranks(model)
        assert_state_dicts_close(model, ref_model, atol=2e-2, rtol=2e-2)
    out["device_type"] = sdp.device_type
    out["forwarded"] = sdp.branches  # an attribute of the wrapped module
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_refresh_memory_reduce_and_half_precision(rank_pool, world_size: int) -> None:
    results = rank_pool(world_size).run(_refresh_memory_and_options)
    assert all(r["device_type"] == "cpu" and r["forwarded"] is False for r in results)
    assert all(r["grad_bytes"] > 0 for r in results)


def _bad_inputs() -> list[str]:
    model = Model()
    caught = []
    with pytest.raises(TypeError, match="needs shardkit.optim.OSS"):
        ShardedDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))  # type: ignore[arg-type]
    caught.append("type")
    other = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="not parameters of the wrapped module"):
        ShardedDataParallel(model, OSS([*model.parameters(), *other.parameters()], lr=0.1))
    caught.append("foreign")
    with pytest.raises(ValueError, match="in no OSS optimizer"):
        ShardedDataParallel(model, OSS(model.head.parameters(), lr=0.1))
    caught.append("orphan")
    sub = dist.new_group([0])  # every rank creates it; rank 0 alone is a member
    if dist.get_rank() == 0:
        with pytest.raises(ValueError, match="pass the same process group"):
            ShardedDataParallel(model, OSS(model.parameters(), group=sub, lr=0.1))
        caught.append("group")
    return caught


def test_bad_input_errors(rank_pool) -> None:
    assert rank_pool(2).run(_bad_inputs) == [
        ["type", "foreign", "orphan", "group"],
        ["type", "foreign", "orphan"],
    ]


class Tripwire(nn.Module):
    """FairScale's test model: frozen integer and bool parameters beside a trainable one."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(2, 3, bias=False)
        self.tripwire = nn.Parameter(torch.LongTensor((3, 3)), requires_grad=False)
        self.flag = nn.Parameter(torch.tensor([True, False]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x) * self.tripwire[0].float()


def _fairscale_surface() -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    plain = Tripwire()
    ref = DDP(copy.deepcopy(plain))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    if rank == 1:  # another value on rank 1: sync_models_at_startup broadcasts it
        with torch.no_grad():
            plain.tripwire.fill_(7)
            plain.flag.fill_(False)
    opt = OSS(plain.parameters(), optim=torch.optim.SGD, lr=0.1)
    model = ShardedDataParallel(plain, opt)
    out: dict[str, Any] = {
        "owned": sorted(tuple(p.shape) for p in opt.param_to_rank),
        "tripwire_after_wrap": plain.tripwire.tolist(),
        "flag_after_wrap": plain.flag.tolist(),
        "multi_device": model.is_multi_device_module,
    }
    for step in range(3):
        x, y = micro_batch(step, 0, rank)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            ((m(x[:, :2]) - y) ** 2).mean().backward()
            o.step()
    assert_tensors_close(plain.model.weight, ref.module.model.weight, atol=1e-6, name="weight")
    out["tripwire_after_training"] = plain.tripwire.tolist()
    out["tripwire_dtype"] = str(plain.tripwire.dtype)
    # the property reads the parameters now: one on another device makes it True
    plain.register_parameter("elsewhere", nn.Parameter(torch.zeros(1, device="meta")))
    out["multi_device_with_meta"] = model.is_multi_device_module
    del plain.elsewhere

    # a .grad that requires grad: refused at the forward (FairScale's test_catch_grad_grad)
    net = Model()
    net_opt = OSS(net.parameters(), lr=0.1)
    sdp = ShardedDataParallel(net, net_opt)
    net.emb.weight.grad = torch.zeros_like(net.emb.weight).requires_grad_(True)
    x, y = micro_batch(0, 0, rank)
    with pytest.raises(RuntimeError, match=r"gradient of emb.weight requires grad") as info:
        sdp(x)
    out["forward_error"] = str(info.value)
    with torch.no_grad():
        sdp(x)  # evaluation does not reduce: allowed
    net.emb.weight.grad = None
    # backward(create_graph=True) gives gradients that require grad: refused in backward
    loss = ((sdp(x) - y) ** 2).mean()
    with pytest.raises(RuntimeError, match=r"gradient of a parameter of shape .* requires grad"):
        loss.backward(create_graph=True)
    out["reducer_state"] = sdp._reducer.state.value  # type: ignore[union-attr]
    # and the wrapper still trains as DDP afterwards
    sdp.zero_grad()
    net_opt.zero_grad()
    ref_net = DDP(copy.deepcopy(net))
    ((sdp(x) - y) ** 2).mean().backward()
    ((ref_net(x) - y) ** 2).mean().backward()
    owned = set(net_opt.local_params())
    for (name, p), q in zip(net.named_parameters(), ref_net.module.parameters()):
        if p in owned:
            assert_tensors_close(p.grad, q.grad, atol=1e-6, name=name)  # type: ignore[arg-type]
        else:
            assert p.grad is None, name
    return out


def test_fairscale_surface_frozen_integers_multi_device_and_grad_with_graph(rank_pool) -> None:
    results = rank_pool(2).run(_fairscale_surface)
    for r in results:
        assert r["owned"] == [(3, 2)]  # only the trainable weight has an owner
        assert r["tripwire_after_wrap"] == [3, 3] and r["flag_after_wrap"] == [True, False]
        assert r["tripwire_after_training"] == [3, 3] and r["tripwire_dtype"] == "torch.int64"
        assert r["multi_device"] is False and r["multi_device_with_meta"] is True
        assert "backward() without create_graph" in r["forward_error"]
        assert "p.grad = p.grad.detach()" in r["forward_error"]
        assert r["reducer_state"] == "idle"


def _profiled_names(fn: Any) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events()]


def _profiler_labels() -> list[str]:
    torch.manual_seed(0)
    model = Model()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, broadcast_buffer_size=0)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=0)  # one bucket per parameter
    x, y = micro_batch(0, 0, dist.get_rank())

    def step() -> None:
        ((sdp(x) - y) ** 2).mean().backward()
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()

    names = _profiled_names(step)
    assert names.count("OSS::step") == 1
    return sorted({n for n in names if n.startswith(("OSS::", "ShardedDDP::"))})


def test_profiler_labels_of_oss_and_sharded_ddp(rank_pool) -> None:
    """torch.profiler traces name each phase: one reduce and one wait per bucket (8
    parameters, reduce_buffer_size=0: 8 buckets), the step, the local step, the
    broadcast (8 parameters, broadcast_buffer_size=0: 8 broadcasts)."""
    results = rank_pool(2).run(_profiler_labels)
    assert results[0] == results[1]
    labels = results[0]
    reduces = [n for n in labels if n.startswith("ShardedDDP::reduce bucket=")]
    waits = [n for n in labels if n.startswith("ShardedDDP::wait bucket=")]
    assert len(reduces) == 8 and len(waits) == 8, labels
    assert {n.split()[1] for n in reduces} == {f"bucket={i}" for i in range(8)}
    assert {n.split()[2] for n in reduces} == {"owner=0", "owner=1"}
    assert {
        "ShardedDDP::pre_forward",
        "ShardedDDP::sync_buffers",
        "ShardedDDP::finalize_backward",
        "OSS::step",
        "OSS::local_step",
        "OSS::broadcast buckets=8",
        "OSS::clip_grad_norm",
    } <= set(labels), labels
