"""The shard descriptor records the mesh dimension of a split: an MoE layer's experts
(split over ``ep``) are not tensor-parallel parts; tensor-parallel layers' parts and
views made by hand (or read from a checkpoint) still are."""

from __future__ import annotations

import pytest
import torch

from shardkit.distributed.shard_descriptor import TensorView, set_view, view_of
from shardkit.nn.tensor_parallel.partition import (
    is_tensor_parallel,
    mark_tensor_parallel,
    split_of,
)


def test_a_split_over_ep_is_not_tensor_parallel() -> None:
    w1 = torch.zeros(2, 3, 4)
    set_view(w1, TensorView((8, 3, 4), 0, 1, 4, split_group=(0, 1, 2, 3), mesh_dim="ep"))
    assert not is_tensor_parallel(w1)
    with pytest.raises(
        ValueError,
        match=r"shape \(2, 3, 4\) is not a tensor-parallel part \(it is split over 'ep'\)",
    ):
        split_of(w1)


def test_tensor_parallel_parts_and_unrecorded_splits_still_are() -> None:
    col = torch.zeros(2, 3)
    view = mark_tensor_parallel(col, 0, rank=1, world_size=2)
    assert view.mesh_dim == "tp" and view_of(col).mesh_dim == "tp"
    assert is_tensor_parallel(col) and split_of(col) == (0, 1)
    by_hand = torch.zeros(3, 2)
    set_view(by_hand, TensorView((3, 4), 1, 0, 2, stride=1))  # no mesh_dim: as before
    assert is_tensor_parallel(by_hand) and split_of(by_hand) == (1, 1)
    whole = torch.zeros(3)
    assert not is_tensor_parallel(whole)
    # the mesh dimension says who holds the parts, not what the data is: a descriptor
    # read back from a checkpoint (no mesh_dim) matches the live one
    assert view == TensorView((4, 3), 0, 1, 2)
    assert hash(view) == hash(TensorView((4, 3), 0, 1, 2))
    assert "mesh_dim" not in repr(view)
