"""Merging the shards of a sharded optimizer's state into one plain state dict.

A sharded optimizer (ZeRO stage 1/2: ``shardkit.optim.OSS``) keeps on each rank the
state of the parameters it owns; ``OSS.consolidate_state_dict`` gathers every rank's
shard ``{"rank", "world_size", "param_groups", "state": {global index: {...}}}`` and
:func:`merge_optimizer_shards` puts them together. Global indices are those of a plain
``torch.optim.Optimizer.state_dict()``: the position of the parameter in the
concatenation of the param groups.

Sharded checkpoints of an optimizer are universal checkpoints
(``OSS.save_sharded`` / ``load_sharded``); the files of the previous release's format
are read by :mod:`shardkit.checkpoint.legacy` only, to convert them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["merge_optimizer_shards"]


def merge_optimizer_shards(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge per-rank shards into one plain ``torch.optim`` state dict.

    Raises:
        ValueError: if no shard is given, the shards disagree on their param groups or
            world size, a rank is missing or doubled, or two shards hold the state of
            the same parameter.
    """
    if not shards:
        raise ValueError("no optimizer shards to merge")
    world_size = shards[0]["world_size"]
    ranks = sorted(s["rank"] for s in shards)
    if ranks != list(range(world_size)):
        raise ValueError(
            f"shards saved at world size {world_size} must hold ranks 0..{world_size - 1}; "
            f"found ranks {ranks}: a file is missing or left over from another save"
        )
    groups = shards[0]["param_groups"]
    state: dict[int, Any] = {}
    for shard in shards:
        if [g["params"] for g in shard["param_groups"]] != [g["params"] for g in groups]:
            raise ValueError(
                f"shard of rank {shard['rank']} has other param groups than rank "
                f"{shards[0]['rank']}: the files come from different saves"
            )
        overlap = sorted(set(state) & set(shard["state"]))
        if overlap:
            raise ValueError(
                f"parameters {overlap[:5]} have state in more than one shard "
                f"(second: rank {shard['rank']}); the files come from different saves"
            )
        state.update(shard["state"])
    return {"state": state, "param_groups": groups}
