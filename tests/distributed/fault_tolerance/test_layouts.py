"""Layout fingerprints and the plain model's index space, in one process.

A (4, 6) weight and a (6,) bias: replica A holds the weight split over 2 tensor-parallel
parts on dim 1 (stride 1 and stride 3, a fused layout) and the bias whole on part 0;
replica B holds both whole, as two flat pieces each. Each piece's gradient is the
matching slice of a known global gradient, so what ``scatter`` writes and ``gather``
reads back is checked element by element.
"""

from __future__ import annotations

import pytest
import torch

from shardkit.checkpoint.universal import ParamEntry
from shardkit.distributed.fault_tolerance.layouts import ModelSpace, digest, fingerprint, trainable
from shardkit.distributed.shard_descriptor import TensorView
from shardkit.nn.tensor_parallel.partition import shard

_W, _B = torch.arange(24.0).view(4, 6), torch.arange(6.0) + 100


def _param(value: torch.Tensor) -> torch.Tensor:
    p = torch.zeros_like(value).requires_grad_()
    p.grad = value.clone()
    return p


def _split(part: int, stride: int) -> list[ParamEntry]:
    view = TensorView((4, 6), 1, part, 2, stride)
    w = _param(shard(_W, 1, part, 2, stride))
    b = _param(_B)
    whole = TensorView((6,))
    return [
        ParamEntry("w", view, 0, 12, w.detach(), w, True, 0),
        ParamEntry("b", whole, 0, 6, b.detach(), b, part == 0, 0),
    ]


def _whole() -> list[ParamEntry]:
    w, b = _param(_W), _param(_B)
    out = []
    for key, p in (("w", w), ("b", b)):
        n = p.numel()
        view = TensorView(tuple(p.shape))
        out += [
            ParamEntry(key, view, a, z, p.detach(), p, True, a)
            for a, z in ((0, n // 2), (n // 2, n))
        ]
    return out


@pytest.mark.parametrize("stride", [1, 3])
def test_every_layout_contributes_each_element_once_and_reads_back_its_pieces(stride: int) -> None:
    space = ModelSpace({"w": (4, 6), "b": (6,)})
    expected = torch.cat([_B, _W.reshape(-1)])  # keys sorted: b, then w
    ranks = [_split(0, stride), _split(1, stride)]
    total = sum(space.scatter(pieces, torch.float32) for pieces in ranks)
    assert torch.equal(total, expected)
    assert torch.equal(space.scatter(_whole(), torch.float32), expected)
    doubled = 2 * expected  # every piece reads back exactly its elements
    for pieces in [*ranks, _whole()]:
        space.gather(doubled, pieces)
        for p in pieces:
            assert p.param is not None and p.param.grad is not None
            want = shard(_W, 1, p.view.part, 2, stride) if p.view.split_dim is not None else None
            got = p.param.grad.reshape(-1)[p.start : p.stop]
            source = (want if want is not None else (_W if p.key == "w" else _B)).reshape(-1)
            assert torch.equal(got, 2 * source[p.start : p.stop]), (p.key, p.start)


def test_fingerprints_tell_layouts_apart_and_need_offsets() -> None:
    a = digest([fingerprint(trainable(_split(r, 1))) for r in range(2)])
    assert a == digest([fingerprint(trainable(_split(r, 1))) for r in range(2)])
    assert a != digest([fingerprint(trainable(_split(r, 3))) for r in range(2)])
    assert a != digest([fingerprint(trainable(_whole()))])
    p = _param(_B)
    with pytest.raises(ValueError, match="'b' \\[0, 6\\) has no param_offset"):
        trainable([ParamEntry("b", TensorView((6,)), 0, 6, p.detach(), p, True)])
