"""OSS and FSDP sharded checkpoints go through the manifest: damage is detected.

(They are universal checkpoints: ``shard-<r>-of-<N>.safetensors``.)

Two steps are saved at 2 ranks; a shard file of the newest is damaged; loading at 2
ranks falls back to the older one on every rank (with one warning), and loading in
one process (another world size) names the damaged file. With every checkpoint
damaged, loading raises ``CheckpointCorruptError`` on every rank.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.checkpoint import CheckpointCorruptError, CheckpointFallbackWarning
from shardkit.checkpoint.reader import inspect_checkpoint
from shardkit.nn import FullyShardedDataParallel
from shardkit.nn.data_parallel.fully_sharded import load_fsdp_sharded, save_fsdp_sharded
from shardkit.optim import OSS


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.full((2, 4), 1.0 + dist.get_rank())).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _load_outcome(load: Any) -> str:
    """'step N' from the loaded state's marker, with the warnings seen; or the error."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            marker = load()
        except CheckpointCorruptError as err:
            return f"CheckpointCorruptError: {err}"
    fallbacks = [str(w.message) for w in seen if w.category is CheckpointFallbackWarning]
    return f"step {marker} | " + " | ".join(fallbacks)


def _oss_case(root: Path) -> list[str]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.1)
    for step in (1, 2):
        _train_step(model, optimizer)
        optimizer.save_sharded(root, step=step)

    def load() -> int:
        optimizer.load_sharded(root)
        return int(max(float(st["step"]) for st in optimizer.optim.state.values()))

    out = [_load_outcome(load)]
    dist.barrier()
    if dist.get_rank() == 0:
        _flip(root / "ckpt-000002" / "shard-1-of-2.safetensors")
    dist.barrier()
    out.append(_load_outcome(load))
    dist.barrier()
    if dist.get_rank() == 0:
        _truncate(root / "ckpt-000001" / "shard-0-of-2.safetensors")
    dist.barrier()
    out.append(_load_outcome(load))
    return out


def _fsdp_case(root: Path) -> list[str]:
    torch.manual_seed(0)
    model = FullyShardedDataParallel(nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = []
    for step in (1, 2):
        _train_step(model, optimizer)
        save_fsdp_sharded(model, root, optimizer, step=step, keep=2)
        saved.append(next(model.parameters()).detach().clone())

    def load() -> int:
        load_fsdp_sharded(model, root, optimizer)
        now = next(model.parameters()).detach()
        return next(i + 1 for i, ref in enumerate(saved) if torch.equal(now, ref))

    dist.barrier()
    if dist.get_rank() == 0:
        _truncate(root / "ckpt-000002" / "shard-0-of-2.safetensors")
    dist.barrier()
    return [_load_outcome(load)]


def _cases(tmp: Path) -> dict[str, list[str]]:
    return {"oss": _oss_case(tmp / "oss"), "fsdp": _fsdp_case(tmp / "fsdp")}


def test_damaged_shards_are_detected_and_the_previous_used(rank_pool: Any, tmp_path: Path) -> None:
    per_rank = rank_pool(2).run(_cases, tmp_path)
    for rank, got in enumerate(per_rank):
        intact, flipped, all_damaged = got["oss"]
        assert intact == "step 2 | ", (rank, intact)
        assert flipped.startswith("step 1 | checkpoint "), (rank, flipped)
        assert "ckpt-000002/shard-1-of-2.safetensors is corrupted: sha256" in flipped
        assert flipped.endswith("using ckpt-000001 instead")
        assert all_damaged.startswith("CheckpointCorruptError: no usable checkpoint in ")
        assert "ckpt-000001/shard-0-of-2.safetensors is truncated" in all_damaged
        (fsdp,) = got["fsdp"]
        assert fsdp.startswith("step 1 | checkpoint "), (rank, fsdp)
        assert "ckpt-000002/shard-0-of-2.safetensors is truncated: 100 of " in fsdp
    # one process, no collective: the newest checkpoint, verified
    info = inspect_checkpoint(tmp_path / "oss")
    status = {f.name: f.status.split(":")[0] for f in info.files}
    assert status["shard-1-of-2.safetensors"] == "corrupted", status
    assert sorted(p.name for p in (tmp_path / "fsdp").iterdir()) == [
        "ckpt-000001",
        "ckpt-000002",
        "latest",
    ]
