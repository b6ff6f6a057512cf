"""Rank-side workers of test_fsdp_runtime (issue 16): FSDP against the plain model.

Every worker builds the tiny GPT twice from one seed: ``ref``, unwrapped, trains on the
global batch; the FSDP model trains on this rank's part of it (DDP semantics). SGD with
momentum (linear in the gradient, so bf16's error stays proportional; Adam would turn
a rounding difference of a near-zero gradient into a full-size step).

Each configuration runs in its own process group (``_isolated``) with a short timeout,
and an exception becomes ``{"error": traceback}``: one failing configuration does not
hide the others' results, and ranks that disagree stop within the group's timeout.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel.fully_sharded.unit import units_in
from shardkit.nn.wrap import auto_wrap, enable_wrap, size_based_auto_wrap_policy
from tests.nn.data_parallel.fsdp_workers import global_batch, local_part, tiny_gpt, wrap_model

GROUP_TIMEOUT_S = 30.0
BF16 = {"mixed_precision": True, "compute_dtype": torch.bfloat16}


def sharded_checkpoint() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``save_fsdp_sharded, load_fsdp_sharded`` (one line to change if they move)."""
    from shardkit.nn.data_parallel.fully_sharded import load_fsdp_sharded, save_fsdp_sharded

    return save_fsdp_sharded, load_fsdp_sharded


# harness ---------------------------------------------------------------------------
_GROUP: list[dist.ProcessGroup | None] = [None]


def group() -> dist.ProcessGroup | None:
    """The current configuration's process group."""
    return _GROUP[0]


def _isolated(fn: Callable[[dict[str, Any]], dict[str, Any]], cfg: dict[str, Any]) -> Any:
    _GROUP[0] = dist.new_group(timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    torch.manual_seed(0)
    try:
        return fn(cfg)
    except Exception:
        return {"error": traceback.format_exc()}
    finally:
        _GROUP[0] = None


def run_configs(jobs: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """Run ``(worker name, config)`` pairs, each isolated; one pool call for all."""
    return [_isolated(globals()[name], cfg) for name, cfg in jobs]


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group())
    return float(t) / dist.get_world_size(group())


def fsdp_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"process_group": group()}
    if cfg.get("precision") == "bf16":
        kwargs.update(BF16)
    if "raf" in cfg:
        kwargs["reshard_after_forward"] = cfg["raf"]
    return kwargs


def build(cfg: dict[str, Any], before_wrap: Callable[[nn.Module], None] | None = None) -> Any:
    """``(ref, fsdp model)`` from one seed; ``before_wrap`` runs on both first."""
    ref = tiny_gpt()
    model = copy.deepcopy(ref)
    if before_wrap is not None:
        before_wrap(ref)
        before_wrap(model)
    return ref, wrap_model(model, cfg.get("nesting", "block"), **fsdp_kwargs(cfg))


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def set_trainable(model: nn.Module, prefixes: tuple[str, ...], flag: bool) -> None:
    """``requires_grad_(flag)`` on every parameter whose name starts with a prefix."""
    for name, param in model.named_parameters():
        if name.startswith(prefixes):
            param.requires_grad_(flag)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global ``x, y`` and this rank's part of them."""
    rank, world = dist.get_rank(group()), dist.get_world_size(group())
    x, y = global_batch(step, world)
    return x, y, local_part(x, rank), local_part(y, rank)


def forward_loss(ref: nn.Module, model: nn.Module, step: int) -> tuple[Any, Any]:
    """Both models' losses on batch ``step`` (graphs kept)."""
    x, y, lx, ly = batch(step)
    return ref(x, y)[1], model(lx, ly)[1]


class Run:
    """Both sides of one parity run, and what the test compares."""

    def __init__(self, cfg: dict[str, Any], ref: nn.Module, model: nn.Module) -> None:
        self.cfg, self.ref, self.model = cfg, ref, model
        self.out: dict[str, Any] = {"losses": [], "ref_losses": [], "error": None}
        self.out["init"] = {k: v.clone() for k, v in ref.state_dict().items()}
        self.opt: torch.optim.Optimizer | None = None
        self.ref_opt: torch.optim.Optimizer | None = None

    def optimizers(self) -> None:
        self.opt, self.ref_opt = sgd(self.model.parameters()), sgd(self.ref.parameters())

    def train_step(self, step: int, between: Callable[[], None] | None = None) -> None:
        """Forward, backward, ``between()``, step, zero_grad on both; losses recorded."""
        assert self.opt is not None and self.ref_opt is not None
        ref_loss, loss = forward_loss(self.ref, self.model, step)
        ref_loss.backward()
        loss.backward()
        if between is not None:
            between()
        self.opt.step()
        self.ref_opt.step()
        self.opt.zero_grad()
        self.ref_opt.zero_grad()
        self.out["losses"].append(mean_over_ranks(loss.item()))
        self.out["ref_losses"].append(ref_loss.item())

    def sanity_forward(self, step: int = 99) -> None:
        """A forward with grad enabled and no backward, on both (a sanity check, an eval
        pass without no_grad, generation)."""
        forward_loss(self.ref, self.model, step)

    def finish(self) -> dict[str, Any]:
        self.out["state"] = self.model.state_dict()
        self.out["ref_state"] = self.ref.state_dict()
        self.out["names"] = [n for n, _ in self.model.named_parameters()]
        self.out["ref_names"] = [n for n, _ in self.ref.named_parameters()]
        return self.out


# behaviour 1: the trainable set changes after wrapping ------------------------------
BLOCK0, BLOCK1, WPE = ("blocks.0.",), ("blocks.1.", "wpe."), ("blocks.0.attn.",)


def trainable_change(cfg: dict[str, Any]) -> dict[str, Any]:
    """Scenarios: ``unfreeze_later`` (frozen before wrapping, unfrozen after a step),
    ``freeze_after`` (frozen after wrapping), ``unfreeze_after_eval`` (unfrozen after a
    ``no_grad`` validation pass), ``freeze_part_of_unit`` (some parameters of a unit),
    ``control`` (no change)."""
    scenario = cfg["scenario"]
    frozen_at_wrap = scenario in ("unfreeze_later", "unfreeze_after_eval")

    def freeze(m: nn.Module) -> None:
        set_trainable(m, BLOCK0, False)

    ref, model = build(cfg, freeze if frozen_at_wrap else None)
    run = Run(cfg, ref, model)
    run.optimizers()  # over every parameter, frozen ones too (a warm-up schedule)
    run.train_step(0)
    run.out["ref_at_change"] = {k: v.clone() for k, v in ref.state_dict().items()}
    run.out["at_change"] = model.state_dict()  # FSDP's own values (rounding differs)
    for m in (ref, model):
        if scenario == "unfreeze_later":
            set_trainable(m, BLOCK0, True)
        elif scenario == "freeze_after":
            set_trainable(m, BLOCK1, False)
        elif scenario == "freeze_part_of_unit":
            set_trainable(m, WPE, False)
        elif scenario == "unfreeze_after_eval":
            x, y, lx, ly = batch(50)
            m.eval()
            with torch.no_grad():
                m(*((x, y) if m is ref else (lx, ly)))
            m.train()
            set_trainable(m, BLOCK0, True)
    for step in range(1, 3):
        run.train_step(step)
    out = run.finish()
    out["trainable"] = [n for n, p in ref.named_parameters() if p.requires_grad]
    return out


# behaviour 2: no stale full parameters ------------------------------------------------
def stale_full(cfg: dict[str, Any]) -> dict[str, Any]:
    """A forward with grad and no backward leaves the root's full parameters; then:

    ``load_local``/``load_sharded``/``load_full``: load the state after step 0 (taken
    with that entry point) and continue; ``optimizer_after_forward``: build the
    optimizer then; ``eval_forward_before_step``: a grad-enabled eval forward between
    backward and ``step()``; ``control``: none of these.
    """
    scenario = cfg["scenario"]
    ref, model = build(cfg)
    run = Run(cfg, ref, model)
    if scenario == "optimizer_after_forward":
        run.sanity_forward()
    run.optimizers()
    run.train_step(0)
    if scenario.startswith("load_"):
        ref_saved = {k: v.clone() for k, v in ref.state_dict().items()}
        save, load = sharded_checkpoint()
        if scenario == "load_local":
            saved: Any = model.local_state_dict()
        elif scenario == "load_sharded":
            save(model, cfg["dir"])
        else:
            saved = model.state_dict()
        run.out["saved_full"] = model.state_dict()
        run.train_step(1)
        run.sanity_forward()
        if scenario == "load_local":
            model.load_local_state_dict(saved)
        elif scenario == "load_sharded":
            load(model, cfg["dir"])
        else:
            model.load_state_dict(saved)
        ref.load_state_dict(ref_saved)
        x, y, lx, ly = batch(60)
        with torch.no_grad():  # the first forward after the load, before any state_dict()
            run.out["load_loss"] = mean_over_ranks(model(lx, ly)[1].item())
            run.out["ref_load_loss"] = ref(x, y)[1].item()
        run.out["after_load"] = model.state_dict()
        run.out["ref_after_load"] = ref.state_dict()
    for step in range(2, 4):
        if scenario == "eval_forward_before_step":
            run.train_step(step, between=run.sanity_forward)
        else:
            run.train_step(step)
    return run.finish()


def _attempt(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def load_mid_step(cfg: dict[str, Any]) -> dict[str, Any]:
    """Load (``full`` or ``local``) between a forward and its backward: some call must
    raise (plain torch's backward refuses the in-place change)."""
    ref, model = build(cfg)
    run = Run(cfg, ref, model)
    run.optimizers()
    run.train_step(0)
    saved = model.state_dict() if cfg["scenario"] == "full" else model.local_state_dict()
    run.train_step(1)
    _, loss = forward_loss(ref, model, 2)
    loader = model.load_state_dict if cfg["scenario"] == "full" else model.load_local_state_dict
    out: dict[str, Any] = {"error": None, "load": _attempt(lambda: loader(saved))}
    out["backward"] = _attempt(loss.backward)
    ref_loss = ref(*batch(2)[:2])[1]
    ref.load_state_dict(ref.state_dict())
    out["ref_backward"] = _attempt(ref_loss.backward)  # the plain-torch baseline
    return out


# behaviour 3: clip_grad_norm_ for every norm type -------------------------------------
def clip_norms(cfg: dict[str, Any]) -> dict[str, Any]:
    """For each norm type: one backward, ``clip_grad_norm_(1e-3, p)``, one SGD step (lr 1,
    so the update is the clipped gradient) on a fresh pair of models."""
    out: dict[str, Any] = {"error": None, "cases": []}
    for norm_type in cfg["norm_types"]:
        ref, model = build(cfg)
        empty = torch.tensor([sum(p.numel() == 0 for p in model.parameters())])
        dist.all_reduce(empty, group=group())
        ref_loss, loss = forward_loss(ref, model, 0)
        ref_loss.backward()
        loss.backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3, norm_type))
        case: dict[str, Any] = {"norm_type": norm_type, "ref_norm": ref_norm}
        case["empty_pieces"] = int(empty)
        case["init"] = {k: v.clone() for k, v in ref.state_dict().items()}
        case["norm"] = float(model.clip_grad_norm_(1e-3, norm_type))
        torch.optim.SGD(model.parameters(), lr=1.0).step()
        torch.optim.SGD(ref.parameters(), lr=1.0).step()
        case["state"], case["ref_state"] = model.state_dict(), ref.state_dict()
        out["cases"].append(case)
    return out


# behaviour 4: buffers follow DDP ------------------------------------------------------
def bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    head = nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 1))
    model = nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 8), nn.ReLU(), head)
    rank = dist.get_rank(group())
    for m in model.modules():  # different buffers on each rank: rank 0's must win
        if isinstance(m, nn.BatchNorm1d):
            assert m.running_mean is not None
            m.running_mean.fill_(float(rank))
    return model


def _bn_batch(step: int, micro: int) -> torch.Tensor:
    rank = dist.get_rank(group())
    g = torch.Generator().manual_seed(7000 + 100 * step + 10 * micro + rank)
    return torch.randn(4, 6, generator=g) * (1 + rank) + rank  # ranks see different data


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    inner = model.module if isinstance(model, DDP) else model  # no "module." prefix
    return {k: v.detach().clone() for k, v in inner.named_buffers()}


def buffers_vs_ddp(cfg: dict[str, Any]) -> dict[str, Any]:
    """BatchNorm with ``no_sync`` accumulation (2 micro-batches a step), 3 steps, then
    two eval forwards and one more step; FSDP(broadcast_buffers=b) against torch
    DDP(broadcast_buffers=b) on the same local data, on every rank.

    Recorded per rank: buffers after each step and each eval, eval outputs, the final
    parameters (``state_dict`` of both)."""
    flag = cfg["broadcast_buffers"]
    plain = bn_model()
    ddp = DDP(copy.deepcopy(plain), process_group=group(), forward_sync_buffers=flag)
    model = plain
    kwargs = fsdp_kwargs(cfg)
    if cfg.get("nesting") == "nested":
        model[3] = FSDP(model[3], broadcast_buffers=flag, **kwargs)
    fsdp = FSDP(model, broadcast_buffers=flag, **kwargs)
    opts = {"ddp": sgd(ddp.parameters()), "fsdp": sgd(fsdp.parameters())}
    out: dict[str, Any] = {"error": None, "ddp": [], "fsdp": [], "ddp_eval": [], "fsdp_eval": []}
    xe = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))

    def step(n: int) -> None:
        for name, m in (("ddp", ddp), ("fsdp", fsdp)):
            for micro in range(2):
                ctx = m.no_sync() if micro == 0 else nullcontext()
                with ctx:
                    m(_bn_batch(n, micro)).pow(2).mean().backward()
            opts[name].step()
            opts[name].zero_grad()
            out[name].append(_buffers(m))

    for n in range(3):
        step(n)
    for name, m in (("ddp", ddp), ("fsdp", fsdp)):
        m.eval()
        with torch.no_grad():
            for _ in range(2):
                out[f"{name}_eval"].append(m(xe).float().clone())
                out[name].append(_buffers(m))
        m.train()
    step(3)
    out["ddp_state"], out["fsdp_state"] = ddp.module.state_dict(), fsdp.state_dict()
    return out


# behaviour 5: model.module.state_dict() -------------------------------------------------
def module_state_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """After two steps, ``model.module.state_dict()`` (the DDP habit)."""
    ref, model = build(cfg)
    run = Run(cfg, ref, model)
    run.optimizers()
    for step in range(2):
        run.train_step(step)
    out = run.finish()
    try:
        out["module_state"] = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        out["module_error"] = None
    except Exception as err:
        out["module_state"], out["module_error"] = None, f"{type(err).__name__}: {err}"
    return out


# behaviour 6: FairScale's wrapping pattern ---------------------------------------------
def fairscale_root_wrap(cfg: dict[str, Any]) -> dict[str, Any]:
    """``enable_wrap + auto_wrap`` with a size policy that wraps the root, then
    ``FSDP(model)`` as FairScale's docs and fairseq do; 3 steps against the plain model."""
    ref = tiny_gpt()
    model: nn.Module = copy.deepcopy(ref)
    kwargs = fsdp_kwargs(cfg)
    with enable_wrap(wrapper_cls=FSDP, **kwargs):
        model = auto_wrap(model, size_based_auto_wrap_policy(cfg["min_num_params"]))
    root_wrapped = isinstance(model, FSDP)
    model = FSDP(model, **kwargs)
    run = Run(cfg, ref, model)
    run.out["root_wrapped_by_policy"] = root_wrapped
    run.optimizers()
    for step in range(3):
        run.train_step(step)
    return run.finish()


# behaviour 7: a no_sync micro-batch dropped by model.zero_grad() ----------------------
def _nan_check(grad: torch.Tensor) -> None:
    raise FloatingPointError("a NaN check in backward")


def _hook_nan_check(module: nn.Module, args: Any, output: torch.Tensor) -> None:
    output.register_hook(_nan_check)


def dropped_micro_batch(cfg: dict[str, Any]) -> dict[str, Any]:
    """Per step: a micro-batch inside ``no_sync``, then ``model.zero_grad()`` (the plain
    model's too: that micro-batch is dropped), then a micro-batch outside that steps.
    Also: ``optimizer.zero_grad()`` alone does not drop it (the optimizer holds the
    shards), and ``zero_grad()`` between a forward and its backward works while one
    inside a backward is refused."""
    ref, model = build(cfg)
    run = Run(cfg, ref, model)
    run.optimizers()
    assert run.opt is not None and run.ref_opt is not None
    for step in range(3):
        ref_loss, loss = forward_loss(ref, model, 100 + step)
        with model.no_sync():
            loss.backward()
        ref_loss.backward()
        model.zero_grad()
        ref.zero_grad()
        run.train_step(step)
    refused: list[str] = []
    _, loss = forward_loss(ref, model, 200)
    loss.register_hook(lambda g: refused.append(_attempt(model.zero_grad) or "") or g)
    loss.backward()
    run.opt.zero_grad()
    # optimizer.zero_grad() after a no_sync micro-batch leaves it in (documented)
    _, loss = forward_loss(ref, model, 300)
    with model.no_sync():
        loss.backward()
    run.opt.zero_grad()
    pending = sum(
        int(p.grad is not None) for unit in units_in(model) for p in unit.handle.unsharded_params
    )
    model.zero_grad()
    left = sum(
        int(p.grad is not None) for unit in units_in(model) for p in unit.handle.unsharded_params
    )
    # a forward that raises (a bad target; a token outside the vocabulary), as an
    # HF-style loop skipping a bad batch: model.zero_grad() works, then training goes on
    after_raise: list[str | None] = []
    _, _, lx, ly = batch(400)
    bad_token = lx.clone()
    bad_token[0, 0] = 10**6
    for args in ((lx, ly[:, :-1]), (bad_token, ly)):
        assert _attempt(lambda args=args: model(*args)) is not None, "the bad batch ran"
        after_raise.append(_attempt(model.zero_grad))
    # a backward that raises half-way (a NaN check on a block's output gradient): then
    # model.zero_grad() (the plain model keeps nothing of it either), state_dict(), training
    block = next(m for m in model.modules() if type(m).__name__ == "Block")
    hooked = block.register_forward_hook(_hook_nan_check)
    _, loss = forward_loss(ref, model, 450)
    hooked.remove()
    after_raise.append(_attempt(loss.backward))
    after_raise.append(_attempt(model.zero_grad))
    after_raise.append(_attempt(model.state_dict))
    run.train_step(500)
    out = run.finish()
    out.update(refused=refused, pending=pending, left=left, after_raise=after_raise)
    return out
