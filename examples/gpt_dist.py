"""Process group, device and threads for the main job, and small cross-rank reductions.

One code path for every launch: under torchrun (``RANK``/``WORLD_SIZE`` and the
rendezvous in the environment) the job joins the ``env://`` group; as a plain script
it makes a 1-rank group in memory; when a group is already up (a test harness), it
uses that one and leaves it up. NCCL with one GPU per local rank when CUDA is
available, gloo on CPU otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore
from torch.distributed.rendezvous import rendezvous

__all__ = ["Env", "all_gather_ints", "mean_over_ranks", "setup_distributed"]


@dataclass(frozen=True)
class Env:
    """This process's place in the job.

    Attributes:
        rank: global rank.
        world_size: number of ranks.
        device: ``cuda:<local rank>`` with NCCL, else ``cpu``.
        owns_group: True when :func:`setup_distributed` created the process group (the
            caller destroys it at the end).
    """

    rank: int
    world_size: int
    device: torch.device
    owns_group: bool


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _init_from_env(backend: str) -> None:
    """Join the ``env://`` group, under a store prefix of its own for each torchrun attempt.

    [Note: restarts]
    Under ``torchrun --max-restarts N`` every attempt's workers talk to the same agent
    TCPStore (torchrun shares it unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), and
    the default process group writes its keys under the same names each time: the
    restarted gloo group read the dead attempt's peer addresses and failed with
    "Gloo connectFullMesh failed ... Connection refused" (torch 2.13, seen in
    ``tests/examples/test_restart.py``). ``TORCHELASTIC_RESTART_COUNT`` numbers the
    attempts, so each one gets its own key prefix.

    That count is the agent's own: an agent that joins an elastic job later starts at
    0, and a restart for a membership change does not count. Elastic jobs
    (``--nnodes MIN:MAX``, ``docs/elastic.md``) therefore run with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: every round's rank 0 then hosts a fresh
    store (``TORCHELASTIC_USE_AGENT_STORE`` is not ``True``), no stale key exists, and
    no prefix is added.
    """
    store, rank, world_size = next(rendezvous("env://"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = PrefixStore(f"attempt{attempt}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def setup_distributed() -> Env:
    """Join or create the default process group; pick the device; set torch threads.

    Intra-op threads per rank: the usable cores divided by the ranks on this node
    (``LOCAL_WORLD_SIZE``, else the world size), at least 1, so ranks do not fight
    over cores.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    owns_group = not dist.is_initialized()
    if owns_group:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            _init_from_env(backend)  # torchrun: env:// rendezvous
        else:
            store = dist.HashStore()  # type: ignore[attr-defined]
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    world_size = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    torch.set_num_threads(max(1, _cores() // local_world))
    return Env(dist.get_rank(), world_size, device, owns_group)


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar tensor over all ranks (collective)."""
    total = value.detach().double().reshape(1).clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def all_gather_ints(values: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's ``values`` (same length on every rank), in rank order (collective)."""
    local = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [[int(v) for v in t.tolist()] for t in out]
