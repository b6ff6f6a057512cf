"""Flat layout and checkpoint re-sharding invariants (pure functions, hypothesis)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.checkpoint.legacy.flat import read_flat_range
from shardkit.nn.data_parallel.fully_sharded import FlatLayout

numels = st.lists(st.integers(0, 40), min_size=0, max_size=6)
worlds = st.integers(1, 5)


@settings(max_examples=60, deadline=None)
@given(numels, worlds)
def test_every_element_owned_by_exactly_one_rank(sizes: list[int], world: int) -> None:
    layout = FlatLayout(tuple(sizes), world)
    assert layout.padded - layout.total < world  # padding at most N - 1
    for index, n in enumerate(sizes):
        owned = []
        for rank in range(world):
            a, b = layout.piece(index, rank)
            lo, _ = layout.shard_range(rank)
            owned.extend(range(lo + a, lo + b))
        start = layout.offsets[index]
        assert owned == list(range(start, start + n))


@settings(max_examples=60, deadline=None)
@given(numels, worlds)
def test_shard_then_gather_is_identity(sizes: list[int], world: int) -> None:
    layout = FlatLayout(tuple(sizes), world)
    flat = torch.arange(layout.total, dtype=torch.float32)
    padded = torch.cat([flat, flat.new_zeros(layout.padded - layout.total)])
    shards = [padded[slice(*layout.shard_range(r))] for r in range(world)]
    gathered = torch.cat(shards)[: layout.total]
    assert torch.equal(gathered, flat)
    for index, n in enumerate(sizes):
        pieces = [shards[r][slice(*layout.piece(index, r))] for r in range(world)]
        start = layout.offsets[index]
        assert torch.equal(torch.cat(pieces), flat[start : start + n])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 50), worlds, worlds)
def test_read_flat_range_reshards_to_any_world_size(total: int, old: int, new: int) -> None:
    old_layout, new_layout = FlatLayout((total,), old), FlatLayout((total,), new)
    flat = torch.arange(total, dtype=torch.float32)
    padded = torch.cat([flat, flat.new_zeros(old_layout.padded - total)])
    shards = [padded[slice(*old_layout.shard_range(r))] for r in range(old)]
    parts = []
    for rank in range(new):
        lo, hi = new_layout.shard_range(rank)
        parts.append(
            read_flat_range(shards, old_layout.shard_numel, min(lo, total), min(hi, total))
        )
    assert torch.equal(torch.cat(parts), flat)


def test_old_checkpoint_import_path_still_works() -> None:
    from shardkit.checkpoint import fsdp as old
    from shardkit.nn.data_parallel import fully_sharded

    assert old.save_fsdp_sharded is fully_sharded.save_fsdp_sharded
    assert old.load_fsdp_sharded is fully_sharded.load_fsdp_sharded


shapes_lists = st.lists(
    st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=5
)


@given(shapes_lists, st.integers(1, 5))
@settings(max_examples=60, deadline=None)
def test_shard_shapes_tile_each_shard_with_whole_rows(
    shapes: list[tuple[int, ...]], world: int
) -> None:
    """The compressor's view of a shard: pieces adding up to S, matrices of whole rows."""
    from shardkit.nn.data_parallel.fully_sharded.flat_param import FlatParamHandle, ParamInfo

    infos = [ParamInfo(torch.Size(s), True) for s in shapes]
    flat = torch.arange(sum(i.numel for i in infos), dtype=torch.float32)
    row_lengths = {i.numel // i.shape[0] for i in infos if len(i.shape) >= 2 and i.shape[0]}
    for rank in range(world):
        handle = FlatParamHandle(infos, flat, rank, world)
        pieces = handle.shard_shapes()
        assert sum(torch.Size(p).numel() for p in pieces) == handle.layout.shard_numel
        assert all(p[1] in row_lengths for p in pieces if len(p) == 2)
    full = FlatParamHandle(infos, flat, 0, world).flat_shapes()
    assert (
        sum(torch.Size(p).numel() for p in full)
        == FlatLayout(tuple(i.numel for i in infos), world).padded
    )
