"""The sequence split of context parallelism (issue 31): a permutation the combine inverts."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.nn.context_parallel import combine_sequence, position_ids, split_sequence

EXAMPLES = int(os.environ.get("SHARDKIT_HYPOTHESIS_EXAMPLES", "50"))


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    chunk=st.integers(1, 4),
    cp=st.sampled_from([1, 2, 3, 4, 8]),
    zigzag=st.booleans(),
    dim=st.sampled_from([1, 2]),
)
def test_split_is_a_permutation_the_combine_inverts(
    batch: int, heads: int, chunk: int, cp: int, zigzag: bool, dim: int
) -> None:
    seq = chunk * cp * (2 if zigzag else 1)
    shape = [batch, heads, heads]
    shape[dim] = seq
    x = torch.arange(batch * heads * seq).reshape(shape)
    parts = [split_sequence(x, r, cp, zigzag=zigzag, dim=dim) for r in range(cp)]
    assert all(p.shape[dim] == seq // cp for p in parts)
    # a permutation: every element exactly once
    assert torch.equal(torch.cat([p.flatten() for p in parts]).sort().values, x.flatten())
    assert torch.equal(combine_sequence(parts, zigzag=zigzag, dim=dim), x)
    # position ids follow the tokens
    pos = [position_ids(seq, r, cp, zigzag=zigzag) for r in range(cp)]
    ids = torch.arange(seq)
    for r in range(cp):
        assert torch.equal(pos[r], split_sequence(ids, r, cp, zigzag=zigzag, dim=0))
    if zigzag:  # rank r holds chunks r and 2cp-1-r
        for r in range(cp):
            want = torch.cat(
                [ids[r * chunk : (r + 1) * chunk], ids[(2 * cp - 1 - r) * chunk :][:chunk]]
            )
            assert torch.equal(pos[r], want)
    else:
        assert torch.equal(pos[cp - 1], ids[-(seq // cp) :])


def test_zigzag_example_and_bad_inputs() -> None:
    ids = torch.arange(8)
    assert [position_ids(8, r, 2, zigzag=True).tolist() for r in (0, 1)] == [
        [0, 1, 6, 7],
        [2, 3, 4, 5],
    ]
    with pytest.raises(ValueError, match=r"sequence length 6 is not divisible by 4, the zig-zag"):
        split_sequence(ids[:6], 0, 2, zigzag=True, dim=0)
    with pytest.raises(ValueError, match=r"sequence length 7 is not divisible by 2"):
        split_sequence(ids[:7], 0, 2, zigzag=False, dim=0)
    with pytest.raises(ValueError, match=r"cp_rank 2 is outside \[0, 2\)"):
        split_sequence(ids, 2, 2, zigzag=False, dim=0)
