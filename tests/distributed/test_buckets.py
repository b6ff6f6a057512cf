"""Flat buffers: pack/unpack round trip, averaging on the way in, the buffer pool."""

from __future__ import annotations

import pytest
import torch

from shardkit.distributed import BufferPool, pack, plan_owner_broadcast, unpack


def test_pack_unpack_round_trip_with_division_and_cast() -> None:
    tensors = [torch.randn(2, 3), torch.randn(0), torch.randn(5)]
    buffer = torch.empty(11)
    pack(tensors, buffer)
    outs = [torch.empty_like(t) for t in tensors]
    unpack(buffer, outs)
    assert all(torch.equal(a, b) for a, b in zip(tensors, outs))
    half = torch.empty(11, dtype=torch.float16)
    pack(tensors, half, divide_by=4.0)
    assert torch.equal(half[:6], (tensors[0] / 4).flatten().half())
    with pytest.raises(ValueError, match="do not fit a buffer of 10 elements"):
        pack(tensors, torch.empty(10))


def test_pool_reuses_and_caps_free_buffers() -> None:
    # regression: returning more than max_free buffers compared tensors with ==
    pool = BufferPool(torch.device("cpu"), max_free=1)
    views = [pool.get(n, torch.float32) for n in (4, 25, 73)]
    for v in views:
        pool.put(v)
    again = pool.get(10, torch.float32)
    assert again.numel() == 10
    assert again.untyped_storage().nbytes() == 73 * 4  # the largest one was kept


def test_owner_plan_sends_large_tensors_in_place() -> None:
    big, small = torch.zeros(1000), torch.zeros(3)
    plan = plan_owner_broadcast([[small, big], [small.clone()]], bucket_bytes=64)
    assert [(b.src, len(b.tensors), b.direct) for b in plan] == [
        (0, 1, True),  # in-place tensors first, then the packed buckets
        (0, 1, False),
        (1, 1, False),
    ]
    fp16 = plan_owner_broadcast([[big]], bucket_bytes=64, comm_dtype=torch.float16)
    assert not fp16[0].direct  # a dtype change needs a copy
    mixed = [torch.zeros(300), torch.zeros(2), torch.zeros(5000), torch.zeros(3)]
    plan = plan_owner_broadcast([mixed], bucket_bytes=2**24, direct_bytes=1000)
    assert [(b.numel, b.direct) for b in plan] == [(300, True), (5000, True), (5, False)]
