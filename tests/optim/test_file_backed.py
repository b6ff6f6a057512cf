"""The file-backed optimizer shared by FSDP's and OffloadModel's disk tiers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardkit.checkpoint.generations import GenerationStore
from shardkit.nn.data_parallel.fully_sharded.disk_tier import DiskOptimizer
from shardkit.nn.offload.optim import SlicedOptimizer
from shardkit.optim.file_backed import FileBackedOptimizer, read_state, write_state

_OWNED = re.compile(r"^piece\d+\..*$")


def _store(directory: Path) -> GenerationStore:
    return GenerationStore(directory, fmt="test.file_backed/1", owned=_OWNED, resume=False)


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mapped"])
def test_state_round_trips_exactly(mapped: bool, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    state = {
        0: {"exp_avg": torch.randn(3, 4, generator=g), "step": torch.tensor(3.0)},
        2: {
            "momentum_buffer": torch.randn(5, generator=g).to(torch.bfloat16),
            "count": 4,
            "rate": 0.5,
            "flag": None,
        },
    }
    store = _store(tmp_path)
    layout = write_state(store, "piece0", 1, state, "piece0")
    assert store.path("piece0", "optim") == tmp_path / "piece0.optim.g1"
    got = read_state(store, "piece0", layout, mapped=mapped)
    assert sorted(got) == [0, 2]
    for index, values in state.items():
        assert sorted(got[index]) == sorted(values)
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                mine = got[index][key]
                assert isinstance(mine, torch.Tensor)
                assert mine.dtype == value.dtype and mine.shape == value.shape, key
                assert torch.equal(mine, value), key
            else:
                assert got[index][key] == value, key


def test_state_other_than_tensors_and_numbers_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="piece0: optimizer state 'note' is a str"):
        write_state(_store(tmp_path), "piece0", 1, {0: {"note": "x"}}, "piece0")


def _params(seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((4, 3), (3,), (2, 5))]


def test_pieces_stepped_through_files_match_one_optimizer(tmp_path: Path) -> None:
    """AdamW over two pieces, their state written and read back between steps, gives
    bitwise the parameters of one AdamW over all of them (LR edited after step 1)."""
    plain, tiered = _params(1), _params(1)
    reference = torch.optim.AdamW(plain, lr=0.1, weight_decay=0.01)
    optimizer = FileBackedOptimizer(
        tiered, torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.01}, stored_class=None, where="x"
    )
    assert optimizer.hyperparameters()["betas"] == (0.9, 0.999)  # the class's defaults too
    pieces = {"piece0": tiered[:2], "piece1": tiered[2:]}
    store = _store(tmp_path)
    layouts: dict[str, dict | None] = dict.fromkeys(pieces)
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        if step == 1:
            reference.param_groups[0]["lr"] = optimizer.param_groups[0]["lr"] = 0.03
        for p, q in zip(plain, tiered, strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        reference.step()
        for name, params in pieces.items():
            layout = layouts[name]
            state = {} if layout is None else read_state(store, name, layout)
            new = optimizer.step_piece(params, state)
            layouts[name] = write_state(store, name, step + 1, new, name)
        for p, q in zip(plain, tiered, strict=True):
            assert torch.equal(p, q), f"step {step + 1}"
    assert optimizer.state == {}  # the state lives in the files only
    stored = read_state(store, "piece1", layouts["piece1"] or {})
    assert torch.equal(stored[0]["exp_avg"], reference.state[plain[2]]["exp_avg"])


def test_state_of_another_class_is_refused() -> None:
    with pytest.raises(
        ValueError, match="offload_dir holds optimizer state of torch.optim.sgd.SGD"
    ):
        FileBackedOptimizer(
            _params(0),
            torch.optim.AdamW,
            {"lr": 0.1},
            stored_class="torch.optim.sgd.SGD",
            where="offload_dir",
        )


def test_both_disk_tiers_step_with_it() -> None:
    assert issubclass(DiskOptimizer, FileBackedOptimizer)
    assert issubclass(SlicedOptimizer, FileBackedOptimizer)


def test_state_with_an_empty_tensor_is_written_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A piece holding a parameter with no element on this rank (an empty FSDP piece):
    its state read back from the file is written from the read buffer as it is (one
    segment from its start: no packing copy), and steps like one AdamW. Before, torch's
    address 0 of empty tensors made every such piece fall back to packing."""
    plain = [nn.Parameter(torch.randn(3)), nn.Parameter(torch.zeros(0))]
    tiered = [nn.Parameter(p.detach().clone()) for p in plain]
    reference = torch.optim.AdamW(plain, lr=0.1)
    optimizer = FileBackedOptimizer(
        tiered, torch.optim.AdamW, {"lr": 0.1}, stored_class=None, where="x"
    )
    store = _store(tmp_path)
    calls: list[Any] = []
    write_async = store.write_async

    def spy(*args: Any, segments: Any = None) -> Any:
        calls.append(segments)
        return write_async(*args, segments=segments)

    monkeypatch.setattr(store, "write_async", spy)
    layout: dict[str, Any] | None = None
    for step in range(2):
        for p, q in zip(plain, tiered, strict=True):
            p.grad = torch.full(p.shape, step + 1.0)
            q.grad = p.grad.clone()
        reference.step()
        state = {} if layout is None else read_state(store, "piece0", layout)
        base = None if layout is None else state[0]["exp_avg"].data_ptr()
        layout = write_state(store, "piece0", step + 1, optimizer.step_piece(tiered, state), "x")
        for p, q in zip(plain, tiered, strict=True):
            assert torch.equal(p, q), f"step {step + 1}"
    assert calls[0] is None  # fresh state: packed
    assert calls[1] == ([(0, base, 196)], 196)  # p0: moments 0, 64, step 128; p1: all at 192
    assert layout is not None
    stored = read_state(store, "piece0", layout)
    assert stored[1]["exp_avg"].shape == (0,) and float(stored[1]["step"]) == 2.0
    assert torch.equal(stored[0]["exp_avg_sq"], reference.state[plain[0]]["exp_avg_sq"])


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD], ids=["adamw", "sgd"])
def test_pieces_step_with_the_fused_kernel_when_asked(cls: type[torch.optim.Optimizer]) -> None:
    """``fused=True`` (torch's vectorised CPU kernel, recommended for the disk tiers)
    reaches each piece's optimizer: two pieces stepped one after the other give bitwise
    the parameters of one fused optimizer over the whole model; and the state the
    default (for-loop) implementation wrote in step 1 continues under the fused kernel
    in steps 2-3 as the default would (1e-6)."""
    kwargs: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
    if cls is torch.optim.SGD:
        kwargs["momentum"] = 0.9
    pieces = ([0, 1], [2])
    params, ref, mixed, plain = _params(0), _params(0), _params(0), _params(0)
    fused = FileBackedOptimizer(
        params, cls, {**kwargs, "fused": True}, stored_class=None, where="t"
    )
    default = FileBackedOptimizer(mixed, cls, kwargs, stored_class=None, where="t")
    fused_mixed = FileBackedOptimizer(
        mixed, cls, {**kwargs, "fused": True}, stored_class=None, where="t"
    )
    assert fused.piece_optimizer(params).defaults["fused"] is True
    reference, plain_reference = cls(ref, **kwargs, fused=True), cls(plain, **kwargs)
    states: list[dict[int, dict[str, Any]]] = [{}, {}]
    mixed_states: list[dict[int, dict[str, Any]]] = [{}, {}]
    for step in range(3):
        g = torch.Generator().manual_seed(10 + step)
        for group in (params, ref, mixed, plain):
            g.manual_seed(10 + step)
            for p in group:
                p.grad = torch.randn(p.shape, generator=g)
        for k, piece in enumerate(pieces):
            states[k] = fused.step_piece([params[i] for i in piece], states[k])
            stepper = default if step == 0 else fused_mixed
            mixed_states[k] = stepper.step_piece([mixed[i] for i in piece], mixed_states[k])
        reference.step()
        plain_reference.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, atol=0, rtol=0)
    for p, r in zip(mixed, plain):
        torch.testing.assert_close(p, r, atol=1e-6, rtol=1e-5)
