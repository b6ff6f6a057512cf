"""The body of every rank, launched by torchrun in a node's namespace: train, time, count
the link's bytes ([Note: what is measured] in :mod:`benchmarks.two_nodes.report`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.two_nodes.netem import link_bytes, qdisc_drops
from benchmarks.two_nodes.rows import strategies

__all__ = ["worker"]


def _batch(config: Any, batch: int, rank: int, step: int) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(1000 * rank + step)
    shape = (batch, config.block_size)
    x = torch.randint(0, config.vocab_size, shape, generator=gen)
    return x, torch.randint(0, config.vocab_size, shape, generator=gen)


def worker(spec_path: str) -> int:
    """Body of every rank (launched by torchrun): train, time, count; rank 0 writes
    ``spec["result"]``. A failure writes ``error-rank<r>.txt`` next to it."""
    import datetime

    import torch
    import torch.distributed as dist

    from benchmarks import comm
    from benchmarks.common import peak_rss_bytes, slowest
    from shardkit.models import GPTConfig

    spec = json.loads(Path(spec_path).read_text())
    result = Path(spec["result"])
    rank = int(os.environ.get("RANK", "0"))
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", timeout=datetime.timedelta(seconds=spec.get("pg_timeout", 300))
        )
        counter = comm.install()
        counter.reset()
        node = int(os.environ["SHARDKIT_TWO_NODES_NODE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        veth = spec["veths"][node]
        torch.manual_seed(0)
        config = GPTConfig(**spec["model"])
        runner = strategies()[spec["strategy"]].build(config, spec)
        world = dist.get_world_size()

        def mean_loss(loss: torch.Tensor) -> float:
            t = loss.detach().double().reshape(1)
            dist.all_reduce(t)
            return float(t) / world

        losses = []
        for step in range(spec["warmup"]):
            losses.append(mean_loss(runner.train_step(*_batch(config, spec["batch"], rank, step))))
        dist.barrier()
        before = link_bytes(veth) if local_rank == 0 else (0, 0, 0)
        drops_before = qdisc_drops(veth) if local_rank == 0 else None
        dist.barrier()
        times = []
        for step in range(spec["warmup"], spec["warmup"] + spec["steps"]):
            x, y = _batch(config, spec["batch"], rank, step)
            with counter.counting():
                start = time.perf_counter()
                loss = runner.train_step(x, y)
                elapsed = time.perf_counter() - start
            losses.append(mean_loss(loss))
            times.append(slowest(elapsed))
        dist.barrier()
        after = link_bytes(veth) if local_rank == 0 else (0, 0, 0)
        drops_after = qdisc_drops(veth) if local_rank == 0 else None
        record = {
            "rank": rank,
            "node": node,
            "group_rank": int(os.environ.get("GROUP_RANK", "-1")),
            "local_rank": local_rank,
            "tx_bytes": after[0] - before[0] if local_rank == 0 else None,
            "rx_bytes": after[1] - before[1] if local_rank == 0 else None,
            "tx_packets": after[2] - before[2] if local_rank == 0 else None,
            "tbf_drops": (
                drops_after - drops_before
                if drops_after is not None and drops_before is not None
                else None
            ),
            "comm": counter.snapshot(),
            "rss_peak": peak_rss_bytes(),
            "master_addr": os.environ.get("MASTER_ADDR"),
        }
        comm.uninstall()
        records: list[Any] = [None] * world
        dist.all_gather_object(records, record)
        if rank == 0:
            out = {"times": times, "losses": losses, "ranks": records}
            tmp = result.with_suffix(".tmp")
            tmp.write_text(json.dumps(out))
            tmp.replace(result)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except BaseException as err:  # reported to the orchestrator, then re-raised
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        text = f"{type(err).__name__}: {lines[-1] if lines else ''}".strip()
        (result.parent / f"error-rank{rank}.txt").write_text(text[:2000])
        raise
