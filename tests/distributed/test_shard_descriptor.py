"""The shard descriptor: equality on the data, groups as rank tuples, who writes.

One process (``torch.distributed`` not initialised: this rank is 0); the rules are
checked with explicit global-rank tuples, as the checkpoint adapters pass them.
"""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch

from shardkit.checkpoint.universal.shardfile import SavedPiece
from shardkit.distributed.shard_descriptor import (
    TensorView,
    set_view,
    view_of,
    writes_part,
    writes_replica,
)
from shardkit.nn.tensor_parallel.partition import is_tensor_parallel, mark_tensor_parallel, split_of
from shardkit.nn.tensor_parallel.universal_layout import record_replica


def test_groups_are_not_part_of_equality_hash_or_repr() -> None:
    a = TensorView((4, 6), 0, 1, 2, 1, split_group=(2, 3), replicate_group=(1, 3))
    b = TensorView((4, 6), 0, 1, 2, 1, split_group=(0, 1))
    assert a == b and hash(a) == hash(b)
    assert "group" not in repr(a)
    assert a != TensorView((4, 6), 0, 0, 2, 1, split_group=(2, 3))  # another part


def test_pickle_and_deepcopy_keep_the_groups() -> None:
    a = TensorView((4, 6), 1, 0, 2, 3, split_group=(0, 1), replicate_group=(0, 2))
    for b in (pickle.loads(pickle.dumps(a)), copy.deepcopy(a)):
        assert b == a
        assert (b.split_group, b.replicate_group) == ((0, 1), (0, 2))
    t = torch.zeros(4, 3)
    set_view(t, a)
    assert view_of(copy.deepcopy(t)).replicate_group == (0, 2)


def test_checkpoint_serialises_the_data_fields_only() -> None:
    view = TensorView((4, 6), 0, 1, 2, 1, split_group=(2, 3), replicate_group=(1, 3))
    raw = SavedPiece("w", "", view, 0, 12, "float32", "f", "0").to_json()
    assert raw["view"] == [[4, 6], 0, 1, 2, 1]
    back = SavedPiece.from_json(json.loads(json.dumps(raw)), "f")
    assert back.view == view and back.view.split_group is None


@pytest.mark.parametrize(
    ("replicas", "holders", "writes"),
    [
        (None, (0, 1), True),  # no copies recorded: the wrapper's rule alone
        ((), None, True),
        ((2, 3), (0, 2), True),  # the DDP group {0, 2} holds tensor-parallel rank 0 (rank 2)
        ((2, 3), (1, 3), False),
        ((0, 1, 2, 3), (1, 3), False),  # the replica group lists the data-parallel ranks too
        ((0, 1, 2, 3), (0, 2), True),
        ((0, 1), None, True),  # this rank alone (0): the lowest replica
        ((1, 2), None, False),
    ],
)
def test_writes_replica_lowest_rank_among_holders(
    replicas: tuple[int, ...] | None, holders: tuple[int, ...] | None, writes: bool
) -> None:
    view = TensorView((8,), replicate_group=replicas)
    assert writes_replica(view, holders) is writes


@pytest.mark.parametrize(
    ("split", "replicas", "model_holders", "writes"),
    [
        ((0, 1), None, (0, 1, 2, 3), True),  # the tensor-parallel group holding rank 0
        ((2, 3), None, (0, 1, 2, 3), False),
        ((2, 3), None, (2, 3), True),  # a save over the second copy alone
        (None, None, (0, 1, 2, 3), True),  # split group unknown: every holder (as before)
        ((0, 1), (0, 2), (0, 1, 2, 3), True),  # replica group recorded: its lowest rank
        ((0, 1), (1, 3), (0, 1, 2, 3), False),
    ],
)
def test_writes_part_of_a_plain_module(
    split: tuple[int, ...] | None,
    replicas: tuple[int, ...] | None,
    model_holders: tuple[int, ...],
    writes: bool,
) -> None:
    view = TensorView((4, 6), 0, 0, 2, 1, split_group=split, replicate_group=replicas)
    assert writes_part(view, model_holders) is writes


def test_mark_tensor_parallel_records_the_descriptor_and_megatron_attributes() -> None:
    p = torch.nn.Parameter(torch.zeros(6, 4))
    assert not is_tensor_parallel(p)
    view = mark_tensor_parallel(p, 1, 2, rank=1, world_size=3)
    assert view == TensorView((6, 12), 1, 1, 3, 2) == view_of(p)
    assert is_tensor_parallel(p) and split_of(p) == (1, 2)
    assert (p.tensor_model_parallel, p.partition_dim, p.partition_stride) == (True, 1, 2)
    record_replica(p, (5, 1))  # the data-parallel holders of the same part
    assert view_of(p) == view and view_of(p).replicate_group == (1, 5)
    with pytest.raises(ValueError, match="not a tensor-parallel part"):
        split_of(torch.zeros(3))
    with pytest.raises(ValueError, match=r"tensor-parallel rank 3 is not in \[0, 3\)"):
        mark_tensor_parallel(torch.zeros(2), 0, rank=3, world_size=3)
