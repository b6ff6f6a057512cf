"""Universal checkpoints: cases found by trying the API as a new user (issue 21).

- Param-group hyperparameters reach every rank, also a rank that holds no piece of a
  group's parameters (an FSDP rank whose flat shard has no element of them, an OSS
  rank that owns none of them); before, such a rank kept its own values and the next
  save recorded them.
- Every wrapper's adapter reports the tied keys, so ``convert`` writes a state dict
  that loads with ``strict=True`` (before, only the plain and DDP layouts did: an
  FSDP, OSS or ShardedDataParallel checkpoint of a GPT lost ``lm_head.weight``).
- A param-group mismatch is refused before anything is filled.
- Optimizer state loads like torch's ``load_state_dict``: new state in the param's
  dtype (a bf16 checkpoint into an fp32 model: the next step raised a dtype error);
  existing state of a strided param filled in place (raised "view size is not
  compatible").
- A 0-dim parameter's ``step`` is saved as a scalar, not as an element-wise state of
  one element (it loaded into FSDP's 1-D shard as a ``[1]`` tensor).
- A root whose first save never finished: ``FileNotFoundError`` naming it.
- A plain module whose copies differ between ranks is refused at save (each rank
  writes 1/N of every tensor: the checkpoint silently mixed the ranks' values).
- FSDP on the disk tier is refused by name (before: "piece [0, 106) has 106
  elements, its tensor 0").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.checkpoint import CheckpointCorruptError, CheckpointMismatchError
from shardkit.checkpoint.cli import main as cli_main
from shardkit.checkpoint.manifest import read_manifest
from shardkit.checkpoint.universal import load_universal, save_universal
from shardkit.checkpoint.universal.shardfile import read_index
from shardkit.models import GPT, gpt_config
from shardkit.nn import FSDP, OffloadModel, Pipe, ShardedDataParallel
from shardkit.nn.data_parallel.fully_sharded.disk_tier import DiskOffload
from shardkit.optim import OSS

LRS = (0.01, 0.05)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _groups(model: nn.Module, lrs: tuple[float, float]) -> list[dict[str, Any]]:
    """Group 1: the last bias alone (the end of the flat parameter: rank 1's shard at
    2 ranks; owned by one OSS rank); group 0: the rest."""
    params = list(model.parameters())
    return [{"params": params[:-1], "lr": lrs[0]}, {"params": params[-1:], "lr": lrs[1]}]


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", vocab_size=32, block_size=8))


class _Scalar(nn.Module):
    """A 0-dim parameter first (rank 0's FSDP shard holds it), then a vector."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.tensor(2.0))
        self.w = nn.Parameter(torch.ones(3))


def _worker(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fsdp = FSDP(_mlp())
    fsdp_opt = torch.optim.AdamW(_groups(fsdp, (0.9, 0.9)))
    load_universal(root / "plain", fsdp, fsdp_opt)
    out["fsdp_lr"] = [g["lr"] for g in fsdp_opt.param_groups]
    again = save_universal(root / "again", 2, fsdp, fsdp_opt)
    groups = read_manifest(again).layout["optimizer"]["param_groups"]
    out["resaved_lr"] = [g["hyper"]["lr"] for g in groups]
    plain = _mlp()
    oss = OSS(_groups(plain, (0.9, 0.9)), torch.optim.AdamW)
    load_universal(root / "plain", plain, oss)
    out["oss_lr"] = [g["lr"] for g in oss.param_groups]
    out["owners"] = sorted(oss.param_to_rank.values())
    # tied keys of a GPT under every data-parallel wrapper
    for kind in ("fsdp", "oss", "sdp"):
        model: Any = _gpt()
        if kind == "fsdp":
            model = FSDP(model)
            optimizer: Any = torch.optim.AdamW(model.parameters())
        else:
            optimizer = OSS(model.parameters(), torch.optim.AdamW)
            if kind == "sdp":
                model = ShardedDataParallel(model, optimizer)
        ckpt = save_universal(root / kind, 1, model, optimizer)
        out[kind] = read_manifest(ckpt).layout["aliases"]
    # a 0-dim parameter's AdamW state into FSDP (1-D shards)
    scalar = FSDP(_Scalar())
    scalar_opt = torch.optim.AdamW(scalar.parameters())
    load_universal(root / "scalar", scalar, scalar_opt)
    out["scalar_state"] = [
        {name: tuple(v.shape) for name, v in scalar_opt.state[p].items()}
        for p in scalar.parameters()
        if p.numel()
    ]
    # a plain module the ranks hold differently (no wrapper keeps the copies equal)
    torch.manual_seed(dist.get_rank())
    try:
        save_universal(root / "chimera", 1, nn.Linear(4, 4))
    except ValueError as err:
        out["chimera"] = str(err)
    # FSDP on the disk tier: its shards are empty in memory
    disk = DiskOffload(str(root / "disk"))
    on_disk = FSDP(_mlp(), disk_offload=disk)
    try:
        save_universal(root / "on_disk", 1, on_disk, disk.optimizer(torch.optim.AdamW))
    except ValueError as err:
        out["disk"] = str(err)
    return out


@pytest.fixture(scope="module")
def two_ranks(rank_pool: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    root = tmp_path_factory.mktemp("universal_edge")
    model = _mlp()
    optimizer = torch.optim.AdamW(_groups(model, LRS))
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    save_universal(root / "plain", 1, model, optimizer)
    scalar = _Scalar()
    scalar_opt = torch.optim.AdamW(scalar.parameters())
    (scalar.t * scalar.w).sum().backward()
    scalar_opt.step()
    save_universal(root / "scalar", 1, scalar, scalar_opt)
    return root, rank_pool(2).run(_worker, root, timeout_s=120)


def test_hyperparameters_on_ranks_without_pieces(two_ranks: tuple[Path, list[Any]]) -> None:
    """Regression: the rank holding no piece of group 1 kept lr 0.9 (FSDP rank 0, the
    OSS rank owning no parameter of it), and a save from FSDP recorded 0.9."""
    _, out = two_ranks
    assert out[0]["owners"] == [0, 1, 1, 1]  # group 1's one parameter: one owner
    for rank in range(2):
        assert out[rank]["fsdp_lr"] == list(LRS), rank
        assert out[rank]["oss_lr"] == list(LRS), rank
        assert out[rank]["resaved_lr"] == list(LRS), rank


def test_every_wrapper_records_tied_keys(two_ranks: tuple[Path, list[Any]], tmp_path: Path) -> None:
    """Regression: FSDP, OSS and ShardedDataParallel checkpoints of a GPT had no aliases,
    so ``convert`` left out ``lm_head.weight`` and the strict load failed."""
    root, out = two_ranks
    for kind in ("fsdp", "oss", "sdp"):
        assert out[0][kind] == {"lm_head.weight": "wte.weight"}, kind
        target = tmp_path / f"{kind}.pt"
        assert cli_main(["convert", str(root / kind), str(target)]) == 0
        state = torch.load(target, weights_only=True)
        model = _gpt()
        model.load_state_dict(state, strict=True)
        assert torch.equal(state["lm_head.weight"], _gpt().wte.weight), kind


def _tied_seq() -> nn.Sequential:
    torch.manual_seed(1)
    seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    seq[2].weight = seq[0].weight
    return seq


@pytest.mark.parametrize("kind", ["pipe", "offload"])
def test_pipe_and_offload_record_tied_keys(kind: str, tmp_path: Path) -> None:
    """Tied layers in a one-process Pipe (two partitions) and an OffloadModel (two
    slices): the manifest names the tie under the plain model's keys."""
    seq = _tied_seq()
    if kind == "pipe":
        model: Any = Pipe(seq, balance=[2, 1], devices=["cpu", "cpu"], chunks=1)
    else:
        model = OffloadModel(seq, "cpu", "cpu", num_slices=2)
    ckpt = save_universal(tmp_path, 1, model)
    aliases = read_manifest(ckpt).layout["aliases"]
    assert aliases == {"2.weight": "0.weight"}


def test_group_mismatch_refused_before_filling(tmp_path: Path) -> None:
    """Two saved groups of different lr loaded into one group: refused, and neither
    the model nor the optimizer was touched (before: both filled, then the error)."""
    model = _mlp()
    optimizer = torch.optim.AdamW(_groups(model, LRS))
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    save_universal(tmp_path, 1, model, optimizer)
    torch.manual_seed(5)
    other = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.3)
    with pytest.raises(CheckpointMismatchError, match=r"param group 0 holds keys of saved"):
        load_universal(tmp_path, other, other_opt)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    assert len(other_opt.state) == 0 and other_opt.param_groups[0]["lr"] == 0.3


def test_fsdp_disk_tier_refused_by_name(two_ranks: tuple[Path, list[Any]]) -> None:
    root, out = two_ranks
    for rank in range(2):
        assert out[rank]["disk"].startswith(
            "the universal checkpoint does not save or load FSDP units on the disk tier "
            "(1 units, e.g. 'flat_param'"
        )
    assert not (root / "on_disk" / "latest").exists()


class _Strided(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 2).t())


def _adam_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    sum(p.square().sum() for p in model.parameters()).backward()  # type: ignore[union-attr]
    optimizer.step()
    optimizer.zero_grad()


def test_strided_state_of_a_stepped_optimizer(tmp_path: Path) -> None:
    """Regression: Adam's state of a transposed parameter is strided like it
    (``zeros_like``); loading into an optimizer that had stepped raised."""
    model = _Strided()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    _adam_step(model, optimizer)
    save_universal(tmp_path, 1, model, optimizer)
    other = _Strided()
    other_opt = torch.optim.Adam(other.parameters(), lr=0.1)
    for _ in range(2):
        _adam_step(other, other_opt)
    assert not other_opt.state[other.w]["exp_avg"].is_contiguous()
    load_universal(tmp_path, other, other_opt)
    for name in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(other_opt.state[other.w][name], optimizer.state[model.w][name]), name
    assert torch.equal(other.w, model.w)


def test_state_takes_the_param_dtype(tmp_path: Path) -> None:
    """Regression: a bf16 model's AdamW state loaded into an fp32 model stayed bf16 and
    the next step raised; as torch's ``load_state_dict``, it is cast to the param's
    dtype, and the step equals the one after ``load_state_dict``."""
    torch.manual_seed(0)
    low = nn.Linear(4, 3).to(torch.bfloat16)
    low_opt = torch.optim.AdamW(low.parameters(), lr=0.1)
    _adam_step(low, low_opt)
    save_universal(tmp_path, 1, low, low_opt)
    ours, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    ours_opt = torch.optim.AdamW(ours.parameters(), lr=0.5)
    load_universal(tmp_path, ours, ours_opt)
    ref.load_state_dict({k: v.float() for k, v in low.state_dict().items()})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.5)
    ref_opt.load_state_dict(low_opt.state_dict())
    for p, q in zip(ours.parameters(), ref.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            assert ours_opt.state[p][name].dtype == torch.float32
            assert torch.equal(ours_opt.state[p][name], ref_opt.state[q][name])
    _adam_step(ours, ours_opt)
    _adam_step(ref, ref_opt)
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters()))


def test_root_never_committed(tmp_path: Path) -> None:
    """A root holding only an unfinished ``ckpt-<step>`` (killed during its first save):
    ``FileNotFoundError`` (before: ``CheckpointCorruptError`` calling the root a save
    that did not finish)."""
    (tmp_path / "ckpt-000001").mkdir()
    (tmp_path / "ckpt-000001" / "shard-0-of-1.safetensors").write_bytes(b"half")
    with pytest.raises(FileNotFoundError, match=r"no committed checkpoint .*'ckpt-000001'"):
        load_universal(tmp_path, _mlp())
    # the unfinished directory itself: damaged; a directory that is neither: not found
    with pytest.raises(CheckpointCorruptError, match="the save of ckpt-000001 did not finish"):
        load_universal(tmp_path / "ckpt-000001", _mlp())
    (tmp_path / "other").mkdir()
    with pytest.raises(FileNotFoundError, match=r"other is not a checkpoint root \(no 'latest'"):
        load_universal(tmp_path / "other", _mlp())


def test_step_of_a_0dim_param_is_a_scalar(two_ranks: tuple[Path, list[Any]]) -> None:
    """Regression: the ``step`` of a 0-dim parameter (shape ``()`` like it) was saved as
    an element-wise state and came back into FSDP's 1-D shard with shape ``(1,)``."""
    root, out = two_ranks
    pieces, scalars = read_index(root / "scalar" / "ckpt-000001" / "shard-0-of-1.safetensors")
    assert ("t", "step") in {(s.key, s.state) for s in scalars}
    assert ("t", "step") not in {(p.key, p.state) for p in pieces}
    assert out[0]["scalar_state"][0] == {"exp_avg": (1,), "exp_avg_sq": (1,), "step": ()}
    for rank in range(2):
        assert all(state["step"] == () for state in out[rank]["scalar_state"]), rank


def test_plain_module_held_differently_refused(two_ranks: tuple[Path, list[Any]]) -> None:
    """Regression: two ranks holding differently initialised plain Linear layers saved
    a checkpoint made of rank 0's first half and rank 1's second half of each tensor,
    silently."""
    root, out = two_ranks
    for rank in range(2):
        message = out[rank]["chimera"]
        assert message.startswith(
            "the ranks hold different values of 2 tensors that the 'plain' layout saves as "
            "identical replicas (each rank writes 1/2 of every tensor"
        ), message
        assert "'weight': rank 0 sum " in message and "'bias': rank 0 sum " in message
    assert not (root / "chimera" / "latest").exists()
