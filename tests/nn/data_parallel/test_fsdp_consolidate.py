"""Offline consolidation of local state dicts (pure tensors, no process group).

Synthetic units are sharded exactly as FSDP shards them (``FlatLayout``); merging every
rank's shard with the metadata must give back each original parameter under each of its
names, for any shapes and world sizes, including empty parameters and sizes not
divisible by the world size.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardkit.nn.data_parallel.fully_sharded.consolidate import (
    clean_path,
    consolidate_shard_weights,
    local_metadata,
)
from shardkit.nn.data_parallel.fully_sharded.flat_param import (
    FlatLayout,
    ParamInfo,
    ParamLocation,
)

# a parameter: its shape and how many other names it has (tied aliases)
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
params = st.lists(st.tuples(shapes, st.integers(0, 2)), min_size=0, max_size=4)
units_st = st.lists(params, min_size=1, max_size=3)
worlds = st.integers(1, 5)

UNIT_PATHS = ["", "blocks.0", "blocks.1.mlp"]
WRAPPED = "_fsdp_wrapped_module."


class Model:
    """Synthetic units, their original tensors and every rank's local state dict."""

    def __init__(self, spec: list[list[tuple[tuple[int, ...], int]]], world: int) -> None:
        torch.manual_seed(0)
        self.world = world
        self.units: dict[str, tuple[list[ParamInfo], FlatLayout]] = {}
        self.flats: dict[str, torch.Tensor] = {}
        self.expected: dict[str, torch.Tensor] = {}
        self.aliases: list[list[str]] = []
        holder = nn.Module()
        for path, unit in zip(UNIT_PATHS, spec):
            key = f"{path}.flat_param" if path else "flat_param"
            infos = []
            for index, (shape, tied) in enumerate(unit):
                info = ParamInfo(torch.Size(shape), True)
                for alias in range(tied + 1):
                    info.locations.append(ParamLocation(holder, "w", f"m{index}.a{alias}.weight"))
                infos.append(info)
            layout = FlatLayout(tuple(i.numel for i in infos), world)
            flat = torch.randn(layout.total)
            self.units[key], self.flats[key] = (infos, layout), flat
            for info, start in zip(infos, layout.offsets):
                value = flat[start : start + info.numel].view(info.shape)
                names = [f"{path}.{loc.name}" if path else loc.name for loc in info.locations]
                self.expected.update(dict.fromkeys(names, value))
                self.aliases.append(names)
        self.buffers = {"bn.running_mean": torch.randn(3), "blocks.0.count": torch.tensor(7)}
        self.expected.update(self.buffers)

    def local_state_dict(self, rank: int) -> dict[str, torch.Tensor]:
        out = {}
        for key, (_, layout) in self.units.items():
            padded = torch.zeros(layout.padded)
            padded[: layout.total] = self.flats[key]
            out[key] = padded[slice(*layout.shard_range(rank))].clone()
        for name, value in self.buffers.items():  # rank 1.. hold other values: rank 0's win
            out[_wrapped(name)] = value.clone() if rank == 0 else value + 1
        return out

    def metadata(self, rank: int) -> dict[str, Any]:
        return local_metadata(self.units, [_wrapped(n) for n in self.buffers], rank)

    def saved(self) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, Any]]]:
        ranks = range(self.world)
        return [self.local_state_dict(r) for r in ranks], [self.metadata(r) for r in ranks]


def _wrapped(name: str) -> str:
    """The key of a buffer in a local state dict (wrapper segments inside)."""
    return WRAPPED + name.replace("blocks.0.", f"blocks.0.{WRAPPED}")


def _assert_same(out: dict[str, torch.Tensor], model: Model) -> None:
    assert set(out) == set(model.expected)
    for name, value in model.expected.items():
        assert out[name].shape == value.shape, name
        assert torch.equal(out[name], value), name
    for names in model.aliases:  # tied parameters: one tensor under each name
        assert all(out[name] is out[names[0]] for name in names)


@settings(max_examples=80, deadline=None)
@given(units_st, worlds, st.randoms(use_true_random=False))
def test_shard_then_consolidate_is_identity(spec: Any, world: int, rng: random.Random) -> None:
    model = Model(spec, world)
    weights, metadata = model.saved()
    _assert_same(consolidate_shard_weights(weights, metadata), model)
    # any order of ranks, and metadata that went through JSON
    order = list(range(world))
    rng.shuffle(order)
    as_json = [json.loads(json.dumps(metadata[r])) for r in order]
    _assert_same(consolidate_shard_weights([weights[r] for r in order], as_json), model)


@settings(max_examples=40, deadline=None)
@given(units_st, worlds)
def test_metadata_padding_and_sizes_follow_the_layout(spec: Any, world: int) -> None:
    model = Model(spec, world)
    for rank in range(world):
        metadata = model.metadata(rank)
        assert metadata["rank"] == rank and metadata["world_size"] == world
        for unit, (key, (infos, layout)) in zip(metadata["param_metadata"], model.units.items()):
            entry = unit["params"]["flat_param"]
            assert unit["shard_numel"] == layout.shard_numel and unit["world_size"] == world
            assert entry["numels"] == [i.numel for i in infos]
            assert entry["shapes"] == [list(i.shape) for i in infos]
            assert key == (f"{unit['fsdp_path']}.flat_param" if unit["fsdp_path"] else "flat_param")
            kept = layout.shard_numel - entry["padding"]
            assert torch.equal(
                model.local_state_dict(rank)[key][:kept],
                model.flats[key][slice(*layout.shard_range(rank))][:kept],
            )
    for index, (_, layout) in enumerate(model.units.values()):  # what N * S adds, < N
        metadata = [model.metadata(r)["param_metadata"][index] for r in range(world)]
        pads = [m["params"]["flat_param"]["padding"] for m in metadata]
        assert sum(pads) == layout.padded - layout.total < world


def test_metadata_is_plain_data_with_fairscales_keys() -> None:
    model = Model([[((4, 3), 1), ((5,), 0)], [((2, 2), 0)]], 3)
    metadata = model.metadata(2)
    assert json.loads(json.dumps(metadata)) == metadata
    root, block = metadata["param_metadata"]
    assert root["fsdp_path"] == "" and block["fsdp_path"] == "blocks.0"
    assert root["params"]["flat_param"] == {
        "names": ["m0.a0.weight", "m1.a0.weight"],
        "shapes": [[4, 3], [5]],
        "numels": [12, 5],
        "padding": 1,  # 17 elements, S = 6: rank 2 holds [12, 18)
    }
    assert root["shared_param_info"] == [["m0.a0.weight", "m0.a1.weight"]]
    assert block["params"]["flat_param"]["names"] == ["m0.a0.weight"]  # relative to the unit
    assert metadata["buffer_names"] == ["bn.running_mean", "blocks.0.count"]
    assert clean_path(metadata["buffer_keys"][1]) == "blocks.0.count"


def test_buffers_are_rank_zeros_and_optional() -> None:
    model = Model([[((3,), 0)]], 2)
    weights, metadata = model.saved()
    out = consolidate_shard_weights(weights, metadata)
    assert torch.equal(out["bn.running_mean"], model.buffers["bn.running_mean"])
    out = consolidate_shard_weights(weights, metadata, with_module_buffers=False)
    assert set(out) == {"m0.a0.weight"}
    without = [{k: v for k, v in w.items() if "flat_param" in k} for w in weights]
    assert set(consolidate_shard_weights(without, metadata, with_module_buffers=False)) == {
        "m0.a0.weight"
    }


def test_empty_unit_and_empty_parameters() -> None:
    model = Model([[], [((0, 4), 0), ((), 0), ((0,), 1)]], 4)
    weights, metadata = model.saved()
    out = consolidate_shard_weights(weights, metadata)
    assert out["blocks.0.m0.a0.weight"].shape == (0, 4)
    assert out["blocks.0.m1.a0.weight"].shape == ()
    _assert_same(out, model)


def test_fairscale_metadata_merges() -> None:
    """FairScale's format: no rank / world_size / buffer_keys, tuples and torch.Size."""
    flat = torch.arange(5.0)  # 5 elements on 4 ranks: S = 2, padding 0, 0, 1, 2
    shards = [torch.tensor([0.0, 1.0]), torch.tensor([2.0, 3.0]), torch.tensor([4.0, 0.0])]
    shards.append(torch.zeros(2))
    weights, metadata = [], []
    for rank, pad in enumerate([0, 0, 1, 2]):
        weights.append({"layer.flat_param_0": shards[rank], "layer.b": torch.ones(1)})
        entry = {"names": ["w", "v"], "shapes": [torch.Size([2, 2]), torch.Size([1])]}
        entry.update(numels=[4, 1], padding=pad)
        unit = {"fsdp_path": "layer", "params": {"flat_param_0": entry}}
        unit.update(no_broadcast_optim_state=False, shared_param_info=[("w", "u")])
        metadata.append({"param_metadata": [unit], "buffer_names": ["layer.b"]})
    out = consolidate_shard_weights(weights, metadata)
    assert torch.equal(out["layer.w"], flat[:4].view(2, 2)) and out["layer.u"] is out["layer.w"]
    assert torch.equal(out["layer.v"], flat[4:]) and torch.equal(out["layer.b"], torch.ones(1))


# errors ------------------------------------------------------------------------------


def test_ranks_missing_repeated_or_lists_of_other_lengths() -> None:
    weights, metadata = Model([[((7,), 0)]], 3).saved()
    with pytest.raises(ValueError, match=r"world size 3 but 2 were given.*missing ranks \[1\]"):
        consolidate_shard_weights([weights[0], weights[2]], [metadata[0], metadata[2]])
    with pytest.raises(ValueError, match=r"ranks \[0, 0, 2\].*repeated ranks \[0\]"):
        consolidate_shard_weights(weights, [metadata[0], metadata[0], metadata[2]])
    with pytest.raises(ValueError, match="3 shard weights and 2 metadata"):
        consolidate_shard_weights(weights, metadata[:2])
    with pytest.raises(ValueError, match="at least one shard"):
        consolidate_shard_weights([], [])


def test_world_sizes_disagree() -> None:
    weights2, metadata2 = Model([[((7,), 0)]], 2).saved()
    weights3, metadata3 = Model([[((7,), 0)]], 3).saved()
    with pytest.raises(ValueError, match=r"disagree on the world size: \[2, 3, 3\]"):
        consolidate_shard_weights([weights2[0], *weights3[1:]], [metadata2[0], *metadata3[1:]])


def test_key_mismatch_names_rank_and_keys() -> None:
    weights, metadata = Model([[((7,), 0)], [((3,), 0)]], 2).saved()
    weights[1] = dict(weights[1])
    del weights[1]["blocks.0.flat_param"]
    weights[1]["stray"] = torch.zeros(1)
    with pytest.raises(
        KeyError, match=r"rank 1: missing \['blocks.0.flat_param'\], unexpected \['stray'\]"
    ):
        consolidate_shard_weights(weights, metadata)
    # not strict: a unit on some ranks only is still an error, naming the ranks
    with pytest.raises(KeyError, match=r"ranks \[0\] but not of ranks \[1\]"):
        consolidate_shard_weights(weights, metadata, strict=False)
    # not strict: a unit absent from every rank's weights is left out
    del weights[0]["blocks.0.flat_param"]
    out = consolidate_shard_weights(weights, metadata, strict=False)
    assert "m0.a0.weight" in out and "blocks.0.m0.a0.weight" not in out


def test_shard_of_wrong_length_or_other_wrapping() -> None:
    weights, metadata = Model([[((7,), 0)]], 2).saved()
    weights[1] = {**weights[1], "flat_param": torch.zeros(5)}
    with pytest.raises(ValueError, match=r"`flat_param` of rank 1 has shape \(5,\).*\(4,\)"):
        consolidate_shard_weights(weights, metadata)
    weights, metadata = Model([[((7,), 0)]], 2).saved()
    _, other = Model([[((6,), 0)]], 2).saved()
    with pytest.raises(ValueError, match="rank 1's metadata describe another model"):
        consolidate_shard_weights(weights, [metadata[0], other[1]])


def test_metadata_builder_errors() -> None:
    info = ParamInfo(torch.Size([3]), True, [ParamLocation(nn.Module(), "w", "w")])
    with pytest.raises(ValueError, match="different world sizes"):
        local_metadata(
            {"a.flat_param": ([info], FlatLayout((3,), 2)), "flat_param": ([], FlatLayout((), 3))},
            [],
            0,
        )
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 2\)"):
        local_metadata({"flat_param": ([info], FlatLayout((3,), 2))}, [], 2)
    with pytest.raises(ValueError, match=r"have \[3\] elements but its layout \[4\]"):
        local_metadata({"flat_param": ([info], FlatLayout((4,), 2))}, [], 0)
