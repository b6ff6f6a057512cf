"""Loading never unpickles arbitrary objects: a planted pickle payload is refused.

A payload whose ``__reduce__`` would create a marker file is added to one rank's file
of a real checkpoint, and the manifest is rewritten so that its size and sha256 match
(as an attacker who can write the file can also write the manifest beside it). Every
public load path refuses it and the marker file is never created. The main job's
``--resume`` is tested in ``tests/examples/test_restart.py``.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.checkpoint import CheckpointUnsafeError, load_checkpoint_file
from shardkit.checkpoint.manifest import save_checkpoint
from shardkit.nn import FullyShardedDataParallel
from shardkit.nn.data_parallel.fully_sharded import load_fsdp_sharded, save_fsdp_sharded
from shardkit.optim import OSS
from tests.checkpoint.payload import plant_payload


def assert_refused(err: BaseException, name: str) -> None:
    """The clear error: a CheckpointUnsafeError naming the file and the object."""
    assert isinstance(err, CheckpointUnsafeError), repr(err)
    assert err.problem == "unsafe"
    assert err.path.name == name
    message = str(err)
    assert message.startswith(f"{err.path} holds an object that is not a tensor"), message
    assert "posix.system" in message, message  # the object torch refused
    assert "refused: loading it could run code" in message, message


def test_payload_is_live(tmp_path: Path) -> None:
    """The planted file does run code when unpickled without the allowlist (so the
    refusals below are what keeps the marker file absent)."""
    marker = tmp_path / "marker"
    save_checkpoint(tmp_path, 1, {"rank0.pt": {"w": torch.ones(3)}})
    ckpt = tmp_path / "ckpt-000001"
    plant_payload(ckpt, "rank0.pt", marker)
    loaded = load_checkpoint_file(ckpt, "rank0.pt", weights_only=False)
    assert marker.exists()
    assert loaded["note"] == 0  # os.system's exit status
    torch.testing.assert_close(loaded["w"], torch.ones(3))


def test_manifest_load_refuses_payload(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    save_checkpoint(tmp_path, 1, {"rank0.pt": {"w": torch.ones(3)}})
    ckpt = tmp_path / "ckpt-000001"
    assert load_checkpoint_file(ckpt, "rank0.pt")["w"].tolist() == [1.0, 1.0, 1.0]
    plant_payload(ckpt, "rank0.pt", marker)
    with pytest.raises(CheckpointUnsafeError) as caught:
        load_checkpoint_file(ckpt, "rank0.pt")
    assert_refused(caught.value, "rank0.pt")
    assert not marker.exists()


def test_plain_containers_load(tmp_path: Path) -> None:
    """What shardkit saves (tensors, numbers, strings, None, tuples, lists, dicts,
    Python's RNG state) passes the allowlist unchanged."""
    import random

    state = {
        "t": torch.arange(4),
        "x": [1, 2.5, "s", None, (3, 4)],
        "rng": random.getstate(),
        "torch_rng": torch.get_rng_state(),
        "nested": {"a": {"b": torch.zeros(2, dtype=torch.bfloat16)}},
    }
    save_checkpoint(tmp_path, 1, {"rank0.pt": state})
    loaded = load_checkpoint_file(tmp_path / "ckpt-000001", "rank0.pt")
    assert loaded["x"] == state["x"] and loaded["rng"] == state["rng"]
    assert torch.equal(loaded["torch_rng"], state["torch_rng"])
    assert loaded["nested"]["a"]["b"].dtype == torch.bfloat16


def _sharded_refusals(root: Path) -> dict[str, Any]:
    """On each of 2 ranks: save FSDP and OSS sharded checkpoints; rank 0 plants a payload
    in rank 1's files; load both back. The errors (type, file, message) per path."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    fsdp = FullyShardedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3)))
    fsdp_optim = torch.optim.Adam(fsdp.parameters())
    fsdp(torch.ones(2, 4)).sum().backward()
    fsdp_optim.step()
    save_fsdp_sharded(fsdp, root / "fsdp", fsdp_optim, step=1)
    plain = nn.Linear(4, 3)
    oss = OSS(plain.parameters(), optim=torch.optim.Adam, lr=0.1)
    plain(torch.ones(2, 4)).sum().backward()
    oss.step()
    oss.save_sharded(root / "oss", step=1)
    dist.barrier()
    if rank == 0:
        # universal checkpoints: the shard files are safetensors (tensors only); the
        # pickle a rank writes is its extra file
        plant_payload(root / "fsdp" / "ckpt-000001", "extra-1.pt", root / "m-fsdp")
        plant_payload(root / "oss" / "ckpt-000001", "extra-1.pt", root / "m-oss")
    dist.barrier()
    errors: dict[str, Any] = {}
    for path, load in [
        ("fsdp", lambda: load_fsdp_sharded(fsdp, root / "fsdp", fsdp_optim)),
        ("oss", lambda: oss.load_sharded(root / "oss")),
    ]:
        try:
            load()
            errors[path] = None
        except Exception as err:  # compared in the test
            errors[path] = (type(err).__name__, isinstance(err, CheckpointUnsafeError), str(err))
    dist.barrier()
    errors["markers"] = [(root / m).exists() for m in ("m-fsdp", "m-oss")]
    return errors


def test_sharded_loads_refuse_payload(rank_pool: Any, tmp_path: Path) -> None:
    """FSDP's and OSS's sharded loads (universal checkpoints) at 2 ranks refuse a
    planted payload (with a matching manifest) on every rank; nothing runs. (The old
    formats' reader: tests/checkpoint/test_legacy_convert.py.)"""
    per_rank = rank_pool(2).run(_sharded_refusals, tmp_path, timeout_s=120)
    for rank, errors in enumerate(per_rank):
        assert errors["markers"] == [False, False]
        for path in ("oss", "fsdp"):
            # rank 1 refuses its extra file, naming it and the object; rank 0 is told
            name, unsafe, message = errors[path]
            if rank == 1:
                assert (name, unsafe) == ("CheckpointUnsafeError", True), errors[path]
            else:
                assert name == "CheckpointError", errors[path]
                assert "loading failed on rank 1" in message, message
            assert "extra-1.pt holds an object that is not a tensor" in message, message
            assert "posix.system" in message
    with pytest.raises(pickle.UnpicklingError):  # torch's own error for a direct load
        torch.load(tmp_path / "fsdp" / "ckpt-000001" / "extra-1.pt", weights_only=True)
    assert not (tmp_path / "m-fsdp").exists() and not (tmp_path / "m-oss").exists()
