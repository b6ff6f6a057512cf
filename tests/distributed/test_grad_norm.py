"""``clip_grad_norm_sharded`` equals ``torch.nn.utils.clip_grad_norm_`` on the whole model.

One process: any shapes (empty ones too) and norm types. Several ranks: every
parameter's gradient split into contiguous pieces, one per rank, some of them empty
(a rank holding no element of a parameter, as FSDP's flat shards do for almost every
model); the returned norm and the clipped gradients equal torch's on every rank.
Regression: ``norm_type=inf`` raised "cannot compute the inf norm on an empty tensor".
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.distributed.grad_norm import clip_grad_norm_sharded, held_outside
from shardkit.distributed.shard_descriptor import Split, TensorView

NORM_TYPES = [1.0, 2.0, 3.5, math.inf]

shapes = st.lists(
    st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple), min_size=0, max_size=5
)


def _params(shape_list: list[tuple[int, ...]], seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in shape_list:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=g) * 3
        params.append(p)
    return params


def torch_clip(params: list[torch.nn.Parameter], max_norm: float, norm_type: float) -> torch.Tensor:
    """torch's clip over the non-empty parameters (torch refuses the inf norm when any
    parameter is empty, even beside others; an empty one adds nothing to any norm)."""
    nonempty = [p for p in params if p.numel()]
    if not nonempty:
        return torch.zeros(())
    return torch.nn.utils.clip_grad_norm_(nonempty, max_norm, norm_type)


@settings(max_examples=80, deadline=None)
@given(
    shape_list=shapes,
    norm_type=st.sampled_from(NORM_TYPES),
    max_norm=st.floats(1e-3, 20.0),
    seed=st.integers(0, 2**16),
)
def test_one_process_matches_torch(
    shape_list: list[tuple[int, ...]], norm_type: float, max_norm: float, seed: int
) -> None:
    mine, ref = _params(shape_list, seed), _params(shape_list, seed)
    got = clip_grad_norm_sharded(mine, max_norm, norm_type)
    want = torch_clip(ref, max_norm, norm_type)
    assert got.shape == ()
    assert abs(float(got) - float(want)) <= 1e-5 * max(1.0, float(want))
    for a, b in zip(mine, ref):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_one_process_empty_parameter_among_others(norm_type: float) -> None:
    """The shape FSDP gives a rank: a real piece next to an empty one."""
    mine, ref = _params([(0,), (3, 2), (0, 4)], 1), _params([(0,), (3, 2), (0, 4)], 1)
    got = clip_grad_norm_sharded(mine, 0.1, norm_type)
    want = torch_clip(ref, 0.1, norm_type)
    assert float(want) > 0.1  # clipping is active
    assert abs(float(got) - float(want)) <= 1e-6 * float(want)
    torch.testing.assert_close(mine[1].grad, ref[1].grad, atol=0.0, rtol=1e-6)


# shapes of the multi-rank cases; each rank cuts every gradient at random points
CASES: list[list[tuple[int, ...]]] = [
    [(4, 3), (2,), (7,), (1,)],
    [(1,), (5, 5), (0,), (3,)],
    [(2, 2), (1, 1), (9,), (2,)],
    [(1,), (1,), (1,), (1,)],
]


def _cuts(numel: int, world: int, g: torch.Generator) -> list[int]:
    """``world + 1`` sorted cut points in ``[0, numel]``: rank r holds ``[c[r], c[r+1])``."""
    inner = sorted(torch.randint(0, numel + 1, (world - 1,), generator=g).tolist())
    return [0, *inner, numel]


def sharded_clip_cases(cases: list[list[tuple[int, ...]]], norm_types: list[float]) -> list[Any]:
    """Rank-side: every case with every norm type; each rank clips its own pieces."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for index, shape_list in enumerate(cases):
        for norm_type in norm_types:
            full = _params(shape_list, seed=index)
            g = torch.Generator().manual_seed(100 + index)
            cuts = [_cuts(p.numel(), world, g) for p in full]
            pieces = []
            for p, c in zip(full, cuts):
                piece = torch.nn.Parameter(torch.zeros(c[rank + 1] - c[rank]))
                assert p.grad is not None
                piece.grad = p.grad.reshape(-1)[c[rank] : c[rank + 1]].clone()
                pieces.append(piece)
            ref_norm = float(torch_clip(full, 0.05, norm_type))
            result: dict[str, Any] = {"shapes": shape_list, "norm_type": norm_type}
            result["max_norm"] = 0.05
            result["ref_norm"] = ref_norm
            result["some_rank_empty"] = any(c[r + 1] == c[r] for c in cuts for r in range(world))
            try:
                result["norm"] = float(clip_grad_norm_sharded(pieces, 0.05, norm_type))
                result["error"] = None
            except Exception as err:  # reported by the test, on every rank
                result["norm"], result["error"] = math.nan, f"{type(err).__name__}: {err}"
            result["grad_err"] = max(
                (
                    float((piece.grad - p.grad.reshape(-1)[c[rank] : c[rank + 1]]).abs().max())
                    for piece, p, c in zip(pieces, full, cuts)
                    if piece.numel() and piece.grad is not None and p.grad is not None
                ),
                default=0.0,
            )
            out.append(result)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_pieces_match_torch_on_every_rank(rank_pool: Any, world_size: int) -> None:
    per_rank = rank_pool(world_size).run(sharded_clip_cases, CASES, NORM_TYPES)
    for rank, results in enumerate(per_rank):
        for case in results:
            where = f"rank {rank}, shapes {case['shapes']}, norm_type {case['norm_type']}"
            assert case["error"] is None, f"{where}: raised {case['error']}"
            assert case["some_rank_empty"], f"{where}: the case has no empty piece"
            want = case["ref_norm"]
            assert abs(case["norm"] - want) <= 1e-5 * max(1.0, want), (
                f"{where}: norm {case['norm']} != torch's {want}"
            )
            assert want > case["max_norm"], f"{where}: clipping inactive, the case tests nothing"
            assert case["grad_err"] <= 1e-6, f"{where}: clipped grads off by {case['grad_err']}"


def test_held_outside_names_the_groups_a_norm_over_world_misses() -> None:
    """Rank 0 (one process) of a 2 x 2 mesh summing over its data-parallel ranks
    {0, 2}: a tensor-parallel part (split over (0, 1)) and a copy on (0, 1) are held
    outside; a split or copies inside {0, 2}, or a whole tensor, are not."""
    world = {0, 2}
    part = TensorView((4, 4), 0, 0, 2, split_group=(0, 1))
    copy = TensorView((4,), replicate_group=(0, 1))
    inside = TensorView.of_splits((4, 4), (Split(0, 0, 2, group=(0, 2)),), (0, 2))
    assert held_outside([part], world) == {(0, 1)}
    assert held_outside([copy, TensorView((3,))], world) == {(0, 1)}
    assert held_outside([inside, TensorView((3,))], world) == set()
    # a replica group spanning the whole mesh is not a group to sum over
    assert held_outside([TensorView((4,), replicate_group=(0, 1, 2, 3))], world) == set()
