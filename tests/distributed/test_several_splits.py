"""Shard descriptors of several splits (tensor parallel inside each expert), without
processes: the element arithmetic against nested ``partition.shard``, the descriptor's
equality and file record (old records still read), the checkpoint planner's cover and
re-cut between two multi-split layouts, the tensor-parallel readers, the data-parallel
refusal and the writer of each part in a plain module."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.checkpoint.universal.plan import Filler, cover_problem
from shardkit.checkpoint.universal.shardfile import SavedPiece
from shardkit.distributed.shard_descriptor import Split, TensorView, set_view, writes_part
from shardkit.distributed.shard_elements import check_view, local_rows, read_range, write_range
from shardkit.distributed.validation import parameter_problem
from shardkit.nn.tensor_parallel.partition import is_tensor_parallel, shard, split_of

EXAMPLES = int(os.environ.get("SHARDKIT_HYPOTHESIS_EXAMPLES", "60"))


@st.composite
def layouts(draw: Any) -> tuple[tuple[int, ...], list[tuple[int, int, int]]]:
    """A global shape and two or three splits ``(dim, parts, stride)`` on distinct dims."""
    ndim = draw(st.integers(2, 3))
    dims = draw(st.lists(st.integers(0, ndim - 1), min_size=2, max_size=ndim, unique=True))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    splits = []
    for d in dims:
        parts, stride = draw(st.integers(1, 3)), draw(st.integers(1, 2))
        shape[d] *= parts * stride
        splits.append((d, parts, stride))
    return tuple(shape), splits


def _view(
    shape: tuple[int, ...], splits: list[tuple[int, int, int]], parts: list[int]
) -> TensorView:
    return TensorView.of_splits(
        shape, tuple(Split(d, p, n, s) for (d, n, s), p in zip(splits, parts, strict=True))
    )


def _expected(full: torch.Tensor, view: TensorView) -> torch.Tensor:
    for s in view.splits:
        full = shard(full, s.dim, s.part, s.parts, s.stride)
    return full


@settings(max_examples=EXAMPLES, deadline=None)
@given(layouts(), st.data())
def test_local_rows_is_nested_partition_shard(layout: Any, data: Any) -> None:
    shape, splits = layout
    parts = [data.draw(st.integers(0, n - 1)) for _, n, _ in splits]
    view = _view(shape, splits, parts)
    check_view(view)
    full = torch.arange(math.prod(shape), dtype=torch.float64)
    expected = _expected(full.view(shape), view)
    assert view.local_shape == tuple(expected.shape)
    rows = local_rows(full, view)
    assert torch.equal(read_range(rows, 0, view.local_numel), expected.reshape(-1))
    n = view.local_numel
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    assert torch.equal(read_range(rows, a, b), expected.reshape(-1)[a:b])
    write_range(rows, a, -1 - torch.arange(b - a, dtype=torch.float64))
    assert int((full < 0).sum()) == b - a  # exactly those elements, nothing else
    assert torch.equal(
        -1 - full[full < 0].sort(descending=True).values, torch.arange(b - a).double()
    )


def test_single_split_views_compare_print_and_record_as_before() -> None:
    one = TensorView.of_splits((4, 6), (Split(1, 1, 2, group=(0, 1), mesh_dim="tp"),))
    assert one == TensorView((4, 6), 1, 1, 2) and hash(one) == hash(TensorView((4, 6), 1, 1, 2))
    assert one.mesh_dim == "tp" and one.split_group == (0, 1) and one.inner_splits == ()
    assert repr(one) == "TensorView(global_shape=(4, 6), split_dim=1, part=1, parts=2, stride=1)"
    assert TensorView.of_splits((3,), ()) == TensorView((3,)) and TensorView((3,)).splits == ()
    record = SavedPiece("w", "", one, 0, 12, "float32", "f", "n").to_json()
    assert record["view"] == [[4, 6], 1, 1, 2, 1]  # the record of a one-split view
    assert SavedPiece.from_json(record, "f").view == one


def test_several_splits_equality_repr_and_file_record() -> None:
    ep = Split(0, 1, 2, group=(1, 3), mesh_dim="ep")
    tp = Split(2, 0, 2, group=(2, 3), mesh_dim="tp")
    view = TensorView.of_splits((8, 6, 10), (ep, tp))
    assert view.local_shape == (4, 6, 5) and view.splits == (ep, tp)
    assert view.splits[1].mesh_dim == "tp" and view.splits[1].group == (2, 3)
    bare = TensorView.of_splits((8, 6, 10), (Split(0, 1, 2), Split(2, 0, 2)))
    assert view == bare and hash(view) == hash(bare)  # groups and mesh dims left out
    assert view != TensorView.of_splits((8, 6, 10), (Split(0, 1, 2), Split(2, 1, 2)))
    assert view != TensorView((8, 6, 10), 0, 1, 2)
    assert "inner_splits=(Split(dim=2, part=0, parts=2, stride=1),)" in repr(view)
    record = SavedPiece("w", "", view, 0, 120, "float32", "f", "n").to_json()
    assert record["view"] == [[8, 6, 10], 0, 1, 2, 1, [[2, 0, 2, 1]]]
    assert SavedPiece.from_json(record, "f").view == view
    with pytest.raises(ValueError, match=r"splits on dims \[0, 0\]"):
        check_view(TensorView.of_splits((8, 6), (Split(0, 0, 2), Split(0, 1, 2))))
    with pytest.raises(ValueError, match="no inner split"):
        check_view(TensorView((8, 6), inner_splits=(Split(0, 0, 2),)))


def _pieces(
    shape: tuple[int, ...], splits: list[tuple[int, int, int]], full: torch.Tensor
) -> tuple[list[SavedPiece], dict[str, torch.Tensor]]:
    """Every part of the layout as one saved piece, cut in two element ranges."""
    pieces, data = [], {}
    counts = [n for _, n, _ in splits]
    for index in range(math.prod(counts)):
        parts = [index // math.prod(counts[i + 1 :]) % counts[i] for i in range(len(counts))]
        view = _view(shape, splits, parts)
        local = read_range(local_rows(full, view), 0, view.local_numel)
        half = view.local_numel // 2
        for a, b in ((0, half), (half, view.local_numel)):
            name = f"{index}:{a}"
            pieces.append(SavedPiece("w", "", view, a, b, "float32", "f", name))
            data[name] = local[a:b]
    return pieces, data


class _Source:
    def __init__(self, data: dict[str, torch.Tensor]) -> None:
        self.data = data

    def read(self, piece: SavedPiece, lo: int, hi: int) -> torch.Tensor:
        return self.data[piece.name][lo:hi].clone()


def test_saved_at_ep2_tp2_fills_other_layouts() -> None:
    shape = (4, 3, 6)  # experts x model dim x hidden dim
    full = torch.arange(72, dtype=torch.float32)
    pieces, data = _pieces(shape, [(0, 2, 1), (2, 2, 1)], full)
    assert cover_problem(pieces, shape) is None
    assert cover_problem(pieces[1:], shape) == "part (0, 0) of (2, 2): elements [0, 9) missing"
    mixed = pieces + [SavedPiece("w", "", TensorView(shape, 0, 0, 2), 0, 36, "float32", "f", "x")]
    assert (cover_problem(mixed, shape) or "").startswith("pieces in different splits")
    filler = Filler(_Source(data))
    targets = [
        TensorView(shape),  # the plain layer
        TensorView(shape, 2, 1, 2),  # ep 1, tp 2
        TensorView(shape, 0, 1, 2),  # ep 2, tp 1
        _view(shape, [(0, 4, 1), (2, 3, 1)], [3, 1]),  # ep 4, tp 3
        _view(shape, [(0, 2, 1), (2, 2, 1)], [1, 0]),  # the same layout: copied directly
    ]
    for view in targets:
        dst = torch.zeros(view.local_numel)
        filler.fill(dst, pieces, view, 0, view.local_numel)
        assert torch.equal(dst, _expected(full.view(shape), view).reshape(-1)), view
    part = torch.zeros(4)
    filler.fill(part, pieces, targets[3], 1, 5)
    assert torch.equal(part, _expected(full.view(shape), targets[3]).reshape(-1)[1:5])


def test_tensor_parallel_readers_and_data_parallel_refusal() -> None:
    w1 = torch.zeros(2, 3, 5)
    ep = Split(0, 1, 2, group=(1, 3), mesh_dim="ep")
    set_view(
        w1, TensorView.of_splits((4, 3, 10), (ep, Split(2, 1, 2, group=(2, 3), mesh_dim="tp")))
    )
    assert is_tensor_parallel(w1) and split_of(w1) == (2, 1)
    refused = parameter_problem("FSDP", [("w1", w1)], reduce_ranks=[0, 1, 2, 3])
    assert refused is not None and "part 1 of 2 of a tensor split over 'ep'" in str(refused)
    over_tp = parameter_problem("FSDP", [("w1", w1)], reduce_ranks=[2, 3])
    assert over_tp is not None and "split over 'tp' across ranks [2, 3]" in str(over_tp)
    assert parameter_problem("FSDP", [("w1", w1)], reduce_ranks=[3]) is None
    only_ep = torch.zeros(2, 3, 10)
    set_view(only_ep, TensorView.of_splits((4, 3, 10), (ep,)))
    assert not is_tensor_parallel(only_ep)


@pytest.mark.parametrize(
    ("ep_group", "holders", "writes"),
    [
        ((0, 2), (0, 1, 2, 3), True),  # rank 0 (this process) spans ranks 0-3 with tp (0, 1)
        ((0, 2), (4, 5, 6, 7), False),  # the lowest holder is in another grid
        ((0, 4), (5, 6), True),  # the grid spanned: {0, 1, 4, 5}
        ((0, 4), (2, 3), False),
        (None, (5, 6), True),  # a group not known: every holder writes
    ],
)
def test_writes_part_of_several_splits(
    ep_group: tuple[int, ...] | None, holders: tuple[int, ...], writes: bool
) -> None:
    view = TensorView.of_splits(
        (4, 6), (Split(0, 0, 2, group=ep_group), Split(1, 0, 2, group=(0, 1)))
    )
    assert writes_part(view, holders) is writes
