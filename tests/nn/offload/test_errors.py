"""Bad input fails early with errors that name the values and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from shardkit.distributed.optim_guard import ReplacedParameterError, is_replaced
from shardkit.models import GPT, GPTConfig
from shardkit.nn.offload import OffloadModel
from tests.nn.offload.common import X, Y, optimizer_for, tiny


def test_non_sequential_model() -> None:
    with pytest.raises(TypeError, match=r"needs an nn.Sequential.*got GPT.*gpt_stages"):
        OffloadModel(GPT(GPTConfig()), "cpu")  # type: ignore[arg-type]


def test_more_slices_than_layers() -> None:
    with pytest.raises(
        ValueError, match=r"num_slices \(7\) is larger than the number of layers \(6\)"
    ):
        OffloadModel(tiny(), "cpu", num_slices=7)


def test_bad_microbatches() -> None:
    with pytest.raises(ValueError, match="num_microbatches must be >= 1; got 0"):
        OffloadModel(tiny(), "cpu", num_microbatches=0)


def test_unwritable_offload_dir(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=r"exists and is not a directory"):
        OffloadModel(tiny(), "cpu", offload_dir=a_file)
    with pytest.raises(ValueError, match=r"offload_dir '.*file/sub' is not writable"):
        OffloadModel(tiny(), "cpu", offload_dir=a_file / "sub")


def test_directory_reuse_needs_resume_and_matching_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="resume=True but offload_dir .* has no manifest.json"):
        OffloadModel(tiny(), "cpu", offload_dir=tmp_path, resume=True)
    OffloadModel(tiny(), "cpu", offload_dir=tmp_path)
    with pytest.raises(ValueError, match="already holds an offloaded model; pass resume=True"):
        OffloadModel(tiny(), "cpu", offload_dir=tmp_path)
    with pytest.raises(ValueError, match=r"holds slices .* but this model has"):
        OffloadModel(tiny(), "cpu", offload_dir=tmp_path, resume=True, num_slices=2)
    wider = nn.Sequential(*tiny()[:-1], nn.Linear(16, 5))
    with pytest.raises(ValueError, match=r"slice2 in offload_dir does not match the model"):
        OffloadModel(wider, "cpu", offload_dir=tmp_path, resume=True)


def test_optimizer_misuse(tmp_path: Path) -> None:
    memory = OffloadModel(tiny(), "cpu")
    with pytest.raises(ValueError, match="sliced_optimizer is for the disk tier"):
        memory.sliced_optimizer(torch.optim.SGD, lr=0.1)
    on_disk = OffloadModel(tiny(), "cpu", offload_dir=tmp_path)
    plain_optimizer = torch.optim.SGD(on_disk.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"Step with model.sliced_optimizer"):
        plain_optimizer.step()
    with pytest.raises(ValueError, match="set_to_none=True"):
        optimizer_for(on_disk, "sgd").zero_grad(set_to_none=False)
    optimizer = optimizer_for(on_disk, "sgd")
    nn.functional.mse_loss(on_disk(X), Y).backward()
    optimizer.step()
    del on_disk, optimizer
    reopened = OffloadModel(tiny(), "cpu", offload_dir=tmp_path, resume=True)
    with pytest.raises(ValueError, match="holds optimizer state of torch.optim.sgd.SGD"):
        reopened.sliced_optimizer(torch.optim.AdamW)


def test_meta_model_needs_disk_tier() -> None:
    with torch.device("meta"):
        model = tiny()
    with pytest.raises(ValueError, match="only the disk tier can materialise them"):
        OffloadModel(model, "cpu")


def test_disk_arguments_conflict(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match='offload_device="disk" needs offload_dir'):
        OffloadModel(tiny(), "cpu", offload_device="disk")
    with pytest.raises(ValueError, match="offload_device must be"):
        OffloadModel(tiny(), "cpu", offload_device="cuda", offload_dir=tmp_path)
    with pytest.raises(ValueError, match="resume=True needs the disk tier"):
        OffloadModel(tiny(), "cpu", resume=True)
    for bad in (-1, 1.5, True):  # a float of bytes was accepted silently
        with pytest.raises(
            ValueError, match=r"disk_io_bytes must be an int >= 0 \(bytes; 0 turns it off\)"
        ):
            OffloadModel(tiny(), "cpu", offload_dir=tmp_path / "d", disk_io_bytes=bad)


def test_second_backward_is_refused() -> None:
    model = OffloadModel(tiny(), "cpu", num_slices=2)
    loss = nn.functional.mse_loss(model(X), Y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True is not supported"):
        loss.backward()


def test_plain_optimizer_on_disk_tier_names_the_parameter(tmp_path: Path) -> None:
    on_disk = OffloadModel(tiny(), "cpu", offload_dir=tmp_path)
    first = next(iter(on_disk.parameters()))
    plain_optimizer = torch.optim.AdamW([first], lr=0.1)
    with pytest.raises(ReplacedParameterError) as info:
        plain_optimizer.step()
    assert str(info.value) == (
        "AdamW holds the parameter `model_slices.0.0.weight`, which an OffloadModel on the "
        "disk tier (an empty placeholder between uses) replaced: Step with "
        "model.sliced_optimizer(optimizer_class, **kwargs) instead"
    )
    memory = OffloadModel(tiny(), "cpu")  # the memory tiers replace nothing
    assert not any(is_replaced(p) for p in memory.parameters())
