"""The process mesh (issue 18): degrees, coordinates, groups, and the mpu interfaces.

The expected groups are computed here from the layout's definition (``tp`` fastest,
``pp`` slowest), independently of ``ParallelDims.group_ranks``; on spawned ranks the
membership of each created group is read back with an all-reduce over that group.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel

from shardkit.distributed import mpu
from shardkit.distributed.collectives import group_timeout
from shardkit.distributed.mesh import MESH_DIMS, ParallelDims, ProcessMesh


def _coords(rank: int, *degrees: int) -> tuple[int, ...]:
    """Coordinates in ``MESH_DIMS`` order ``(pp, dp_replicate, dp_shard, cp, tp)``."""
    assert len(degrees) == len(MESH_DIMS)
    out = []
    for degree in reversed(degrees[1:]):
        rank, c = divmod(rank, degree)
        out.append(c)
    assert rank < degrees[0]
    return (rank, *reversed(out))


def _expected(world: int, degrees: dict[str, int], dims: tuple[str, ...], rank: int) -> list[int]:
    """Ranks equal to ``rank`` on every coordinate outside ``dims``."""
    args = [degrees[d] for d in MESH_DIMS]
    mine = _coords(rank, *args)
    keep = [i for i, d in enumerate(MESH_DIMS) if d not in dims]
    return [r for r in range(world) if all(_coords(r, *args)[i] == mine[i] for i in keep)]


# pure: degrees and their errors ----------------------------------------------------------
def test_product_error_spells_out_the_equation() -> None:
    with pytest.raises(ValueError) as err:
        ParallelDims(world_size=8, pp=2, dp_shard=3, tp=2)
    msg = str(err.value)
    assert "pp (2) x dp_replicate (1) x dp_shard (3) x tp (2) = 12" in msg
    assert "world size is 8" in msg


def test_inferred_dp_shard_and_its_error() -> None:
    assert ParallelDims(world_size=8, tp=2, pp=2).dp_shard == 2
    assert ParallelDims(world_size=8, tp=2, pp=2).dp == 2
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by .* = 4"):
        ParallelDims(world_size=6, tp=4)
    with pytest.raises(ValueError, match="tp must be >= 1; got 0"):
        ParallelDims(world_size=4, tp=0)


def test_unknown_dimension_is_named() -> None:
    dims = ParallelDims(world_size=4, tp=2)
    with pytest.raises(ValueError, match="unknown mesh dimension 'sp'"):
        dims.group_ranks(["sp"])


def test_mesh_needs_a_process_group() -> None:
    if dist.is_initialized():  # pragma: no cover - tests run without a default group
        pytest.skip("needs an uninitialised default group")
    with pytest.raises(RuntimeError, match="initialised first"):
        ProcessMesh(ParallelDims(world_size=2))


degree = st.sampled_from([1, 2, 3])


@settings(max_examples=60, deadline=None)
@given(pp=degree, dpr=degree, dps=degree, tp=degree, data=st.data())
def test_layout_matches_definition(pp: int, dpr: int, dps: int, tp: int, data: Any) -> None:
    world = pp * dpr * dps * tp
    dims = ParallelDims(world_size=world, pp=pp, dp_replicate=dpr, dp_shard=dps, tp=tp)
    degrees = dict(zip(MESH_DIMS, (pp, dpr, dps, 1, tp), strict=True))
    rank = data.draw(st.integers(0, world - 1))
    coords = dims.coordinates(rank)
    assert tuple(coords.values()) == _coords(rank, pp, dpr, dps, 1, tp)
    assert dims.rank_of(coords) == rank
    for names in (("tp",), ("pp",), ("dp",), ("dp_shard",), ("tp", "pp"), tuple(MESH_DIMS)):
        groups = dims.group_ranks(names)
        # a partition of the world into equal groups
        assert sorted(r for g in groups for r in g) == list(range(world))
        expanded = ("dp_replicate", "dp_shard") if names == ("dp",) else names
        mine = next(g for g in groups if rank in g)
        assert mine == _expected(world, degrees, expanded, rank)
    # tensor-parallel ranks are adjacent
    tp_group = next(g for g in dims.group_ranks(["tp"]) if rank in g)
    assert tp_group == list(range(tp_group[0], tp_group[0] + tp))


# spawned: groups really hold those ranks ---------------------------------------------------
def _members(group: dist.ProcessGroup, world: int) -> list[int]:
    t = torch.zeros(world)
    t[dist.get_rank()] = 1.0
    dist.all_reduce(t, group=group)
    return [int(i) for i in t.nonzero().flatten()]


DIM_SETS: list[tuple[str, ...]] = [
    ("tp",),
    ("pp",),
    ("dp",),
    ("dp_shard",),
    ("tp", "pp"),
    ("cp",),
    ("dp_shard_cp",),
]
#: Group names that stand for several mesh dimensions.
EXPANDED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp")}


def run_mesh_configs(configs: list[dict[str, int]]) -> list[dict[str, Any]]:
    world = dist.get_world_size()
    out = []
    for degrees in configs:
        mesh = ProcessMesh(ParallelDims(world_size=world, **degrees))
        result: dict[str, Any] = {"coords": mesh.coordinates, "groups": {}}
        for dims in DIM_SETS:
            group = mesh.group(*dims)
            result["groups"][dims] = {
                "members": _members(group, world),
                "ranks": mesh.ranks(*dims),
                "group_rank": dist.get_rank(group),
                "local_rank": mesh.local_rank(*dims),
                "size": mesh.size(*dims),
            }
        # without context parallelism the cp-joined groups are the very same groups
        same = mesh.group("dp_cp") is mesh.group("dp")
        same &= mesh.group("dp_shard_cp") is mesh.group("dp_shard")
        result["cp_groups_shared"] = same
        # the groups time out like the default group (the pool's 120 s), not torch's 30 min
        result["timeouts_s"] = {group_timeout(mesh.group(*d)).total_seconds() for d in DIM_SETS}
        mesh.destroy()
        timed = ProcessMesh(
            ParallelDims(world_size=world, **degrees), timeout=timedelta(seconds=90)
        )
        result["given_timeout_s"] = group_timeout(timed.group("tp", "pp")).total_seconds()
        timed.destroy()
        out.append(result)
    return out


def run_mpu(model_parallel_size: int, pipeline_length: int) -> dict[str, Any]:
    world = dist.get_world_size()
    try:
        ProcessMesh(ParallelDims(world_size=2 * world))
    except ValueError as err:
        wrong_world = str(err)
    mpu.initialize_model_parallel(model_parallel_size, pipeline_length)
    try:
        with pytest.raises(RuntimeError, match="already initialized"):
            mpu.initialize_model_parallel(model_parallel_size, pipeline_length)
        unit = mpu.get_mpu()
        return {
            "initialized": mpu.model_parallel_is_initialized(),
            "wrong_world": wrong_world,
            "fs_mp": (
                mpu.get_model_parallel_rank(),
                mpu.get_model_parallel_world_size(),
                _members(mpu.get_model_parallel_group(), world),
                mpu.get_model_parallel_src_rank(),
            ),
            "fs_dp": (
                mpu.get_data_parallel_rank(),
                mpu.get_data_parallel_world_size(),
                _members(mpu.get_data_parallel_group(), world),
            ),
            "fs_pp": (
                _members(mpu.get_pipeline_parallel_group(), world),
                mpu.get_pipeline_parallel_ranks(),
            ),
            "tp": (
                unit.get_tensor_model_parallel_rank(),
                unit.get_tensor_model_parallel_world_size(),
                _members(unit.get_tensor_model_parallel_group(), world),
                unit.get_slice_parallel_world_size(),
            ),
            "pipe": (
                unit.get_pipe_parallel_rank(),
                unit.get_pipe_parallel_world_size(),
                _members(unit.get_pipe_parallel_group(), world),
                unit.is_pipeline_first_stage(),
                unit.is_pipeline_last_stage(),
            ),
            "dp": (
                unit.get_data_parallel_rank(),
                unit.get_data_parallel_world_size(),
                _members(unit.get_data_parallel_group(), world),
            ),
            "mp": (
                unit.get_model_parallel_rank(),
                unit.get_model_parallel_world_size(),
                _members(unit.get_model_parallel_group(), world),
            ),
        }
    finally:
        mpu.destroy_model_parallel()
        assert not mpu.model_parallel_is_initialized()


CONFIGS: dict[int, list[dict[str, int]]] = {
    4: [{"tp": 2}, {"tp": 2, "pp": 2}, {"tp": 4}, {"pp": 2, "dp_replicate": 2}, {"cp": 2}],
    8: [{"tp": 2, "pp": 2, "dp_replicate": 2}, {"tp": 4, "pp": 2}, {"cp": 2, "tp": 2}],
}


@pytest.mark.parametrize("world", [4, 8])
def test_mesh_groups_on_ranks(rank_pool: Any, world: int) -> None:
    per_rank = rank_pool(world).run(run_mesh_configs, CONFIGS[world])
    for i, degrees in enumerate(CONFIGS[world]):
        dims = ParallelDims(world_size=world, **degrees)
        full = {d: getattr(dims, d) for d in MESH_DIMS}
        for rank in range(world):
            result = per_rank[rank][i]
            assert tuple(result["coords"].values()) == _coords(rank, *full.values())
            assert result["cp_groups_shared"] == (dims.cp == 1)
            assert result["timeouts_s"] == {120.0}
            tp_pp_is_world = dims.tp * dims.pp == world
            assert result["given_timeout_s"] == (120.0 if tp_pp_is_world else 90.0)
            for names in DIM_SETS:
                expanded = EXPANDED.get(names[0], names) if len(names) == 1 else names
                want = _expected(world, full, expanded, rank)
                got = result["groups"][names]
                assert got["members"] == want, (degrees, rank, names)
                assert got["ranks"] == want
                assert got["group_rank"] == got["local_rank"] == want.index(rank)
                assert got["size"] == len(want)


@pytest.mark.parametrize(("world", "mp", "pipe"), [(4, 2, 1), (8, 2, 2)])
def test_mpu_interfaces(rank_pool: Any, world: int, mp: int, pipe: int) -> None:
    per_rank = rank_pool(world).run(run_mpu, mp, pipe)
    full = {"pp": pipe, "dp_replicate": 1, "dp_shard": world // (mp * pipe), "cp": 1, "tp": mp}
    for rank, res in enumerate(per_rank):
        p, _, s, _, t = _coords(rank, *full.values())
        tp_group = _expected(world, full, ("tp",), rank)
        dp_group = _expected(world, full, ("dp_replicate", "dp_shard"), rank)
        pp_group = _expected(world, full, ("pp",), rank)
        mp_group = _expected(world, full, ("tp", "pp"), rank)
        assert res["initialized"]
        assert (
            f"ParallelDims is for {2 * world} ranks but the world has {world}" in res["wrong_world"]
        )
        assert res["fs_mp"] == (t, mp, tp_group, tp_group[0])  # FairScale: tp only
        assert res["tp"] == (t, mp, tp_group, mp)
        assert res["fs_dp"] == res["dp"] == (s, world // (mp * pipe), dp_group)
        assert res["fs_pp"] == (pp_group, pp_group)
        assert res["pipe"] == (p, pipe, pp_group, p == 0, p == pipe - 1)
        assert res["mp"] == (mp_group.index(rank), mp * pipe, mp_group)  # Megatron: tp x pp


def run_mpu_fairscale_signature(configs: list[tuple[int, int]]) -> dict[str, Any]:
    refused = []
    for size in (0, 3):  # refused before any group is created, so no rank waits
        try:
            mpu.initialize_model_parallel(1, 1, size)
        except ValueError as err:
            refused.append(str(err))
    assert not mpu.model_parallel_is_initialized()
    world, out = dist.get_world_size(), []
    for mp, cp_size in configs:
        mpu.initialize_model_parallel(
            mp,
            1,
            cp_size,
            model_parallel_backend="gloo",
            pipeline_backend="gloo",
            cp_backend="gloo",
            ddp_backend="gloo",
            timeout=timedelta(seconds=45),
        )
        try:
            cp = mpu.get_context_parallel_group()
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t, group=cp)  # a working group: the sum over its ranks
            unit = mpu.get_mpu()
            out.append(
                {
                    "cp": (
                        mpu.get_context_parallel_world_size(),
                        mpu.get_context_parallel_rank(),
                        mpu.get_context_parallel_ranks(),
                        _members(cp, world),
                        t.item(),
                    ),
                    "unit_cp": (
                        unit.get_context_parallel_world_size(),
                        unit.get_context_parallel_rank(),
                        unit.get_context_parallel_global_ranks(),
                        _members(unit.get_context_parallel_group(), world),
                    ),
                    "dp": (
                        mpu.get_data_parallel_ranks(),
                        _members(mpu.get_data_parallel_group(), world),
                    ),
                    "dp_cp": (
                        unit.get_data_parallel_world_size(with_context_parallel=True),
                        unit.get_data_parallel_rank(with_context_parallel=True),
                        _members(unit.get_data_parallel_group(with_context_parallel=True), world),
                    ),
                    "mp": _members(mpu.get_model_parallel_group(), world),
                }
            )
        finally:
            mpu.destroy_model_parallel()
    return {"refused": refused, "configs": out}


def _fairscale_groups(world: int, mp: int, cp: int, rank: int) -> dict[str, list[int]]:
    """FairScale 0.4.13's groups of ``rank`` with one pipeline stage: the ranks laid out
    as ``arange(world).reshape(dp, 1, cp, mp)``; a context-parallel group is
    ``groups[i, 0, :, k]``, a data-parallel one ``groups[:, 0, c, k]``."""
    grid = torch.arange(world).reshape(world // (cp * mp), cp, mp)
    i, c, k = (int(x[0]) for x in torch.where(grid == rank))
    return {"cp": grid[i, :, k].tolist(), "dp": grid[:, c, k].tolist(), "mp": grid[i, c].tolist()}


def test_mpu_takes_fairscales_full_signature_with_context_parallel(rank_pool: Any) -> None:
    configs = [(2, 1), (2, 2), (1, 2)]  # (model_parallel_size_, context_parallel_size)
    per_rank = rank_pool(4).run(run_mpu_fairscale_signature, configs)
    for rank, res in enumerate(per_rank):
        msg0, msg3 = res["refused"]
        assert "context_parallel_size must be >= 1; got 0" in msg0
        assert "cp (3) must divide the world size (4)" in msg3
        for (mp, cp), got in zip(configs, res["configs"], strict=True):
            want = _fairscale_groups(4, mp, cp, rank)
            cp_rank = want["cp"].index(rank)
            summed = float(sum(r + 1 for r in want["cp"]))
            assert got["cp"] == (cp, cp_rank, want["cp"], want["cp"], summed), (mp, cp, rank)
            assert got["unit_cp"] == (cp, cp_rank, want["cp"], want["cp"]), (mp, cp, rank)
            assert got["dp"] == (want["dp"], want["dp"]), (mp, cp, rank)
            dp_cp = [r for r in range(4) if r % mp == rank % mp]  # all but the tp split
            assert got["dp_cp"] == (4 // mp, dp_cp.index(rank), dp_cp), (mp, cp, rank)
            assert got["mp"] == want["mp"], (mp, cp, rank)


# expert parallelism: ep splits dp_shard -----------------------------------------------------
def test_ep_groups_for_a_few_shapes() -> None:
    # 8 ranks, dp_shard 8, ep 4: ep groups of 4 consecutive ranks, edp across them
    dims = ParallelDims(world_size=8, ep=4)
    assert dims.dp_shard == 8 and dims.edp == 2 and dims.degree("ep") == 4
    assert dims.group_ranks(["ep"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.group_ranks(["edp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # tp innermost: ep groups step over the tensor-parallel ranks
    dims = ParallelDims(world_size=8, tp=2, ep=2)
    assert dims.group_ranks(["ep"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.group_ranks(["edp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.group_ranks(["dp_shard"]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # hybrid: edp spans the replicas and the dp_shard / ep blocks
    dims = ParallelDims(world_size=8, dp_replicate=2, dp_shard=4, ep=2)
    assert dims.group_ranks(["ep"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.group_ranks(["edp"]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.degree("edp") == dims.edp == 4
    # ep = dp_shard: edp is the replica group
    dims = ParallelDims(world_size=4, dp_replicate=2, ep=2)
    assert dims.group_ranks(["edp"]) == dims.group_ranks(["dp_replicate"]) == [[0, 2], [1, 3]]


def test_ep_one_changes_nothing() -> None:
    dims = ParallelDims(world_size=8, tp=2, pp=2)
    assert dims.group_ranks(["ep"]) == [[r] for r in range(8)]
    assert dims.group_ranks(["edp"]) == dims.group_ranks(["dp"])
    assert tuple(dims.coordinates(5)) == MESH_DIMS


def test_ep_bad_inputs_name_the_values() -> None:
    with pytest.raises(ValueError, match=r"ep \(3\) must divide dp_shard \(4\)"):
        ParallelDims(world_size=8, tp=2, ep=3)
    with pytest.raises(ValueError, match=r"ep \(8\) must divide dp_shard \(2\).*divisors of 2"):
        ParallelDims(world_size=4, tp=2, ep=8)
    with pytest.raises(ValueError, match="ep must be >= 1; got 0"):
        ParallelDims(world_size=4, ep=0)
    with pytest.raises(ValueError, match="unknown mesh dimension 'expert'"):
        ParallelDims(world_size=4, ep=2).group_ranks(["expert"])


@settings(max_examples=60, deadline=None)
@given(pp=degree, dpr=degree, mod=degree, ep=st.sampled_from([1, 2, 4]), tp=degree)
def test_ep_and_edp_partition_the_data_parallel_ranks(
    pp: int, dpr: int, mod: int, ep: int, tp: int
) -> None:
    world = pp * dpr * mod * ep * tp
    dims = ParallelDims(world_size=world, pp=pp, dp_replicate=dpr, dp_shard=mod * ep, tp=tp, ep=ep)
    shard_of = {r: g for g in dims.group_ranks(["dp_shard"]) for r in g}
    ep_of = {r: g for g in dims.group_ranks(["ep"]) for r in g}
    edp_of = {r: g for g in dims.group_ranks(["edp"]) for r in g}
    for dp_group in dims.group_ranks(["dp"]):
        for rank in dp_group:
            eg, edg = ep_of[rank], edp_of[rank]
            assert len(eg) == ep and len(edg) == dpr * mod
            # ep: consecutive coordinates inside this rank's dp_shard group
            shard = shard_of[rank]
            idx = [shard.index(r) for r in eg]
            assert idx == list(range(idx[0], idx[0] + ep)) and idx[0] % ep == 0
            # edp: the ranks at the same place of every ep group of the dp group
            assert edg == sorted(g[eg.index(rank)] for g in {tuple(ep_of[r]) for r in dp_group})
            assert set(eg) & set(edg) == {rank}
        # ep x edp covers the dp group exactly once
        pairs = {(tuple(ep_of[r]), tuple(edp_of[r])) for r in dp_group}
        assert len(pairs) == len(dp_group) == dims.dp


def run_ep_groups(configs: list[dict[str, int]]) -> list[dict[str, Any]]:
    world = dist.get_world_size()
    out = []
    for degrees in configs:
        mesh = ProcessMesh(ParallelDims(world_size=world, **degrees))
        result = {}
        for name in ("ep", "edp", "dp"):
            group = mesh.group(name)
            result[name] = (
                _members(group, world),
                mesh.ranks(name),
                dist.get_rank(group),
                mesh.local_rank(name),
                mesh.size(name),
            )
        mesh.destroy()
        out.append(result)
    return out


def test_ep_groups_on_ranks(rank_pool: Any) -> None:
    configs = [{"ep": 2}, {"ep": 4}, {"dp_replicate": 2, "ep": 2}, {"tp": 2, "ep": 2}]
    per_rank = rank_pool(4).run(run_ep_groups, configs)
    for i, degrees in enumerate(configs):
        dims = ParallelDims(world_size=4, **degrees)
        for rank in range(4):
            for name in ("ep", "edp", "dp"):
                want = next(g for g in dims.group_ranks([name]) if rank in g)
                members, ranks, group_rank, local_rank, size = per_rank[rank][i][name]
                assert members == ranks == want, (degrees, rank, name)
                assert group_rank == local_rank == want.index(rank)
                assert size == len(want) == dims.degree(name)


# context parallelism: a dimension between dp_shard and tp (torchtitan's layout) ----------
def test_cp_group_ranks() -> None:
    dims = ParallelDims(world_size=8, cp=2, tp=2)  # dp_shard inferred: 2
    assert dims.dp_shard == 2 and dims.degrees == (1, 1, 2, 2, 2)
    assert dims.coordinates(5) == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 1}
    assert dims.group_ranks(["tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.group_ranks(["cp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.group_ranks(["dp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # the data-parallel gradient reduction spans dp_shard x cp
    assert dims.group_ranks(["dp_shard_cp"]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.group_ranks(["dp_cp"]) == dims.group_ranks(["dp_shard_cp"])
    assert dims.degree("dp_shard_cp") == dims.dp_shard_cp == 4 and dims.dp == 2
    # hybrid: dp_cp spans the replicas too; dp_shard_cp does not
    dims = ParallelDims(world_size=8, dp_replicate=2, cp=2)
    assert dims.group_ranks(["dp_shard_cp"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.group_ranks(["dp_cp"]) == [list(range(8))]
    assert dims.group_ranks(["cp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # with experts: ep still splits dp_shard; cp stays its own dimension
    dims = ParallelDims(world_size=8, cp=2, ep=2)
    assert dims.group_ranks(["ep"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.group_ranks(["cp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_cp_one_changes_nothing() -> None:
    for degrees in ({"tp": 2, "pp": 2}, {"dp_replicate": 2, "tp": 2}, {"tp": 2, "ep": 2}):
        dims = ParallelDims(world_size=8, **degrees)
        assert dims.cp == 1 and dims.degrees[MESH_DIMS.index("cp")] == 1
        assert dims.group_ranks(["cp"]) == [[r] for r in range(8)]
        assert dims.group_ranks(["dp_shard_cp"]) == dims.group_ranks(["dp_shard"])
        assert dims.group_ranks(["dp_cp"]) == dims.group_ranks(["dp"])


def test_cp_bad_inputs_name_the_values() -> None:
    with pytest.raises(ValueError, match=r"cp \(3\) must divide the world size \(8\)"):
        ParallelDims(world_size=8, cp=3)
    with pytest.raises(ValueError, match="cp must be >= 1; got 0"):
        ParallelDims(world_size=4, cp=0)
    with pytest.raises(
        ValueError, match=r"world size 4 is not divisible .* x cp \(2\) x tp \(4\) = 8"
    ):
        ParallelDims(world_size=4, cp=2, tp=4)
    with pytest.raises(
        ValueError, match=r"dp_shard \(2\) x cp \(2\) x tp \(1\) = 4, but the world"
    ):
        ParallelDims(world_size=8, dp_shard=2, cp=2)


def run_use_after_destroy(world: int) -> dict[str, Any]:
    """Regression: after ``mesh.destroy()`` a lone ``mesh.group()`` (here rank 0's mpu
    view) made new groups, a collective of the whole world that the other ranks never
    entered: rank 0 waited until the timeout (on 4 ranks; on 2 the groups have one rank
    and nothing waits) and its peers in their next collective. Now it raises at once.
    A torch DDP built on a mesh group is alive during ``destroy`` (which returns at
    once), and both ranks meet in a world all-reduce afterwards (no hang)."""
    torch.set_num_threads(1)
    mesh = ProcessMesh(ParallelDims(world_size=world, tp=2), timeout=timedelta(seconds=10))
    model = DistributedDataParallel(torch.nn.Linear(3, 3), process_group=mesh.group("dp"))
    model(torch.ones(2, 3)).sum().backward()
    mesh.destroy()
    mesh.destroy()  # idempotent
    refused = ""
    if dist.get_rank() == 0:
        try:
            mpu.ModelParallelUnit(mesh).get_data_parallel_group()
        except RuntimeError as e:
            refused = str(e)
    total = torch.ones(1)
    dist.all_reduce(total)
    del model
    return {"refused": refused, "total": float(total), "tp_ranks": mesh.ranks("tp")}


def test_a_destroyed_mesh_refuses_groups_without_a_collective(rank_pool: Any) -> None:
    first, second = rank_pool(2).run(run_use_after_destroy, 2, timeout_s=30)
    assert "was destroyed (ProcessMesh.destroy())" in first["refused"], first
    assert "build a new ProcessMesh" in first["refused"], first
    assert second["refused"] == ""  # rank 1 did not ask
    assert first["total"] == second["total"] == 2.0
    assert first["tp_ranks"] == second["tp_ranks"] == [0, 1]  # no collective: still answers
