"""Rank-side workers of the FSDP tests (top level: pickled to spawned ranks)."""

from __future__ import annotations

import copy
import functools
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.models import GPT, Block, GPTConfig
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel.fully_sharded.unit import runtime_of
from shardkit.nn.wrap import (
    auto_wrap,
    enable_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
LOCAL_BATCH = 2
SEQ = 8


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


def wrap_model(model: nn.Module, nesting: str, **kwargs: Any) -> FSDP:
    """``flat`` (one unit), ``size`` (auto_wrap by size) or ``block`` (by Block class)."""
    if nesting == "size":
        policy = size_based_auto_wrap_policy(1000)
    elif nesting == "block":
        policy = transformer_auto_wrap_policy({Block})
    else:
        return FSDP(model, **kwargs)
    with enable_wrap(wrapper_cls=FSDP, **kwargs):
        model = auto_wrap(model, policy)
    return model if isinstance(model, FSDP) else FSDP(model, **kwargs)


def count_calls(module: Any, name: str, action: Callable[[], Any]) -> int:
    """How often ``action()`` calls ``module.<name>`` (a function the FSDP code looks
    up at call time, e.g. ``unit.all_gather_flat``)."""
    real, count = getattr(module, name), [0]

    def spy(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return real(*args, **kwargs)

    setattr(module, name, spy)
    try:
        action()
    finally:
        setattr(module, name, real)
    return count[0]


def global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, TINY.vocab_size, (LOCAL_BATCH * world, SEQ), generator=g)
    y = torch.randint(0, TINY.vocab_size, (LOCAL_BATCH * world, SEQ), generator=g)
    return x, y


def local_part(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]


def no_decay(name: str) -> bool:
    return name.endswith("bias") or ".ln_" in name or name.startswith("ln_")


def make_optim(named: list[tuple[str, nn.Parameter]], groups: bool) -> torch.optim.Optimizer:
    if not groups:
        return torch.optim.AdamW([p for _, p in named], lr=1e-3, weight_decay=0.1)
    decay = [p for n, p in named if not no_decay(n)]
    plain = [p for n, p in named if no_decay(n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}], lr=1e-3
    )


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def agree(group: dist.ProcessGroup | None, *what: Any) -> None:
    """Every rank of ``group`` is at the same point with the same arguments (``what``):
    an all-gather of its checksum, so ranks that drew different rules of a state machine
    fail here, before any mismatched collective.

    Raises:
        AssertionError: naming this rank's ``what``.
    """
    mine = torch.tensor([zlib.crc32(repr(what).encode())], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    if len({int(t) for t in every}) != 1:
        raise AssertionError(f"ranks diverged: this rank is at {what}")


def _step_fsdp(model: FSDP, x: torch.Tensor, y: torch.Tensor, cfg: dict[str, Any]) -> float:
    micro = cfg.get("micro", 1)
    total = 0.0
    for m in range(micro):
        xs, ys = x.chunk(micro)[m], y.chunk(micro)[m]
        last = m == micro - 1
        ctx = model.no_sync() if cfg.get("no_sync") and not last else _null()
        with ctx:
            if cfg.get("two_forwards"):
                _, l1 = model(xs[:1], ys[:1])
                _, l2 = model(xs[1:], ys[1:])
                loss = (l1 + l2) / 2
            else:
                _, loss = model(xs, ys)
            (loss / micro).backward()
        total += loss.item() / micro
    return total


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def train_parity(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train the tiny GPT with FSDP (local batch) and unwrapped (global batch).

    Returns the per-step losses of both, the full state dicts, clip norms and names.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = tiny_gpt()
    model = copy.deepcopy(ref)
    if cfg.get("frozen"):
        for m in (ref, model):
            m.blocks[0].ln_1.weight.requires_grad_(False)
            m.wpe.weight.requires_grad_(False)
    model = wrap_model(model, cfg["nesting"], reshard_after_forward=cfg.get("raf", True))
    names = [n for n, _ in model.named_parameters()]
    opt = make_optim(list(model.named_parameters()), cfg.get("groups", False))
    ref_opt = make_optim(list(ref.named_parameters()), cfg.get("groups", False))
    out: dict[str, Any] = {"losses": [], "ref_losses": [], "norms": [], "ref_norms": []}
    for step in range(cfg.get("steps", 2)):
        x, y = global_batch(step, world)
        loss = _step_fsdp(model, local_part(x, rank), local_part(y, rank), cfg)
        _, ref_loss = ref(x, y)
        ref_loss.backward()
        if cfg.get("clip"):
            out["norms"].append(float(model.clip_grad_norm_(0.05)))
            out["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        out["losses"].append(mean_over_ranks(loss))
        out["ref_losses"].append(ref_loss.item())
    out["state"] = model.state_dict()
    out["ref_state"] = ref.state_dict()
    out["names"] = names
    out["ref_names"] = [n for n, _ in ref.named_parameters()]
    return out


def parity_grid(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [train_parity(cfg) for cfg in configs]


def run_all(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run several zero-argument workers in one pool call (saves a round trip each)."""
    return [fn() for fn in fns]


partial = functools.partial


def frozen_state_check() -> dict[str, Any]:
    """A frozen parameter inside a unit gets no gradient and no optimizer state."""
    model = tiny_gpt()
    model.blocks[0].ln_1.weight.requires_grad_(False)
    model = wrap_model(model, "block")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = global_batch(0, 1)
    model(x, y)[1].backward()
    opt.step()
    frozen = dict(model.named_parameters())["blocks.0.ln_1.weight"]
    return {"grad": frozen.grad is None, "state": frozen not in opt.state}


def _train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range, local: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        x, y = global_batch(step, world)
        if local:
            x, y = local_part(x, rank), local_part(y, rank)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()


def _named_optim(model: nn.Module) -> torch.optim.Optimizer:
    return make_optim(list(model.named_parameters()), groups=True)


def state_roundtrips() -> dict[str, Any]:
    """Full / local state dicts and optimizer state: gather, shard, continue."""
    out: dict[str, Any] = {}
    ref = tiny_gpt()
    model = wrap_model(copy.deepcopy(ref), "block")
    opt, ref_opt = _named_optim(model), _named_optim(ref)
    _train_steps(model, opt, range(2), local=True)
    _train_steps(ref, ref_opt, range(2), local=False)
    full = model.state_dict()
    plain = tiny_gpt(seed=5)
    plain.load_state_dict(full)
    out["plain"], out["ref"] = plain.state_dict(), ref.state_dict()
    full_optim = model.gather_full_optim_state_dict(opt)
    out["full_optim"], out["ref_optim"] = full_optim, ref_opt.state_dict()
    shared = [full_optim]
    dist.broadcast_object_list(shared, src=0)
    # a fresh wrapped model resumes from the full states and continues identically
    resumed = wrap_model(tiny_gpt(seed=7), "block")
    resumed.load_state_dict(full)
    resumed_opt = _named_optim(resumed)
    resumed_opt.load_state_dict(resumed.get_shard_from_optim_state_dict(shared[0], resumed_opt))
    local = model.local_state_dict()
    _train_steps(model, opt, range(2, 4), local=True)
    _train_steps(resumed, resumed_opt, range(2, 4), local=True)
    out["continued"], out["resumed"] = model.state_dict(), resumed.state_dict()
    model.load_local_state_dict(local)
    out["local_back"], out["before"] = model.state_dict(), full
    rank0 = FSDP(tiny_gpt(), state_dict_on_rank_0_only=True)
    out["rank0_only_keys"] = len(rank0.state_dict())
    # tied names (wte / lm_head) share one tensor in the full state dict, as in the plain one
    out["tied_ref"] = tied_groups(tiny_gpt().state_dict())
    out["tied"] = {n: tied_groups(wrap_model(tiny_gpt(), n).state_dict()) for n in NESTINGS}
    return out


NESTINGS = ("flat", "size", "block")


def tied_groups(state: dict[str, torch.Tensor]) -> list[list[str]]:
    """The groups of two or more keys whose tensors share memory (same data pointer)."""
    groups: dict[int, list[str]] = {}
    for key, value in state.items():
        groups.setdefault(value.data_ptr(), []).append(key)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def save_sharded(directory: str) -> dict[str, Any]:
    from shardkit.nn.data_parallel.fully_sharded import save_fsdp_sharded

    model = wrap_model(tiny_gpt(), "size")
    opt = _named_optim(model)
    _train_steps(model, opt, range(2), local=True)
    save_fsdp_sharded(model, directory, opt)
    return {"state": model.state_dict(), "optim": model.gather_full_optim_state_dict(opt)}


def load_sharded(directory: str) -> dict[str, Any]:
    from shardkit.nn.data_parallel.fully_sharded import load_fsdp_sharded

    model = wrap_model(tiny_gpt(seed=3), "size")
    opt = _named_optim(model)
    load_fsdp_sharded(model, directory, opt)
    return {"state": model.state_dict(), "optim": model.gather_full_optim_state_dict(opt)}


def memory_and_unsharded_count() -> dict[str, Any]:
    """Model-state bytes per rank, and how many units are unsharded during forward."""
    from shardkit.memory import model_state_bytes

    model = wrap_model(tiny_gpt(), "block")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen: list[int] = []

    def count(*_: Any) -> None:
        seen.append(sum(runtime_of(u).sharded_state.name != "SHARDED" for u in model.units()))

    for block in model.blocks:
        block.module.register_forward_pre_hook(count)
    _train_steps(model, opt, range(1), local=True)
    x, y = global_batch(1, 1)
    model(x, y)[1].backward()
    opt.step()  # measured with gradients held, as at the end of a step
    shard_elems = sum(runtime_of(u).handle.layout.shard_numel for u in model.units())
    return {
        "bytes": model_state_bytes(model, opt).as_dict(),
        "shard_elems": shard_elems,
        "numel": tiny_gpt().num_parameters(),
        "units": len(model.units()),
        "max_unsharded": max(seen),
        "n_params": len(list(model.parameters())),
    }


def _raises(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def bad_inputs() -> dict[str, str]:
    out = {}
    wrapped = FSDP(nn.Linear(2, 2))
    outer = FSDP(wrapped)  # FairScale's pattern: a unit around a unit, no own parameters
    out["double"] = (
        f"{len(runtime_of(outer).handle.infos)} own, {len(list(outer.parameters()))} total"
    )
    inner = nn.Linear(2, 2)
    FSDP(inner)
    out["twice"] = _raises(lambda: FSDP(inner))
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    out["devices"] = _raises(lambda: FSDP(mixed))
    early = nn.Linear(2, 2)
    opt = torch.optim.SGD(early.parameters(), lr=0.1)
    late = FSDP(early)
    late(torch.ones(1, 2)).sum().backward()
    out["optimizer"] = _raises(opt.step)
    gpt = tiny_gpt()
    gpt.lm_head = FSDP(gpt.lm_head)
    out["tie"] = _raises(lambda: FSDP(gpt))
    return out


class _Twice(nn.Module):
    """A unit used twice in one forward, a zero-size parameter, a parameter-free unit."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.empty = nn.Parameter(torch.zeros(0, 3))
        self.act = nn.ReLU()
        self.register_buffer("scale", torch.full((5,), float(dist.get_rank() + 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(self.lin(x * self.scale))).sum(-1) + self.empty.sum()


def _sgd_step_against_reference(
    model: nn.Module, ref: nn.Module, *, features: int, lr: float
) -> torch.Tensor:
    """One SGD step: ``model`` on this rank's 2 rows, ``ref`` on the global batch
    (``2 * world`` rows, the same on every rank); returns the global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(2 * world, features, generator=torch.Generator().manual_seed(0))
    model(x[2 * rank : 2 * rank + 2]).mean().backward()
    ref(x).mean().backward()
    for module in (model, ref):
        torch.optim.SGD(module.parameters(), lr=lr).step()
    return x


def edge_cases() -> dict[str, Any]:
    """Twice-used unit, zero-size parameter, parameter-free unit, buffers, eval."""
    torch.manual_seed(0)
    ref = _Twice()
    ref.scale.fill_(1.0)  # rank 0's buffer: FSDP broadcasts it
    model = copy.deepcopy(ref)
    model.scale.fill_(float(dist.get_rank() + 1))
    model.lin = FSDP(model.lin)
    model.act = FSDP(model.act)
    model = FSDP(model)
    x = _sgd_step_against_reference(model, ref, features=5, lr=0.5)
    model.eval()
    with torch.no_grad():
        eval_out = model(x)
    states = [runtime_of(u).sharded_state.name for u in model.units()]
    return {
        "state": model.state_dict(),
        "ref_state": ref.state_dict(),
        "eval": eval_out,
        "ref_eval": ref.eval()(x).detach(),
        "states_after_eval": states,
    }


def frozen_first_in_unit() -> dict[str, Any]:
    """Regression: a frozen Linear before a trainable one in a unit needs its weight in
    backward after the unit's trainable gradients are complete (no early reshard)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)))
    ref[1][0].requires_grad_(False)  # weight and bias
    model = copy.deepcopy(ref)
    model[1] = FSDP(model[1])
    model = FSDP(model)
    _sgd_step_against_reference(model, ref, features=4, lr=1.0)
    return {"state": model.state_dict(), "ref_state": ref.state_dict()}


def shard_gather_identity(shape_lists: list[list[list[int]]]) -> list[dict[str, Any]]:
    """For each list of shapes: shard, then gather (summon) gives back the values."""
    results = []
    for shapes in shape_lists:
        module = nn.Module()
        for i, shape in enumerate(shapes):
            module.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape)))
        original = {k: v.detach().clone() for k, v in module.named_parameters()}
        wrapped = FSDP(module)
        pieces = [p.numel() for p in wrapped.parameters()]
        counts = torch.tensor(pieces + [0], dtype=torch.int64)  # + [0] keeps it non-empty
        dist.all_reduce(counts)
        with wrapped.summon_full_params():
            gathered = {k: v.detach().clone() for k, v in wrapped.named_parameters()}
        results.append(
            {
                "original": original,
                "gathered": gathered,
                "owned": counts[:-1].tolist(),
                "shard_numel": runtime_of(wrapped).handle.layout.shard_numel,
            }
        )
    return results
