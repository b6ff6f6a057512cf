"""FSDP wrapped twice: every checkpoint format has the unwrapped model's keys.

``FSDP(FSDP(m))`` and FairScale's ``FSDP(auto_wrap(m))`` (the policy wrapped the root
already) put a unit around a unit. Before, the keys of the universal checkpoint and of
the FSDP sharded checkpoint were taken from the outer unit's wrapped module as a plain
module, so every key carried ``_fsdp_wrapped_module.`` (``model.state_dict()`` had the
plain keys): such a checkpoint loaded into no other strategy, and a twice-wrapped model
loaded no checkpoint of another strategy.

Checked at 2 ranks: save twice-wrapped -> load into a plain model, DDP, FSDP once and
twice (and once -> twice), parameters and optimizer state exactly the saving run's and
the next step the plain twin's (see ``universal_workers``); for a twice-wrapped model,
the full and local state dicts (``consolidate_shard_weights``),
``gather_full_optim_state_dict`` (and both loaded back with ``load_state_dict`` /
``get_shard_from_optim_state_dict``), ``save_fsdp_sharded`` / ``load_fsdp_sharded`` and
the offline ``inspect`` / ``convert`` against the plain twin.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardkit.checkpoint.reader import consolidate, inspect_checkpoint
from shardkit.nn import FSDP
from shardkit.nn.data_parallel.fully_sharded.sharded_checkpoint import (
    load_fsdp_sharded,
    save_fsdp_sharded,
)
from tests.checkpoint.test_universal_strategies import check
from tests.checkpoint.universal_workers import (
    adamw,
    batch,
    loss_of,
    make_model,
    run_pairs,
    wrap_twice,
)

PAIRS = {
    "fsdp_twice2->plain2": (("seq", "fsdp_twice", 2), ("plain", 2)),
    "fsdp_twice2->ddp2": (("seq", "fsdp_twice", 2), ("ddp", 2)),
    "fsdp_auto_twice2->fsdp2": (("seq", "fsdp_auto_twice", 2), ("fsdp", 2)),
    "fsdp_twice2->fsdp_auto_twice2": (("seq", "fsdp_twice", 2), ("fsdp_auto_twice", 2)),
    "fsdp2->fsdp_twice2": (("seq", "fsdp", 2), ("fsdp_twice", 2)),
    "fsdp_auto_twice2->fsdp_twice1": (("seq", "fsdp_auto_twice", 2), ("fsdp_twice", 1)),
}


@pytest.mark.timeout(300)
def test_twice_wrapped_round_trips(rank_pool: Any, tmp_path: Path) -> None:
    results = rank_pool(2).run(run_pairs, list(PAIRS.values()), str(tmp_path))
    for label, result in zip(PAIRS, results[0]):
        check(result, label)


def _formats_worker(root: str) -> dict[str, Any]:
    """A twice-wrapped model next to its plain twin, two AdamW steps, then every format."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = make_model("seq")
    twin = copy.deepcopy(base)
    twin_opt = adamw(twin.parameters())
    out: dict[str, Any] = {"twin": None}
    for kind in ("fsdp_twice", "fsdp_auto_twice"):
        model = wrap_twice(copy.deepcopy(base), kind, None)
        opt = adamw(model.parameters())
        for step in range(2):
            x, y = batch("seq", step)
            opt.zero_grad()
            loss_of(
                "seq", model, x[rank * 6 : (rank + 1) * 6], y[rank * 6 : (rank + 1) * 6]
            ).backward()
            opt.step()
        got: dict[str, Any] = {"state_dict": model.state_dict()}
        metas = [None, None]
        dist.all_gather_object(metas, (model.local_state_dict(), model.local_metadata_dict()))
        got["consolidated"] = FSDP.consolidate_shard_weights(
            [w for w, _ in metas], [m for _, m in metas]
        )
        got["optim"] = model.gather_full_optim_state_dict(opt)
        path = save_fsdp_sharded(model, f"{root}/{kind}", opt, step=2)
        dist.barrier()
        if rank == 0:
            got["convert"] = consolidate(path.parent)[0]
            got["inspect"] = sorted(p.name for p in inspect_checkpoint(path.parent).params)
        fresh = wrap_twice(make_model("seq"), kind, None)  # another initialisation
        fresh_opt = adamw(fresh.parameters())
        load_fsdp_sharded(fresh, f"{root}/{kind}", fresh_opt)
        got["reloaded"] = fresh.state_dict()
        got["reloaded_optim"] = fresh.gather_full_optim_state_dict(fresh_opt)
        full_optim = [got["optim"]]
        dist.broadcast_object_list(full_optim, src=0)
        again = wrap_twice(make_model("seq"), kind, None)  # the full dicts loaded back
        again_opt = adamw(again.parameters())
        again.load_state_dict(got["state_dict"])
        again_opt.load_state_dict(again.get_shard_from_optim_state_dict(full_optim[0], again_opt))
        got["full_reloaded"] = again.state_dict()
        got["full_reloaded_optim"] = again.gather_full_optim_state_dict(again_opt)
        out[kind] = got
    for step in range(2):
        x, y = batch("seq", step)
        twin_opt.zero_grad()
        loss_of("seq", twin, x, y).backward()
        twin_opt.step()
    out["twin"] = (twin.state_dict(), twin_opt.state_dict())
    return out


def _assert_state_close(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert sorted(got) == sorted(want), (
        f"{what}: keys {list(got)} != the plain model's {list(want)}"
    )
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=1e-5, rtol=1e-4, msg=f"{what} {key}")


def _assert_optim_close(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert sorted(got["state"]) == sorted(want["state"]), f"{what}: parameters with state"
    for index, state in want["state"].items():
        assert sorted(got["state"][index]) == sorted(state), f"{what} {index}: state names"
        for name, value in state.items():
            torch.testing.assert_close(
                got["state"][index][name], value, atol=1e-5, rtol=1e-4, msg=f"{what} {index}"
            )


@pytest.mark.timeout(300)
def test_twice_wrapped_every_format_has_plain_keys(rank_pool: Any, tmp_path: Path) -> None:
    result = rank_pool(2).run(_formats_worker, str(tmp_path))[0]
    twin_sd, twin_opt = result["twin"]
    for kind in ("fsdp_twice", "fsdp_auto_twice"):
        got = result[kind]
        for what in ("state_dict", "consolidated", "convert", "reloaded", "full_reloaded"):
            _assert_state_close(got[what], twin_sd, f"{kind} {what}")
        assert got["inspect"] == sorted(twin_sd), f"{kind}: inspect names {got['inspect']}"
        for what in ("optim", "reloaded_optim", "full_reloaded_optim"):
            _assert_optim_close(got[what], twin_opt, f"{kind} {what}")
