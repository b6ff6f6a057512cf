"""Rank-side workers of the FSDP disk-tier tests (top level: pickled to spawned ranks)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import shardkit.checkpoint.direct_io as direct_io
import shardkit.nn.data_parallel.fully_sharded.disk_tier as disk_tier
import shardkit.optim.file_backed as file_backed
from shardkit.memory import buffer_pools
from shardkit.models import GPT, Block
from shardkit.nn.data_parallel.fully_sharded import (
    DiskOffload,
    load_fsdp_sharded,
    save_fsdp_sharded,
)
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel.fully_sharded.unit import units_in
from shardkit.nn.data_parallel.fully_sharded.unit_buffers import SHARDS
from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy
from tests.nn.data_parallel.fsdp_runtime_workers import _hook_nan_check
from tests.nn.data_parallel.fsdp_workers import (
    TINY,
    global_batch,
    local_part,
    mean_over_ranks,
    tiny_gpt,
    wrap_model,
)

HYPER: dict[str, dict[str, Any]] = {
    "adamw": {"lr": 1e-3, "weight_decay": 0.1},
    "sgd": {"lr": 0.05, "momentum": 0.9},
}
CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}


def _disk_model(
    directory: str, cfg: dict[str, Any], resume: bool = False, **fsdp_kwargs: Any
) -> tuple[FSDP, Any]:
    """The tiny GPT wrapped by ``cfg`` on a disk tier in ``directory`` (on meta with
    ``resume``), and the tier's optimizer; ``fsdp_kwargs`` go to every unit."""
    disk = DiskOffload(
        directory,
        resume=resume,
        prefetch=cfg.get("prefetch", True),
        write_behind_bytes=cfg.get("write_behind", 512 * 2**20),
        generations=cfg.get("generations", "step"),
    )
    if resume:
        with torch.device("meta"):
            module: torch.nn.Module = GPT(TINY)
    else:
        module = tiny_gpt()
    model = wrap_model(
        module,
        cfg["nesting"],
        reshard_after_forward=cfg.get("raf", True),
        disk_offload=disk,
        **fsdp_kwargs,
    )
    optimizer = disk.optimizer(CLASSES[cfg["optim"]], **HYPER[cfg["optim"]])
    return model, optimizer


def _step(model: FSDP, optimizer: Any, step: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(step, world)
    _, loss = model(local_part(x, rank), local_part(y, rank))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return mean_over_ranks(loss.item())


def _state_diff(model: FSDP, ref: torch.nn.Module) -> float:
    """The largest absolute difference between the model's full state dict and ``ref``'s."""
    full = model.state_dict()
    return max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())


def _aligned_size(nbytes: list[int]) -> int:
    """Bytes of a packed file: each tensor but the last padded to 64 bytes."""
    return sum(-(-n // 64) * 64 for n in nbytes[:-1]) + (nbytes[-1] if nbytes else 0)


def _expected_optim_bytes(model: FSDP, optim: str) -> int:
    """What one step writes as optimizer state: per unit, per sharded parameter piece,
    AdamW's ``exp_avg``, ``exp_avg_sq`` (piece numel x 4 bytes) and ``step`` (4 bytes);
    SGD's ``momentum_buffer``; packed per unit."""
    total = 0
    for unit in units_in(model):
        sizes: list[int] = []
        for index in range(len(unit.handle.sharded_params)):
            start, end = unit.handle.layout.piece(index, unit.rank)
            numel = end - start
            sizes += [numel * 4, numel * 4, 4] if optim == "adamw" else [numel * 4]
        total += _aligned_size(sizes) if not unit.store.in_memory else 0
    return total


def disk_parity(cfg: dict[str, Any], directory: str) -> dict[str, Any]:
    """Train the tiny GPT with FSDP on the disk tier and unwrapped (global batch): losses,
    full state dicts, disk counters against the arithmetic."""
    world = dist.get_world_size()
    ref = tiny_gpt()
    ref_opt = CLASSES[cfg["optim"]](ref.parameters(), **HYPER[cfg["optim"]])
    model, optimizer = _disk_model(directory, cfg)
    disk = optimizer.tier
    shard_bytes = sum(u.nbytes for u in disk.units)
    on_disk = _count_files_at_commits(disk)
    out: dict[str, Any] = {"losses": [], "ref_losses": [], "bounced": []}
    for step in range(cfg.get("steps", 3)):
        with _bounced_bytes() as bounced:
            out["losses"].append(_step(model, optimizer, step))
        out["bounced"].append(bounced[0])
        x, y = global_batch(step, world)
        _, ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["ref_losses"].append(ref_loss.item())
        out.setdefault("resident_after_step", []).append(disk.resident_bytes())
    optim_bytes = _expected_optim_bytes(model, cfg["optim"])
    out["stats"] = [(s.generation, s.bytes_read, s.bytes_written) for s in disk.history]
    out["expected"] = [
        (g, 2 * shard_bytes + (optim_bytes if g > 1 else 0), shard_bytes + optim_bytes)
        for g in range(1, cfg.get("steps", 3) + 1)
    ]
    out["state"] = model.state_dict()
    out["ref_state"] = ref.state_dict()
    out["files"] = sorted(os.listdir(disk.directory))
    out["units"] = len(disk.units)
    out["most_files"] = max(on_disk)
    disk.close()
    return out


@contextlib.contextmanager
def _bounced_bytes() -> Iterator[list[int]]:
    """Spy on direct I/O: yields ``[bytes]`` copied through a bounce buffer since the
    start (what was not read or written in place)."""
    count = [0]
    fill, read_chunks = direct_io._fill, direct_io._read_chunks

    def counted_fill(address: int, start: int, length: int, segments: Any) -> None:
        count[0] += length
        fill(address, start, length, segments)

    def counted_read(fd: int, address: int, nbytes: int, **kwargs: Any) -> None:
        count[0] += nbytes
        read_chunks(fd, address, nbytes, **kwargs)

    direct_io._fill = counted_fill  # type: ignore[assignment]
    direct_io._read_chunks = counted_read  # type: ignore[assignment]
    try:
        yield count
    finally:
        direct_io._fill, direct_io._read_chunks = fill, read_chunks  # type: ignore[assignment]


def _count_files_at_commits(disk: DiskOffload) -> list[int]:
    """Spy on ``disk``'s store: the number of unit files in its directory (committed,
    in flight or being deleted) just before every commit and after a unit commit."""
    counts: list[int] = [0]
    real = disk.store.commit

    def count() -> None:
        counts.append(len([f for f in os.listdir(disk.directory) if ".g" in f]))

    def spy(*args: Any, **kwargs: Any) -> None:
        count()
        real(*args, **kwargs)
        if kwargs.get("entries") is not None:
            count()

    disk.store.commit = spy  # type: ignore[method-assign]
    return counts


class SimulatedCrash(Exception):
    """Stands for the process dying at a chosen point."""


def crash_between_unit_commits(root: str) -> dict[str, Any]:
    """``generations="unit"``: two steps uninterrupted; then one step, step 2 stopped
    right after its second unit commit (each unit written with write-behind off, so
    the order is fixed), a resume attempt, and the files the manifest names."""
    cfg = {"nesting": "block", "optim": "adamw", "generations": "unit", "write_behind": 0}
    model, optimizer = _disk_model(str(Path(root) / "straight"), cfg)
    for step in range(2):
        _step(model, optimizer, step)
    straight = optimizer.tier.directory
    optimizer.tier.close()

    model, optimizer = _disk_model(str(Path(root) / "crashed"), cfg)
    _step(model, optimizer, 0)
    store, unit_commits = optimizer.tier.store, []
    real = store.commit

    def crash_after_second_unit(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        unit_commits.append(kwargs.get("entries"))
        if len(unit_commits) == 2:
            raise SimulatedCrash

    store.commit = crash_after_second_unit  # type: ignore[method-assign]
    crashed_in_step = False
    try:
        _step(model, optimizer, 1)
    except SimulatedCrash:
        crashed_in_step = True
    crashed = optimizer.tier.directory
    optimizer.tier.store.flush()
    manifest = json.loads((crashed / "manifest.json").read_text())
    named = sorted(f for kinds in manifest["files"].values() for f in kinds.values() if f)
    out: dict[str, Any] = {
        "crashed_in_step": crashed_in_step,
        "unit_commits": unit_commits,
        "unfinished": manifest.get("unfinished"),
        "generation": manifest["generation"],
        "named": named,
        "missing": [f for f in named if not (crashed / f).exists()],
        "sizes_ok": all(
            (crashed / f).stat().st_size == _record_bytes(manifest["units"][f.split(".")[0]], f)
            for f in named
        ),
        "ahead_equal_straight": [
            (crashed / f).read_bytes() == (straight / f).read_bytes()
            for f in named
            if f.endswith(".g2")
        ],
        "resume": _raises(lambda: _disk_model(str(Path(root) / "crashed"), cfg, resume=True)),
    }
    return out


def _record_bytes(record: dict[str, Any], name: str) -> int:
    """The size of a unit's file from its manifest record: the shard (padded flat
    parameter piece, fp32) or the packed optimizer state."""
    if ".params." in name:
        return -(-sum(record["numels"]) // record["world_size"]) * 4
    layout = record["optim"]
    return int(layout["nbytes"]) if isinstance(layout, dict) else -1


def disk_parity_grid(configs: list[dict[str, Any]], root: str) -> list[dict[str, Any]]:
    return [disk_parity(cfg, str(Path(root) / f"cfg{i}")) for i, cfg in enumerate(configs)]


def crash_and_resume(root: str) -> dict[str, Any]:
    """Three steps uninterrupted; then two steps, a crash while writing step 3's
    generation (every rank fails at the same write), a resume from the directory, and
    step 3 redone: same loss and parameters as the uninterrupted run."""
    cfg = {"nesting": "block", "optim": "adamw"}
    model, optimizer = _disk_model(str(Path(root) / "straight"), cfg)
    straight = [_step(model, optimizer, step) for step in range(3)]
    straight_state = model.state_dict()
    optimizer.tier.close()

    directory = str(Path(root) / "crashed")
    model, optimizer = _disk_model(directory, cfg)
    first = [_step(model, optimizer, step) for step in range(2)]
    real_write, calls = direct_io.write_payload, []

    def write_half_then_fail(fd: int, segments: Any, size: int, *, aligned: bool) -> None:
        calls.append(size)
        if len(calls) == 3:  # a unit's shard and state written, the next file half-way
            real_write(fd, segments, size // 2, aligned=aligned)
            raise OSError("disk full (simulated)")
        real_write(fd, segments, size, aligned=aligned)

    direct_io.write_payload = write_half_then_fail  # type: ignore[assignment]
    error = ""
    try:
        _step(model, optimizer, 2)
    except OSError as exc:
        error = str(exc)
    finally:
        direct_io.write_payload = real_write  # type: ignore[assignment]
    disk_dir = optimizer.tier.directory
    optimizer.tier.close()
    del model, optimizer
    files_after_crash = sorted(os.listdir(disk_dir))
    model, optimizer = _disk_model(directory, cfg, resume=True)
    generation = optimizer.tier.generation
    files_after_open = sorted(os.listdir(disk_dir))
    redone = _step(model, optimizer, 2)
    out = {
        "error": error,
        "generation": generation,
        "files_after_crash": files_after_crash,
        "files_after_open": files_after_open,
        "losses": first + [redone],
        "straight": straight,
        "state": model.state_dict(),
        "straight_state": straight_state,
    }
    optimizer.tier.close()
    return out


def killed_mid_step(root: str, init_file: str) -> None:
    """A one-rank process killed (``os._exit``) half-way through writing step 3's
    generation; run in a separate process by the test."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    model, optimizer = _disk_model(root, {"nesting": "block", "optim": "adamw"})
    for step in range(2):
        _step(model, optimizer, step)
    real_write, calls = direct_io.write_payload, []

    def write_half_then_die(fd: int, segments: Any, size: int, *, aligned: bool) -> None:
        calls.append(1)
        if len(calls) == 3:
            real_write(fd, segments, size // 2, aligned=aligned)
            os._exit(17)
        real_write(fd, segments, size, aligned=aligned)

    direct_io.write_payload = write_half_then_die  # type: ignore[assignment]
    _step(model, optimizer, 2)


def resume_after_kill(root: str) -> dict[str, Any]:
    """Resume the killed run's directory and redo step 3."""
    model, optimizer = _disk_model(root, {"nesting": "block", "optim": "adamw"}, resume=True)
    out = {"generation": optimizer.tier.generation, "loss": _step(model, optimizer, 2)}
    out["state"] = model.state_dict()
    optimizer.tier.close()
    out["files"] = sorted(os.listdir(optimizer.tier.directory))
    return out


def straight_run(root: str, steps: int) -> dict[str, Any]:
    model, optimizer = _disk_model(root, {"nesting": "block", "optim": "adamw"})
    losses = [_step(model, optimizer, step) for step in range(steps)]
    out = {"losses": losses, "state": model.state_dict()}
    optimizer.tier.close()
    return out


def _raises(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def misuse(root: str) -> dict[str, str]:
    """The refusals: a second backward before step(), step() without backward, no
    optimizer, a changed summon, a hybrid strategy, a mismatching resume."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(0, world)
    x, y = local_part(x, rank), local_part(y, rank)
    out: dict[str, str] = {}

    disk = DiskOffload(str(Path(root) / "a"))
    model = wrap_model(tiny_gpt(), "block", disk_offload=disk)
    out["no_optimizer"] = _raises(lambda: model(x, y)[1].backward())
    disk.close()

    disk = DiskOffload(str(Path(root) / "e"))
    with enable_wrap(wrapper_cls=FSDP, disk_offload=disk):
        inner = auto_wrap(tiny_gpt(), transformer_auto_wrap_policy({Block}))
    blocks_only = FSDP(inner)  # the root unit without disk_offload
    out["root_in_memory"] = _raises(lambda: blocks_only(x, y))
    disk.close()

    model, optimizer = _disk_model(str(Path(root) / "b"), {"nesting": "block", "optim": "sgd"})
    before = copy.deepcopy(model.state_dict())
    out["step_without_backward"] = _raises(optimizer.step)
    model(x, y)[1].backward()
    optimizer.step()
    out["double_step"] = _raises(optimizer.step)
    out["changed"] = str(any(not torch.equal(before[k], v) for k, v in model.state_dict().items()))
    out["load_state_dict"] = _raises(lambda: model.load_state_dict(before))
    # entry points that would read or write the placeholder shards (a segfault) or
    # return empty optimizer state / a zero norm without clipping: refused
    ckpt = str(Path(root) / "sharded")
    out["local_state_dict"] = _raises(model.local_state_dict)
    out["load_local_state_dict"] = _raises(lambda: model.load_local_state_dict({}))
    out["save_fsdp_sharded"] = _raises(lambda: save_fsdp_sharded(model, ckpt, optimizer))
    out["load_fsdp_sharded"] = _raises(lambda: load_fsdp_sharded(model, ckpt, optimizer))
    out["gather_optim"] = _raises(lambda: model.gather_full_optim_state_dict(optimizer))
    out["shard_optim"] = _raises(lambda: model.get_shard_from_optim_state_dict({}))
    out["clip"] = _raises(lambda: model.clip_grad_norm_(1.0))
    model(x, y)[1].backward()
    out["second_backward"] = _raises(lambda: model(x, y)[1].backward())
    optimizer.tier.close()

    out["hybrid"] = _raises(
        lambda: FSDP(
            tiny_gpt(),
            sharding_strategy="HYBRID_SHARD",
            disk_offload=DiskOffload(str(Path(root) / "c")),
        )
    )
    wider = dataclasses.replace(TINY, n_embd=32)
    out["resume_other_model"] = _raises(
        lambda: wrap_model(
            GPT(wider), "block", disk_offload=DiskOffload(str(Path(root) / "b"), resume=True)
        )
    )
    out["resume_fresh"] = _raises(lambda: DiskOffload(str(Path(root) / "d"), resume=True))
    out["fresh_over_used"] = _raises(lambda: DiskOffload(str(Path(root) / "b")))
    for name, value in (
        ("read_ahead_bytes", -1),
        ("read_ahead_bytes", None),
        ("read_ahead_bytes", 1.5),
        ("read_ahead_bytes", True),
        ("write_behind_bytes", None),
    ):
        kwargs = {name: value}
        out[f"{name}={value!r}"] = _raises(
            lambda kwargs=kwargs: DiskOffload(str(Path(root) / "f"), **kwargs)
        )
    return out


def edited_hyperparameters(root: str) -> dict[str, Any]:
    """SGD on the disk tier built with ``lr`` only; ``momentum`` (not passed) is then set
    in ``param_groups[0]`` and the lr halved by a scheduler: the units' steps must use
    both (they used only the hyperparameters passed to ``disk.optimizer``)."""
    world = dist.get_world_size()
    ref = tiny_gpt()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    disk = DiskOffload(root)
    model = wrap_model(tiny_gpt(), "block", disk_offload=disk)
    optimizer = disk.optimizer(torch.optim.SGD, lr=0.1)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (optimizer, ref_opt)]
    for o in (optimizer, ref_opt):
        o.param_groups[0]["momentum"] = 0.9
    diffs = []
    for step in range(3):
        _step(model, optimizer, step)
        x, y = global_batch(step, world)
        ref(x, y)[1].backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for scheduler in schedulers:
            scheduler.step()
        diffs.append(_state_diff(model, ref))
    disk.close()
    return {"diffs": diffs, "hyper": optimizer.hyperparameters()}


def recover_after_second_backward(root: str) -> dict[str, Any]:
    """Step 0; step 1's backward; a refused second backward; ``optimizer.step()``; step
    2: the parameters must be the plain model's after 3 SGD steps (the refused backward
    left units mid-backward, so step 2's backward stepped nothing)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = tiny_gpt()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    disk = DiskOffload(root)
    model = wrap_model(tiny_gpt(), "block", disk_offload=disk)
    optimizer = disk.optimizer(torch.optim.SGD, lr=0.1)
    _step(model, optimizer, 0)
    x, y = global_batch(1, world)
    model(local_part(x, rank), local_part(y, rank))[1].backward()
    refused = _raises(lambda: model(local_part(x, rank), local_part(y, rank))[1].backward())
    optimizer.step()
    optimizer.zero_grad()
    _step(model, optimizer, 2)
    for step in range(3):
        x, y = global_batch(step, world)
        ref(x, y)[1].backward()
        ref_opt.step()
        ref_opt.zero_grad()
    diff = _state_diff(model, ref)
    disk.close()
    return {"refused": refused, "diff": diff}


def resume_after_raising_backward(root: str) -> dict[str, Any]:
    """Step 0; step 1's backward raises half-way (a NaN check on the first block's output
    gradient, after the last block stepped); ``model.zero_grad()`` refused; the tier
    closed and resumed; step 2: the plain model's after steps 0 and 2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = tiny_gpt()
    ref_opt = torch.optim.SGD(ref.parameters(), **HYPER["sgd"])
    cfg = {"nesting": "block", "optim": "sgd"}
    model, optimizer = _disk_model(root, cfg)
    _step(model, optimizer, 0)
    block = next(m for m in model.modules() if isinstance(m, Block))
    hooked = block.register_forward_hook(_hook_nan_check)
    x, y = global_batch(1, world)
    loss = model(local_part(x, rank), local_part(y, rank))[1]
    hooked.remove()
    raised = _raises(loss.backward)
    refused = _raises(model.zero_grad)
    optimizer.tier.close()
    model, optimizer = _disk_model(root, cfg, resume=True)
    _step(model, optimizer, 2)
    for step in (0, 2):
        x, y = global_batch(step, world)
        ref(x, y)[1].backward()
        ref_opt.step()
        ref_opt.zero_grad()
    diff = _state_diff(model, ref)
    optimizer.tier.close()
    return {"raised": raised, "refused": refused, "diff": diff}


def in_place_io(root: str) -> dict[str, Any]:
    """A two-layer MLP as one FSDP unit on the disk tier, AdamW, three steps: bytes
    through direct I/O's bounce buffers per step, the shard's alignment, and the shard
    memory resident between steps."""
    torch.manual_seed(0)
    disk = DiskOffload(root)
    module = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 128))
    model = FSDP(module, disk_offload=disk)
    optimizer = disk.optimizer(torch.optim.AdamW, lr=1e-3)
    (unit,) = [u for u in units_in(model) if u.handle.infos]
    out: dict[str, Any] = {"bounced": [], "resident_between_steps": []}
    out["aligned"] = unit.handle.local_shard.data_ptr() % direct_io.PAGE == 0
    out["shard_bytes"] = unit.store.nbytes
    for _ in range(3):
        with _bounced_bytes() as bounced:
            model(torch.randn(4, 128)).square().mean().backward()
            optimizer.step()
        out["bounced"].append(bounced[0])
        out["resident_between_steps"].append(buffer_pools()[SHARDS].resident)
    disk.close()
    return out


def accumulated_parity(configs: list[dict[str, Any]], root: str) -> list[dict[str, Any]]:
    """Per config: three steps of two micro-batches, the first inside ``no_sync``,
    against the plain model accumulating both; after each micro-batch, the bytes the
    tier holds (shards and optimizer state read ahead)."""
    return [_accumulated(cfg, f"{root}/{i}") for i, cfg in enumerate(configs)]


def _accumulated(cfg: dict[str, Any], directory: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = tiny_gpt()
    ref_opt = CLASSES[cfg["optim"]](ref.parameters(), **HYPER[cfg["optim"]])
    model, optimizer = _disk_model(directory, cfg)
    disk = optimizer.tier
    out: dict[str, Any] = {"diffs": [], "held_after_no_sync": [], "held_after_step": []}
    for step in range(3):
        for micro in range(2):
            x, y = global_batch(10 * step + micro, world)
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                model(local_part(x, rank), local_part(y, rank))[1].backward()
            if micro == 0:
                out["held_after_no_sync"].append(disk.resident_bytes())
            ref(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        out["held_after_step"].append(disk.resident_bytes())
        out["diffs"].append(_state_diff(model, ref))
    disk.close()
    return out


def zero_grad_after_no_sync(root: str) -> dict[str, float]:
    """A micro-batch inside ``no_sync``, then ``optimizer.zero_grad()`` (a skipped step),
    then a step on another batch: the plain model's parameters after the same (its
    zero_grad drops the micro-batch's gradient); and a second micro-batch accumulated
    and stepped after that, against the plain model accumulating it too."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = tiny_gpt()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER["adamw"])
    model, optimizer = _disk_model(root, {"nesting": "block", "optim": "adamw"})
    diffs = {}
    for what, seeds in (("dropped", (1, 2)), ("kept", (3, 4))):
        for micro, seed in enumerate(seeds):
            x, y = global_batch(seed, world)
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                model(local_part(x, rank), local_part(y, rank))[1].backward()
            ref(x, y)[1].backward()
            if micro == 0 and what == "dropped":
                optimizer.zero_grad()
                ref_opt.zero_grad()
        optimizer.step()
        ref_opt.step()
        ref_opt.zero_grad()
        diffs[what] = _state_diff(model, ref)
    optimizer.tier.close()
    return diffs


def frozen_block(root: str) -> dict[str, list[Any]]:
    """Four AdamW steps, the last block frozen (``requires_grad`` False) in the middle
    two: per step, the bytes the tier holds after it and the state dict's distance from
    the plain model's (frozen alike)."""
    world = dist.get_world_size()
    ref = tiny_gpt()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER["adamw"])
    model, optimizer = _disk_model(root, {"nesting": "block", "optim": "adamw"})
    out: dict[str, list[Any]] = {"held": [], "diffs": []}
    for step in range(4):
        for module in (ref, model):
            for name, param in module.named_parameters():
                param.requires_grad_(step in (0, 3) or not name.startswith("blocks.1."))
        _step(model, optimizer, step)
        x, y = global_batch(step, world)
        ref(x, y)[1].backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["held"].append(optimizer.tier.resident_bytes())
        out["diffs"].append(_state_diff(model, ref))
    optimizer.tier.close()
    return out


def reads_on_training_thread(root: str) -> list[list[str]]:
    """The tiny GPT, one unit per block under the root, AdamW, three steps: per step,
    the files read on the training thread (not prefetched), as ``entry.kind``."""
    model, optimizer = _disk_model(root, {"nesting": "block", "optim": "adamw"})
    store = optimizer.tier.store
    sync: list[str] = []
    read, read_state = store.read, file_backed.read_state

    def spy_read(entry: str, kind: str, flat: torch.Tensor) -> int:
        sync.append(f"{entry}.{kind}")
        return read(entry, kind, flat)

    def spy_state(store_: Any, entry: str, layout: Any, **kwargs: Any) -> Any:
        sync.append(f"{entry}.optim")
        return read_state(store_, entry, layout, **kwargs)

    store.read = spy_read  # type: ignore[method-assign]
    disk_tier.read_state = spy_state  # type: ignore[assignment]
    per_step = []
    try:
        for step in range(3):
            sync.clear()
            _step(model, optimizer, step)
            per_step.append(sorted(sync))
    finally:
        disk_tier.read_state = read_state  # type: ignore[assignment]
    optimizer.tier.close()
    return per_step


def states_read_in_forward(root: str) -> dict[str, Any]:
    """The tiny GPT, one unit per block under the root, AdamW: two steps, then forwards
    of the third step (no_grad, inside no_sync, with grad) under read-ahead budgets of
    0, the last block's state and everything; the bytes the tier holds after each, the
    units' state sizes in the order they stepped, and the parameters after the step
    against the plain model."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = tiny_gpt()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER["adamw"])
    model, optimizer = _disk_model(root, {"nesting": "block", "optim": "adamw"})
    disk = optimizer.tier
    for step in range(2):
        _step(model, optimizer, step)
    sizes = [unit.state_bytes() for unit in disk.step_order]
    x, y = global_batch(2, world)
    x, y = local_part(x, rank), local_part(y, rank)
    out: dict[str, Any] = {"sizes": sizes, "order": [u.entry for u in disk.step_order]}
    with torch.no_grad():
        model(x, y)
    out["no_grad"] = disk.resident_bytes()
    with model.no_sync():
        model(x, y)
    out["no_sync"] = disk.resident_bytes()
    disk.read_ahead_bytes = 0
    model(x, y)
    out["budget_0"] = disk.resident_bytes()
    disk.read_ahead_bytes = sizes[0]
    model(x, y)
    out["budget_first"] = disk.resident_bytes()
    disk.read_ahead_bytes = sum(sizes)
    _, loss = model(x, y)
    out["budget_all"] = disk.resident_bytes()
    loss.backward()
    optimizer.step()
    for step in range(3):
        xs, ys = global_batch(step, world)
        ref(xs, ys)[1].backward()
        ref_opt.step()
        ref_opt.zero_grad()
    out["diff"] = _state_diff(model, ref)
    out["after_step"] = disk.resident_bytes()
    disk.close()
    return out
