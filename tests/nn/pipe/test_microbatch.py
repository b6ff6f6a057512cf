"""Micro-batch split and gather: sizes and round trips (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.nn.pipe.microbatch import gather, scatter, split_sizes


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 200), chunks=st.integers(1, 50))
def test_split_sizes_are_exactly_chunks_nearly_equal_larger_first(rows: int, chunks: int) -> None:
    if rows < chunks:
        with pytest.raises(ValueError, match=f"batch of {rows} rows cannot be split into {chunks}"):
            split_sizes(rows, chunks)
        return
    sizes = split_sizes(rows, chunks)
    assert len(sizes) == chunks and sum(sizes) == rows
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@settings(max_examples=50, deadline=None)
@given(
    rows=st.integers(1, 20), chunks=st.integers(1, 20), width=st.integers(1, 4), pair=st.booleans()
)
def test_scatter_then_gather_is_the_identity(
    rows: int, chunks: int, width: int, pair: bool
) -> None:
    chunks = min(chunks, rows)
    x = torch.randn(rows, width)
    value = (x, torch.arange(rows)) if pair else x
    batches = scatter(value, chunks)
    assert len(batches) == chunks
    back = gather(batches)
    if pair:
        assert (
            isinstance(back, tuple)
            and torch.equal(back[0], x)
            and torch.equal(back[1], torch.arange(rows))
        )
    else:
        assert isinstance(back, torch.Tensor) and torch.equal(back, x)


def test_chunks_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="chunks must be >= 1; got 0"):
        split_sizes(4, 0)


def test_zero_dim_input_is_refused() -> None:
    with pytest.raises(ValueError, match="need a batch dimension"):
        scatter(torch.tensor(1.0), 1)
