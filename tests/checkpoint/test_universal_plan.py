"""The universal checkpoint's element arithmetic and planner, without processes.

- :func:`local_rows` is exactly ``tensor_parallel.partition.shard`` (any shape,
  split dim, degree and stride), and its flat ranges read and write the right elements.
- :func:`cover_problem` names a gap, an element saved twice, and mixed splits.
- Save in layout A, load in layout B (each a random tensor-parallel split with a
  random piecewise cover, pieces as separate parameters of an Adam optimizer held by
  this one process), through the real writer and reader: parameters, ``exp_avg``
  and ``step`` arrive exactly, and the filler reads only the needed elements when
  the views match.
"""

from __future__ import annotations

import itertools
import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.checkpoint import CheckpointMismatchError
from shardkit.checkpoint.universal import (
    ParamEntry,
    TensorView,
    load_universal,
    register_layout,
    save_universal,
)
from shardkit.checkpoint.universal.plan import Filler, cover_problem, direct_copies
from shardkit.checkpoint.universal.shardfile import SavedPiece
from shardkit.distributed.shard_elements import check_view, local_rows, read_range, write_range
from shardkit.nn.tensor_parallel.partition import shard


@st.composite
def views(draw: Any, shape: tuple[int, ...] | None = None) -> TensorView:
    """A random split of a random (or the given) global shape."""
    if shape is None:
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.integers(1, 4)) for _ in range(ndim))
        dim = draw(st.integers(0, ndim - 1))
        parts, stride = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        shape = shape[:dim] + (shape[dim] * parts * stride,) + shape[dim + 1 :]
        return TensorView(shape, dim, draw(st.integers(0, parts - 1)), parts, stride)
    splits = [(None, 1, 1)] + [
        (d, p, s)
        for d in range(len(shape))
        for p in (1, 2, 3, 4)
        for s in (1, 2, 3)
        if shape[d] % (p * s) == 0
    ]
    dim, parts, stride = draw(st.sampled_from(splits))
    return TensorView(shape, dim, 0, parts, stride)


def _cover(draw: Any, numel: int) -> list[tuple[int, int]]:
    if numel == 0:  # an empty tensor: one empty piece (its holder lists it)
        return [(0, 0)]
    cuts = sorted(draw(st.lists(st.integers(0, numel), max_size=4)))
    bounds = [0, *cuts, numel]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


@settings(max_examples=150, deadline=None)
@given(views(), st.data())
def test_local_rows_is_partition_shard(view: TensorView, data: Any) -> None:
    check_view(view)
    full = torch.arange(math.prod(view.global_shape), dtype=torch.float64)
    expected = full.view(view.global_shape)
    if view.split_dim is not None:
        expected = shard(expected, view.split_dim, view.part, view.parts, view.stride)
    rows = local_rows(full, view)
    assert torch.equal(rows.reshape(-1), expected.reshape(-1))
    n = view.local_numel
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    assert torch.equal(read_range(rows, a, b), expected.reshape(-1)[a:b])
    write_range(rows, a, -torch.ones(b - a, dtype=torch.float64))
    assert int((full < 0).sum()) == b - a  # exactly those elements, nothing else


def _piece(key: str, view: TensorView, a: int, b: int, name: str = "") -> SavedPiece:
    return SavedPiece(key, "", view, a, b, "float32", "f", name)


def test_cover_problem_names_gap_twice_and_mixed() -> None:
    whole = TensorView((2, 3))
    assert cover_problem([_piece("w", whole, 0, 4), _piece("w", whole, 4, 6)], (2, 3)) is None
    gap = cover_problem([_piece("w", whole, 0, 4)], (2, 3))
    assert gap == "part 0 of 1: elements [4, 6) missing"
    twice = cover_problem([_piece("w", whole, 0, 4), _piece("w", whole, 3, 6)], (2, 3))
    assert twice == "part 0 of 1: elements [3, 4) saved twice"
    half = TensorView((2, 3), 0, 1, 2)
    mixed = cover_problem([_piece("w", whole, 0, 6), _piece("w", half, 0, 3)], (2, 3))
    assert mixed is not None and mixed.startswith("pieces in different splits")
    missing_part = cover_problem([_piece("w", half, 0, 3)], (2, 3))
    assert missing_part == "part 0 of 2: elements [0, 3) missing"
    assert cover_problem([_piece("w", whole, 0, 6)], (3, 2)) is not None  # other shape


def test_direct_copies_intersect() -> None:
    view = TensorView((10,))
    pieces = [_piece("w", view, 0, 4, "a"), _piece("w", view, 4, 10, "b")]
    copies = direct_copies(pieces, view, 2, 7)
    assert copies is not None
    assert [(c.piece.name, c.src, c.dst, c.numel) for c in copies] == [
        ("a", 2, 0, 2),
        ("b", 0, 2, 3),
    ]
    assert direct_copies(pieces, TensorView((10,), 0, 0, 2), 0, 5) is None


class _Source:
    def __init__(self, data: dict[str, torch.Tensor]) -> None:
        self.data, self.read_elements = data, 0

    def read(self, piece: SavedPiece, lo: int, hi: int) -> torch.Tensor:
        self.read_elements += hi - lo
        return self.data[piece.name][lo:hi].clone()


def test_filler_reads_only_needed_elements_for_equal_views() -> None:
    view = TensorView((4, 6), 1, 1, 2)
    full = torch.arange(24.0)
    local = read_range(local_rows(full, view), 0, 12)
    pieces = [_piece("w", view, 0, 5, "a"), _piece("w", view, 5, 12, "b")]
    source = _Source({"a": local[:5], "b": local[5:]})
    filler = Filler(source)
    dst = torch.zeros(3)
    filler.fill(dst, pieces, view, 4, 7)
    assert dst.tolist() == local[4:7].tolist()
    assert source.read_elements == 3 and filler.assembled == 0
    other = TensorView((4, 6))
    whole_pieces = [_piece("w", view, 0, 12, "a")]  # one part only: the planner reads it all
    source2 = _Source({"a": local})
    Filler(source2).fill(torch.zeros(12), whole_pieces, view, 0, 12)
    assert source2.read_elements == 12
    del other


# -- save layout A, load layout B, through the real writer and reader ----------------


@dataclass
class Layout:
    """Per key: its view family (split_dim, parts, stride) and per part a cover."""

    splits: dict[str, tuple[int | None, int, int]]
    covers: dict[str, list[list[tuple[int, int]]]]


class FakeSharded:
    """A 'model' whose pieces are separate 1-D parameters, as a sharded wrapper holds them."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], layout: Layout) -> None:
        self.pieces: list[tuple[str, TensorView, int, int, torch.nn.Parameter]] = []
        for key, shape in shapes.items():
            dim, parts, stride = layout.splits[key]
            for part in range(parts):
                view = TensorView(shape, dim, part, parts, stride)
                for a, b in layout.covers[key][part]:
                    param = torch.nn.Parameter(torch.zeros(b - a, dtype=torch.float64))
                    self.pieces.append((key, view, a, b, param))

    def params(self) -> list[torch.nn.Parameter]:
        return [p for *_, p in self.pieces]


class FakeLayout:
    strategy = "fake"

    def __init__(self, model: FakeSharded, optimizer: Any) -> None:
        self.model = model

    def entries(self) -> Iterator[ParamEntry]:
        for key, view, a, b, param in self.model.pieces:
            yield ParamEntry(key, view, a, b, param.data, param)

    def after_load(self) -> None:
        pass


register_layout(FakeSharded, FakeLayout)


@st.composite
def layouts(draw: Any, shapes: dict[str, tuple[int, ...]]) -> Layout:
    splits, covers = {}, {}
    for key, shape in shapes.items():
        view = draw(views(shape))
        splits[key] = (view.split_dim, view.parts, view.stride)
        covers[key] = [_cover(draw, view.local_numel) for _ in range(view.parts)]
    return Layout(splits, covers)


@st.composite
def cases(draw: Any) -> tuple[dict[str, tuple[int, ...]], Layout, Layout]:
    shapes = {}
    for i in range(draw(st.integers(1, 3))):
        dims = draw(st.lists(st.sampled_from([0, 1, 2, 3, 4, 6]), min_size=0, max_size=3))
        shapes[f"layer{i}.weight"] = tuple(dims)
    return shapes, draw(layouts(shapes)), draw(layouts(shapes))


def _piece_of(global_flat: torch.Tensor, view: TensorView, a: int, b: int) -> torch.Tensor:
    return read_range(local_rows(global_flat, view), a, b)


@settings(max_examples=40, deadline=None)
@given(cases())
def test_save_layout_a_load_layout_b_exact(case: Any) -> None:
    shapes, layout_a, layout_b = case
    gen = torch.Generator().manual_seed(0)
    values = {
        k: torch.randn(math.prod(s), generator=gen, dtype=torch.float64) for k, s in shapes.items()
    }
    moments = {
        k: torch.rand(math.prod(s), generator=gen, dtype=torch.float64) for k, s in shapes.items()
    }
    saved = FakeSharded(shapes, layout_a)
    optimizer = torch.optim.Adam(saved.params(), lr=0.25, betas=(0.5, 0.6))
    for key, view, a, b, param in saved.pieces:
        param.data.copy_(_piece_of(values[key], view, a, b))
        optimizer.state[param] = {
            "step": torch.tensor(7.0),
            "exp_avg": _piece_of(moments[key], view, a, b).clone(),
            "exp_avg_sq": _piece_of(moments[key], view, a, b) * 2,
        }
    with tempfile.TemporaryDirectory() as root:
        save_universal(root, 1, saved, optimizer)
        target = FakeSharded(shapes, layout_b)
        target_opt = torch.optim.Adam(target.params(), lr=1.0)
        loaded = load_universal(root, target, target_opt)
    assert loaded.saved_strategy == "fake"
    assert target_opt.param_groups[0]["lr"] == 0.25
    assert target_opt.param_groups[0]["betas"] == (0.5, 0.6)
    for key, view, a, b, param in target.pieces:
        assert torch.equal(param.data, _piece_of(values[key], view, a, b)), (key, view, a, b)
        state = target_opt.state[param]
        assert torch.equal(state["exp_avg"], _piece_of(moments[key], view, a, b))
        assert torch.equal(state["exp_avg_sq"], _piece_of(moments[key], view, a, b) * 2)
        assert torch.equal(state["step"], torch.tensor(7.0))


def test_missing_coverage_named(tmp_path: Any) -> None:
    """A save whose pieces miss elements is refused on save, naming the key."""
    shapes = {"w": (4,), "b": (2,)}
    layout = Layout({"w": (None, 1, 1), "b": (None, 1, 1)}, {"w": [[(0, 3)]], "b": [[(0, 2)]]})
    with pytest.raises(ValueError, match=r"'w': part 0 of 1: elements \[3, 4\) missing"):
        save_universal(tmp_path, 1, FakeSharded(shapes, layout))
    good = Layout({"w": (None, 1, 1), "b": (None, 1, 1)}, {"w": [[(0, 4)]], "b": [[(0, 2)]]})
    save_universal(tmp_path, 1, FakeSharded(shapes, good))
    other = FakeSharded(
        {"w": (4,), "c": (2,)},
        Layout({"w": (None, 1, 1), "c": (None, 1, 1)}, {"w": [[(0, 4)]], "c": [[(0, 2)]]}),
    )
    with pytest.raises(
        CheckpointMismatchError, match=r"missing keys .*\['c'\].*unexpected keys .*\['b'\]"
    ):
        load_universal(tmp_path, other)
    reshaped = FakeSharded(
        {"w": (2, 2), "b": (2,)},
        Layout({"w": (None, 1, 1), "b": (None, 1, 1)}, {"w": [[(0, 4)]], "b": [[(0, 2)]]}),
    )
    with pytest.raises(CheckpointMismatchError, match=r"'w': checkpoint \[4\], model \[2, 2\]"):
        load_universal(tmp_path, reshaped)
