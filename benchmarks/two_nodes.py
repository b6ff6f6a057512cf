"""Two nodes on one machine, over a slow link: every multi-node strategy side by side.

Run (as root, with ``ip`` and ``tc``)::

    python -m benchmarks.two_nodes                        # GPT tiny, link 1 Gbit/s
    python -m benchmarks.two_nodes --rate 1gbit 100mbit   # one table row set per rate
    python -m benchmarks.two_nodes --model-size small --steps 5 --strategies "torch DDP" "shardkit hsdp"
    python -m benchmarks.two_nodes --dry-run              # print the commands, run nothing
    python -m benchmarks.two_nodes --cleanup              # remove namespaces left by a killed run

[Note: the emulated cluster]
Two Linux network namespaces (``skt2n-<id>-0`` and ``-1``) are the two nodes. A veth
pair joins them (``10.213.<k>.1`` in node 0, ``.2`` in node 1, a /30 of their own);
each end's egress goes through a token bucket filter (``tc qdisc ... tbf rate
<rate>``), so each direction of the link is capped at ``--rate``. Every address lives
inside the two namespaces and disappears with them. In each namespace the benchmark
starts its own torchrun agent, the real multi-node launch path::

    ip netns exec skt2n-<id>-<i> env GLOO_SOCKET_IFNAME=<veth i> ... \\
        torchrun --nnodes 2 --node-rank <i> --nproc-per-node 2 \\
            --rdzv-backend c10d --rdzv-endpoint 10.213.<k>.1:29400 --rdzv-id <run> \\
            --rdzv-conf is_host=<1 for node 0> --local-addr <node i's address> \\
            --max-restarts 0 -m benchmarks.two_nodes --worker <spec.json>

- The c10d rendezvous store runs in node 0 (``is_host``); node 1's agent reaches it
  across the link. torchrun ignores ``--node-rank`` under c10d (it warns): the
  rendezvous numbers the nodes, and each node's 2 ranks get consecutive global ranks
  either way, so a shard group of 2 consecutive ranks is one node.
- ``--local-addr`` makes the agent advertise its veth address, not the machine's host
  name (both namespaces share the UTS name): the workers' ``MASTER_ADDR`` is node 0's
  veth address.
- ``GLOO_SOCKET_IFNAME=<veth>``: every rank's gloo pairs bind its node's veth address.
  Two ranks of one node connect to that same local address, which the kernel routes
  over the namespace's loopback (fast, uncapped); ranks of the two nodes connect over
  the capped veth.

[Note: what is measured]
Each strategy runs in fresh processes (one pair of agents per strategy and rate):
build the GPT (same seed everywhere), ``--warmup`` untimed steps, then ``--steps``
timed steps, each forward, backward, optimizer step; a step's time is the slowest
rank's. Bytes across the link are counted by the kernel: the veth's ``tx_bytes``
(``/proc/net/dev`` of each namespace: Ethernet frames, TCP/IP headers included),
read by each node's local rank 0 after a barrier before and after the timed steps;
both directions together, divided by steps (and by the world size for "per rank").
Besides the gradient and parameter traffic this includes the barriers and loss
all-reduces of the timed steps and the agents' rendezvous keep-alives (bytes,
not kilobytes). ``benchmarks.comm`` also counts every collective each rank issues
(ring-model volume, all groups, intra-node included).

Formulas (elements per rank per step, psi parameters, W = R x S ranks, R nodes of S
ranks; the ring model for collectives over all W ranks, node-major, with R edges of
the ring crossing nodes): hybrid (shardkit hsdp, torch HSDP) all-reduces only its
1/S gradient shard across the R replicas: ``2 psi (R - 1) / (R S)``, whatever the
all-reduce algorithm for R = 2. DDP: ``R * 2 psi (W - 1) / W / W``; full shard
(ZeRO-3, gather + gather + reduce-scatter): ``R * 3 psi (W - 1) / W / W``. gloo's
algorithms for the W-rank collectives need not be rings: the measured column says
what they did.

Output: ``benchmarks/results/two_nodes-<time>.json`` (everything: machine, command,
per-rank records) and ``.md`` (the table).

Needs root (namespaces, veth, tc) and iproute2; :func:`preflight` says what is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import inspect
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, cast

REPO = Path(__file__).resolve().parents[1]
NS_PREFIX = "skt2n-"
"""Every namespace this benchmark creates starts with it (``--cleanup`` removes them)."""
RDZV_PORT = 29400
NPROC_PER_NODE = 2
NNODES = 2

__all__ = [
    "STRATEGY_NAMES",
    "Cluster",
    "agent_command",
    "bytes_formula",
    "cluster_for",
    "leftover_namespaces",
    "parse_rate",
    "preflight",
    "render_markdown",
    "setup_commands",
    "strategies",
    "summarize",
    "tbf_burst_bytes",
    "teardown",
    "teardown_commands",
]


# ------------------------------------------------------------------ the cluster (pure)
@dataclass(frozen=True)
class Cluster:
    """Names and addresses of the emulated two-node cluster.

    Attributes:
        tag: a short unique id (the benchmark's pid) in every name.
        namespaces: the two network namespaces, node 0 then node 1.
        veths: the veth end inside each namespace (at most 15 characters).
        addresses: each end's IPv4 address (inside its namespace only).
        prefix_len: the subnet's prefix length.
        rate: the tbf rate of each direction, as ``tc`` reads it (``1gbit``).
    """

    tag: str
    namespaces: tuple[str, str]
    veths: tuple[str, str]
    addresses: tuple[str, str]
    prefix_len: int
    rate: str


def parse_rate(rate: str) -> int:
    """Bits per second of a ``tc`` rate such as ``1gbit``, ``100mbit``, ``500kbit``.

    Raises:
        ValueError: not a number followed by ``bit`` / ``kbit`` / ``mbit`` / ``gbit``.
    """
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}
    text = rate.strip().lower()
    for unit, scale in units.items():
        if text.endswith(unit):
            number = text[: -len(unit)]
            try:
                value = float(number)
            except ValueError:
                break
            if value > 0:
                return int(value * scale)
            break
    raise ValueError(f"link rate {rate!r}: give a positive number and a unit, e.g. 1gbit, 100mbit")


def cluster_for(tag: str | int, rate: str = "1gbit", subnet: int | None = None) -> Cluster:
    """The cluster of run ``tag``: namespaces ``skt2n-<tag>-0|1``, veths ``sk<tag>a|b``,
    addresses ``10.213.<subnet>.1|2/30`` (``subnet`` defaults to ``tag`` mod 250)."""
    parse_rate(rate)
    tag = str(tag)
    k = (int(tag) if tag.isdigit() else sum(map(ord, tag))) % 250 if subnet is None else subnet
    short = tag[-10:]
    return Cluster(
        tag=tag,
        namespaces=(f"{NS_PREFIX}{tag}-0", f"{NS_PREFIX}{tag}-1"),
        veths=(f"sk{short}a", f"sk{short}b"),
        addresses=(f"10.213.{k}.1", f"10.213.{k}.2"),
        prefix_len=30,
        rate=rate,
    )


def tbf_burst_bytes(rate: str) -> int:
    """The tbf bucket: 1 ms at the rate, at least 16 KiB (above the MTU and the
    rate per kernel tick)."""
    return max(parse_rate(rate) // 8 // 1000, 16 * 1024)


def setup_commands(cluster: Cluster) -> list[list[str]]:
    """The ``ip`` / ``tc`` commands that create the cluster, in order."""
    ns, veth, addr = cluster.namespaces, cluster.veths, cluster.addresses
    burst = tbf_burst_bytes(cluster.rate)
    commands = [
        ["ip", "netns", "add", ns[0]],
        ["ip", "netns", "add", ns[1]],
        ["ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]],
    ]
    for i in (0, 1):
        commands += [
            ["ip", "link", "set", veth[i], "netns", ns[i]],
            ["ip", "-n", ns[i], "addr", "add", f"{addr[i]}/{cluster.prefix_len}", "dev", veth[i]],
            ["ip", "-n", ns[i], "link", "set", "lo", "up"],
            ["ip", "-n", ns[i], "link", "set", veth[i], "up"],
            # tbf on each end's egress: each direction of the link capped at the rate
            ["ip", "netns", "exec", ns[i], "tc", "qdisc", "add", "dev", veth[i], "root", "tbf"]
            + ["rate", cluster.rate, "burst", str(burst), "latency", "50ms"],
        ]
    return commands


def teardown_commands(cluster: Cluster) -> list[list[str]]:
    """The commands that remove the cluster (deleting a namespace deletes its veth end,
    and with it the pair)."""
    return [["ip", "netns", "delete", ns] for ns in cluster.namespaces]


def agent_command(
    cluster: Cluster,
    node: int,
    spec_path: str | Path,
    rdzv_id: str,
    torchrun: str | Path | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> list[str]:
    """The command that runs node ``node``'s torchrun agent in its namespace (see
    [Note: the emulated cluster]); the workers run ``--worker spec_path``."""
    torchrun = torchrun or Path(sys.executable).with_name("torchrun")
    env = {
        "GLOO_SOCKET_IFNAME": cluster.veths[node],
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "SHARDKIT_TWO_NODES_NODE": str(node),
        **(extra_env or {}),
    }
    return [
        "ip",
        "netns",
        "exec",
        cluster.namespaces[node],
        "env",
        *(f"{k}={v}" for k, v in env.items()),
        str(torchrun),
        "--nnodes",
        str(NNODES),
        "--node-rank",
        str(node),
        "--nproc-per-node",
        str(NPROC_PER_NODE),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{cluster.addresses[0]}:{RDZV_PORT}",
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        f"is_host={1 if node == 0 else 0}",
        "--local-addr",
        cluster.addresses[node],
        "--max-restarts",
        "0",
        "-m",
        "benchmarks.two_nodes",
        "--worker",
        str(spec_path),
    ]


def preflight() -> str | None:
    """Why the live benchmark cannot run here (None: it can): not Linux, not root, no
    ``ip`` or ``tc``, or namespaces cannot be created (a container without
    CAP_SYS_ADMIN)."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "needs root (ip netns add, veth, tc qdisc); run it as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2) on PATH"
    probe = f"{NS_PREFIX}probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


# --------------------------------------------------------------------------- formulas
def bytes_formula(
    kind: str, psi: int, replicas: int, shard: int, bytes_per_element: int = 4
) -> float | None:
    """Bytes each rank sends across nodes per step, by the formulas of [Note: what is
    measured]; ``kind``: ``ddp``, ``full_shard``, ``hybrid`` or ``hybrid_half`` (hybrid
    with bf16 / fp16 compression: 2 bytes per element). None for another kind
    (PowerSGD: depends on the shard shapes)."""
    world = replicas * shard
    if kind == "hybrid_half":  # hybrid + bf16 / fp16 compression: 2 bytes per element
        return bytes_formula("hybrid", psi, replicas, shard, bytes_per_element=2)
    if kind == "hybrid":
        elements = 2 * psi * (replicas - 1) / (replicas * shard)
    elif kind == "ddp":
        elements = replicas * 2 * psi * (world - 1) / world / world
    elif kind == "full_shard":
        elements = replicas * 3 * psi * (world - 1) / world / world
    else:
        return None
    return elements * bytes_per_element


# ------------------------------------------------------------------------- strategies
def _fsdp2_hsdp(config: Any, spec: Mapping[str, Any]) -> Any:
    """torch FSDP2 ``fully_shard`` on a 2-D DeviceMesh (replicate x shard = HSDP):
    every Block, then the root; AdamW."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from benchmarks.common import ADAMW
    from benchmarks.runners import Runner
    from shardkit.models import GPT

    mesh = init_device_mesh("cpu", (NNODES, NPROC_PER_NODE), mesh_dim_names=("replicate", "shard"))
    model = GPT(config)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    module = cast(nn.Module, fully_shard(model, mesh=mesh))
    opt = torch.optim.AdamW(module.parameters(), **ADAMW)

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Runner(module, step, lambda: opt.state)


def _hsdp_compressed(compression: str) -> Callable[[Any, Mapping[str, Any]], Any]:
    """shardkit FSDP hybrid (one unit per Block + the root, shard groups of one node)
    with ``grad_compression=compression`` on the cross-replica all-reduce; AdamW."""

    def build(config: Any, spec: Mapping[str, Any]) -> Any:
        import torch

        from benchmarks.common import ADAMW
        from benchmarks.runners import Runner
        from shardkit.distributed.hybrid import hybrid_groups
        from shardkit.models import GPT, Block
        from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
        from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy

        groups = hybrid_groups(NPROC_PER_NODE)
        kwargs: dict[str, Any] = {
            "sharding_strategy": "HYBRID_SHARD",
            "process_group": (groups.shard, groups.replicate),
            "grad_compression": compression,
        }
        with enable_wrap(wrapper_cls=FSDP, **kwargs):
            wrapped = auto_wrap(GPT(config), transformer_auto_wrap_policy({Block}))
        module = FSDP(wrapped, **kwargs)
        opt = torch.optim.AdamW(module.parameters(), **ADAMW)

        def step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        return Runner(module, step, lambda: opt.state)

    return build


def _deepspeed_hpz(config: Any, spec: Mapping[str, Any]) -> Any:
    """DeepSpeed ZeRO-3 with ZeRO++ hpZ (secondary partition of one node) and qgZ
    (quantized gradients), fp32, on CPU. Needs the ``bench`` extra; its quantization
    kernels may need CUDA (the row then says why)."""
    import torch

    from benchmarks.common import ADAMW
    from benchmarks.runners import Runner, deepspeed_on_cpu
    from shardkit.models import GPT

    deepspeed_on_cpu()
    import deepspeed  # type: ignore[import-not-found]

    ds_config = {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": 3,
            "zero_hpz_partition_size": NPROC_PER_NODE,
            "zero_quantized_gradients": True,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }
    model = GPT(config)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), **ADAMW), config=ds_config
    )
    return Runner(engine, engine.step, lambda: engine.optimizer.state, engine.backward)


def _fsdp_has_grad_compression() -> bool:
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP

    return "grad_compression" in inspect.signature(FSDP.__init__).parameters


@dataclass(frozen=True)
class TwoNodeStrategy:
    """A row: ``name``, ``formula`` (a :func:`bytes_formula` kind, or None),
    ``build(config, spec) -> Runner`` (or the name of a
    :data:`benchmarks.runners.BY_NAME` entry, for the rows the compare harness has
    too), ``requires`` (a module that must import, else the run lists the row as not
    installed: :func:`unavailable_reason`)."""

    name: str
    formula: str | None
    build: str | Callable[[Any, Mapping[str, Any]], Any]
    requires: str | None = None


STRATEGY_NAMES = (
    "torch DDP",
    "torch FSDP2 HSDP (2-D mesh)",
    "DeepSpeed ZeRO-3 hpZ + qgZ",
    "shardkit fsdp",
    "shardkit hsdp",
    "shardkit hsdp + bf16",
    "shardkit hsdp + PowerSGD",
)
"""Every row, in table order; torch DDP (the first) is the baseline of the ratios."""


def strategies() -> dict[str, TwoNodeStrategy]:
    """The rows of :data:`STRATEGY_NAMES`."""
    rows = [
        TwoNodeStrategy("torch DDP", "ddp", "torch DDP"),
        TwoNodeStrategy("torch FSDP2 HSDP (2-D mesh)", "hybrid", _fsdp2_hsdp),
        TwoNodeStrategy("DeepSpeed ZeRO-3 hpZ + qgZ", None, _deepspeed_hpz, "deepspeed"),
        TwoNodeStrategy("shardkit fsdp", "full_shard", "shardkit fsdp"),
        TwoNodeStrategy("shardkit hsdp", "hybrid", "shardkit hsdp"),
        TwoNodeStrategy("shardkit hsdp + bf16", "hybrid_half", _hsdp_compressed("bf16")),
        TwoNodeStrategy("shardkit hsdp + PowerSGD", None, _hsdp_compressed("powersgd")),
    ]
    return {row.name: row for row in rows}


def unavailable_reason(row: TwoNodeStrategy) -> str | None:
    """Why ``row`` cannot run here (None: it can): a package not installed, or shardkit
    FSDP without ``grad_compression=`` for the compressed rows."""
    if row.requires is not None and importlib.util.find_spec(row.requires) is None:
        return f"not installed ({row.requires})"
    if "+" in row.name and row.name.startswith("shardkit") and not _fsdp_has_grad_compression():
        return "not available: FullyShardedDataParallel has no grad_compression= here"
    return None


# ----------------------------------------------------------------------- worker side
def link_bytes(interface: str) -> tuple[int, int, int]:
    """``(tx bytes, rx bytes, tx packets)`` of ``interface`` in this process's network
    namespace (``/proc/net/dev``: that of the namespace, whatever /sys shows)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == interface:
            fields = rest.split()
            return int(fields[8]), int(fields[0]), int(fields[9])
    raise KeyError(f"no interface {interface!r} in /proc/net/dev")


def qdisc_drops(interface: str) -> int | None:
    """Packets the tbf on ``interface`` dropped so far (``tc -s qdisc``); None where
    ``tc`` cannot say."""
    done = subprocess.run(
        ["tc", "-s", "qdisc", "show", "dev", interface], capture_output=True, text=True
    )
    words = done.stdout.replace(",", " ").replace("(", " ").split()
    if done.returncode != 0 or "dropped" not in words:
        return None
    return int(words[words.index("dropped") + 1])


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
    from benchmarks.runners import BY_NAME
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
        row = strategies()[spec["strategy"]]
        build = BY_NAME[row.build].build if isinstance(row.build, str) else row.build
        runner = build(config, spec)
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


# ----------------------------------------------------------------- orchestrator side
class _Interrupted(Exception):
    """A signal arrived; raised so that ``finally`` blocks remove the namespaces."""


def _on_signal(signum: int, frame: FrameType | None) -> None:
    raise _Interrupted(f"signal {signal.Signals(signum).name}")


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _kill_namespace_processes(namespace: str) -> None:
    """SIGKILL every process inside ``namespace`` (all started by this benchmark)."""
    pids = _run(["ip", "netns", "pids", namespace], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def teardown(cluster: Cluster) -> list[str]:
    """Kill what runs inside the cluster's namespaces, delete them; the errors (none
    when the namespaces are gone)."""
    errors = []
    existing = set(_run(["ip", "netns", "list"], check=False).stdout.split())
    for ns in cluster.namespaces:
        if ns in existing:
            _kill_namespace_processes(ns)
    time.sleep(0.2)
    for cmd in teardown_commands(cluster):
        if cmd[-1] in existing:
            done = _run(cmd, check=False)
            if done.returncode != 0:
                errors.append(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return errors


def leftover_namespaces() -> list[str]:
    """Namespaces named by this benchmark (:data:`NS_PREFIX`) that exist now."""
    listed = _run(["ip", "netns", "list"], check=False).stdout.splitlines()
    return [line.split()[0] for line in listed if line.startswith(NS_PREFIX)]


@contextlib.contextmanager
def emulated_cluster(cluster: Cluster) -> Iterator[Cluster]:
    """Create the cluster; remove it at exit, also on an exception or a signal
    (SIGINT, SIGTERM, SIGHUP raise inside the block)."""
    previous = {
        s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    try:
        for cmd in setup_commands(cluster):
            _run(cmd)
        yield cluster
    finally:
        errors = teardown(cluster)
        for s, handler in previous.items():
            signal.signal(s, handler)
        if errors:
            print("teardown: " + "; ".join(errors), file=sys.stderr)


def _wait_agents(
    procs: list[subprocess.Popen[bytes]], timeout_s: float, grace_s: float = 20.0
) -> tuple[list[int | None], bool]:
    """Wait for both agents; once one fails the other gets ``grace_s`` seconds. The
    exit codes (None: killed) and whether the deadline passed."""
    deadline = time.monotonic() + timeout_s
    timed_out = False
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if any(p.poll() not in (None, 0) for p in procs):
            deadline = min(deadline, now + grace_s)
        if now > deadline:
            timed_out = not any(p.poll() not in (None, 0) for p in procs)
            break
        time.sleep(0.2)
    codes: list[int | None] = []
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            codes.append(None)
        else:
            codes.append(p.returncode)
    return codes, timed_out


def run_strategy(
    cluster: Cluster, name: str, spec: dict[str, Any], workdir: Path, timeout_s: float
) -> dict[str, Any]:
    """One strategy on the cluster (a fresh pair of agents); ``{"error": ...}`` on
    failure, never an exception (except a signal)."""
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
    os.chmod(run_dir, 0o777)
    spec = {**spec, "strategy": name, "result": str(run_dir / "result.json")}
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    rdzv_id = f"two-nodes-{cluster.tag}-{run_dir.name}"
    procs, logs = [], []
    started = time.perf_counter()
    try:
        for node in (0, 1):
            log = open(run_dir / f"agent{node}.log", "wb")  # noqa: SIM115 (closed below)
            logs.append(log)
            cmd = agent_command(cluster, node, spec_path, rdzv_id)
            procs.append(
                subprocess.Popen(
                    cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        codes, timed_out = _wait_agents(procs, timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
        for ns in cluster.namespaces:  # nothing of this run outlives it
            _kill_namespace_processes(ns)
    record: dict[str, Any] = {"strategy": name, "wall_s": time.perf_counter() - started}
    result = Path(spec["result"])
    if result.exists() and all(c == 0 for c in codes):
        record.update(json.loads(result.read_text()))
        return record
    errors = sorted(run_dir.glob("error-rank*.txt"))
    if errors:
        record["error"] = f"{errors[0].stem[6:]}: {errors[0].read_text().strip()}"
    elif timed_out:
        record["error"] = f"timed out after {timeout_s:.0f} s"
    else:  # no Python error: a worker died of a signal (e.g. SIGABRT in native code)
        text = "\n".join((run_dir / f"agent{n}.log").read_text(errors="replace") for n in (0, 1))
        causes = [line.strip() for line in text.splitlines() if "traceback : Signal" in line]
        killed = ("SIGTERM", "SIGKILL")  # the agents ending the others: not the cause
        cause = next((c for c in causes if not any(k in c for k in killed)), None)
        cause = cause or (causes[0] if causes else None)
        record["error"] = f"agents exited {codes}" + (f": {cause}" if cause else "")
        record["crashed"] = True
    record["agent_log_tail"] = {
        f"node{n}": (run_dir / f"agent{n}.log").read_text(errors="replace")[-3000:] for n in (0, 1)
    }
    return record


# -------------------------------------------------------------------------- summary
def summarize(
    records: list[dict[str, Any]], psi: int, rate: str, replicas: int = NNODES
) -> list[dict[str, Any]]:
    """One row per strategy of one rate (its records of every round together): step
    time (median over every timed step), ratio to DDP (the median over rounds of the
    round's median over DDP's in the same round, and each round's), link bytes per step
    (total and per rank) against the formula, loss vs DDP (largest difference, same
    round)."""
    rows_by_name = strategies()
    world = replicas * NPROC_PER_NODE
    names = list(dict.fromkeys(rec["strategy"] for rec in records))
    ok = [rec for rec in records if "times" in rec]
    ddp = {rec.get("round", 0): rec for rec in ok if rec["strategy"] == "torch DDP"}
    rows = []
    for name in names:
        row: dict[str, Any] = {"strategy": name, "rate": rate}
        mine = [rec for rec in ok if rec["strategy"] == name]
        if not mine:
            failed = next(rec for rec in records if rec["strategy"] == name)
            row["status"] = failed.get("error", "not run")
            rows.append(row)
            continue
        times = [t for rec in mine for t in rec["times"]]
        steps = len(times)
        rounds = [
            statistics.median(rec["times"]) / statistics.median(ddp[rec.get("round", 0)]["times"])
            for rec in mine
            if rec.get("round", 0) in ddp
        ]
        nodes = [r for rec in mine for r in rec["ranks"] if r["tx_bytes"] is not None]
        link = sum(r["tx_bytes"] for r in nodes)
        per_rank = link / steps / world
        formula = rows_by_name[name].formula
        expected = bytes_formula(formula, psi, replicas, NPROC_PER_NODE) if formula else None
        comm_volume = sum(
            statistics.mean(r["comm"]["total_volume_bytes"] for r in rec["ranks"]) for rec in mine
        )
        packets = sum(r.get("tx_packets") or 0 for r in nodes)
        drops = [r.get("tbf_drops") for r in nodes]
        losses = [
            abs(a - b)
            for rec in mine
            if rec.get("round", 0) in ddp
            for a, b in zip(rec["losses"], ddp[rec.get("round", 0)]["losses"])
        ]
        row.update(
            status="ok",
            rounds=len(mine),
            step_s=statistics.median(times),
            step_s_all=times,
            x_ddp=statistics.median(rounds) if rounds else None,
            x_ddp_rounds=rounds,
            link_bytes_per_step=link / steps,
            link_bytes_per_step_per_rank=per_rank,
            formula_bytes_per_rank=expected,
            x_formula=per_rank / expected if expected else None,
            comm_volume_per_step_per_rank=comm_volume / steps,
            link_bytes_per_packet=link / packets if packets else None,
            tbf_drops=sum(drops) if drops and None not in drops else None,
            loss_final=mine[-1]["losses"][-1],
            loss_vs_ddp=max(losses) if losses else None,
        )
        rows.append(row)
    full = next((r for r in rows if r["strategy"] == "shardkit fsdp" and "step_s" in r), None)
    for row in rows:
        if full and "step_s" in row:
            row["x_full_shard_bytes"] = (
                row["link_bytes_per_step"] / full["link_bytes_per_step"]
                if full["link_bytes_per_step"]
                else None
            )
    return rows


def _fmt(value: Any, spec: str) -> str:
    return (
        "-" if value is None or (isinstance(value, float) and math.isnan(value)) else spec % value
    )


def _ratio(row: Mapping[str, Any]) -> str:
    """x DDP, with each round's ratio in brackets where there were several rounds."""
    text = _fmt(row.get("x_ddp"), "%.2f")
    rounds = row.get("x_ddp_rounds") or []
    if len(rounds) > 1:
        text += " [" + ", ".join(f"{r:.2f}" for r in rounds) + "]"
    return text


def render_markdown(rows: list[dict[str, Any]], notes: Sequence[str] = ()) -> str:
    """The table of :func:`summarize`'s rows (all rates)."""
    head = (
        "| link | strategy | step s (median) | x DDP | link MiB/step (both ways) | "
        "per rank MiB | formula MiB/rank | x formula | x full shard | loss vs DDP |"
    )
    lines = [head, "|" + "---|" * 10]
    mib = 2**20
    for row in rows:
        if row.get("status") != "ok":
            status = " ".join(str(row.get("status", "-")).split()).replace("|", "/")[:300]
            lines.append(
                f"| {row['rate']} | {row['strategy']} | {status} | - | - | - | - | - | - | - |"
            )
            continue
        formula = row["formula_bytes_per_rank"]
        lines.append(
            f"| {row['rate']} | {row['strategy']} | {row['step_s']:.3f} "
            f"| {_ratio(row)} | {row['link_bytes_per_step'] / mib:.2f} "
            f"| {row['link_bytes_per_step_per_rank'] / mib:.3f} "
            f"| {_fmt(formula / mib if formula else None, '%.3f')} "
            f"| {_fmt(row['x_formula'], '%.2f')} | {_fmt(row.get('x_full_shard_bytes'), '%.2f')} "
            f"| {_fmt(row['loss_vs_ddp'], '%.1e')} |"
        )
    return "\n".join([*lines, "", *(f"- {n}" for n in notes)]) + "\n"


# ------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.two_nodes",
        description="2 nodes x 2 ranks in network namespaces over a tc-capped veth link.",
    )
    add = parser.add_argument
    add("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    add("--rate", nargs="+", default=["1gbit"], help="link rate(s), tc syntax (default 1gbit)")
    add("--model-size", default="tiny", help="GPT size (benchmarks.compare's; default tiny)")
    add("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    add("--batch", type=int, default=4, help="sequences per rank (default 4)")
    add("--steps", type=int, default=3, help="timed steps (default 3)")
    add("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    add("--rounds", type=int, default=1, help="rounds, the order rotated each (default 1)")
    add("--strategies", nargs="+", default=list(STRATEGY_NAMES), help="rows to run")
    add("--timeout", type=float, default=300.0, help="seconds per strategy (default 300)")
    add(
        "--retries",
        type=int,
        default=1,
        help="re-runs of a strategy whose worker crashed in native code (default 1)",
    )
    add("--out", type=Path, default=REPO / "benchmarks" / "results", help="results folder")
    add("--dry-run", action="store_true", help="print the commands and exit")
    add("--cleanup", action="store_true", help="remove namespaces left by a killed run")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        return worker(args.worker)
    unknown = [s for s in args.strategies if s not in STRATEGY_NAMES]
    if unknown:
        print(f"unknown strategies {unknown}; choose from {list(STRATEGY_NAMES)}", file=sys.stderr)
        return 2
    for rate in args.rate:
        parse_rate(rate)
    if args.dry_run:
        cluster = cluster_for(os.getpid(), args.rate[0])
        for cmd in [
            *setup_commands(cluster),
            *(agent_command(cluster, n, "SPEC", "ID") for n in (0, 1)),
        ]:
            print(" ".join(cmd))
        for cmd in teardown_commands(cluster):
            print(" ".join(cmd))
        return 0
    reason = preflight()
    if reason is not None:
        print(f"benchmarks.two_nodes: {reason}", file=sys.stderr)
        return 2
    if args.cleanup:
        for ns in leftover_namespaces():
            _kill_namespace_processes(ns)
            _run(["ip", "netns", "delete", ns], check=False)
            print(f"removed {ns}")
        return 0
    try:
        return _bench(args, argv)
    except _Interrupted as err:  # the namespaces are gone already (emulated_cluster)
        print(f"benchmarks.two_nodes: interrupted by {err}; namespaces removed", file=sys.stderr)
        return 130


def _bench(args: argparse.Namespace, argv: list[str] | None) -> int:
    from benchmarks.common import command, machine, timestamp
    from benchmarks.compare import model_config, num_params

    config = model_config(args.model_size, args.seq_len)
    psi = num_params(config)
    spec = {
        "model": dataclasses.asdict(config),
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "pg_timeout": int(args.timeout),
    }
    rows_by_name = strategies()
    notes, records_by_rate = [], {}
    start_machine = machine()
    stamp = timestamp()
    run_list = []
    for name in args.strategies:
        why = unavailable_reason(rows_by_name[name])
        if why:
            notes.append(f"{name}: {why}")
        else:
            run_list.append(name)
    with tempfile.TemporaryDirectory(prefix="shardkit-two-nodes-") as tmp:
        os.chmod(tmp, 0o777)
        for k, rate in enumerate(args.rate):
            cluster = cluster_for(f"{os.getpid()}{k}", rate)
            spec["veths"] = list(cluster.veths)
            records = []
            with emulated_cluster(cluster):
                # round r runs the strategies rotated by r: the load of the moment falls
                # on all of them alike and none always runs first
                order = [
                    (r, run_list[(i + r) % len(run_list)])
                    for r in range(args.rounds)
                    for i in range(len(run_list))
                ]
                for round_index, name in order:
                    print(f"[{rate}] {name} ...", file=sys.stderr, flush=True)
                    rec = run_strategy(cluster, name, spec, Path(tmp), args.timeout)
                    failed: list[str] = []
                    while "error" in rec and rec.get("crashed") and len(failed) < args.retries:
                        failed.append(rec["error"])  # a native crash, not a Python error: again
                        print(f"[{rate}] {name}: {rec['error'][:200]}; again", file=sys.stderr)
                        rec = run_strategy(cluster, name, spec, Path(tmp), args.timeout)
                    rec["failed_attempts"] = failed
                    rec["round"] = round_index
                    print(
                        f"[{rate}] {name}: {rec.get('error') or statistics.median(rec['times'])}",
                        file=sys.stderr,
                        flush=True,
                    )
                    records.append(rec)
            records_by_rate[rate] = records
    rows = []
    for rate, records in records_by_rate.items():
        rows += summarize(records, psi, rate)
    notes = [
        f"GPT {args.model_size}: psi = {psi} parameters; {NNODES} nodes x {NPROC_PER_NODE} "
        f"ranks, batch {args.batch} x {args.seq_len} per rank, {args.steps} timed steps "
        f"after {args.warmup} warm-up in each of {args.rounds} round(s), fp32 AdamW, gloo",
        *notes,
    ]
    table = render_markdown(rows, notes)
    out: dict[str, Any] = {
        "command": command("benchmarks.two_nodes", argv),
        "machine_start": start_machine,
        "machine_end": machine(),
        "psi": psi,
        "model": dataclasses.asdict(config),
        "spec": {k: v for k, v in spec.items() if k != "veths"},
        "rows": rows,
        "records": records_by_rate,
        "notes": notes,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"two_nodes-{stamp}"
    base.with_suffix(".json").write_text(json.dumps(out, indent=1))
    base.with_suffix(".md").write_text(
        f"`{out['command']}`; load average {start_machine['loadavg']} -> "
        f"{out['machine_end']['loadavg']} on {start_machine['cpu_count']} cores\n\n{table}"
    )
    print(table)
    print(f"wrote {base}.json and .md")
    return 0 if any(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
