"""Network emulation: two nodes as Linux network namespaces joined by a tc-capped veth.

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

Needs root (namespaces, veth, tc) and iproute2; :func:`preflight` says what is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

NS_PREFIX = "skt2n-"
"""Every namespace this benchmark creates starts with it (``--cleanup`` removes them)."""
NPROC_PER_NODE = 2
NNODES = 2

__all__ = [
    "NNODES",
    "NPROC_PER_NODE",
    "NS_PREFIX",
    "Cluster",
    "Interrupted",
    "cluster_for",
    "emulated_cluster",
    "kill_namespace_processes",
    "leftover_namespaces",
    "link_bytes",
    "parse_rate",
    "preflight",
    "qdisc_drops",
    "run_command",
    "setup_commands",
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


# ----------------------------------------------------------------- orchestrator side
class Interrupted(Exception):
    """A signal arrived; raised so that ``finally`` blocks remove the namespaces."""


def _on_signal(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(f"signal {signal.Signals(signum).name}")


def run_command(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def kill_namespace_processes(namespace: str) -> None:
    """SIGKILL every process inside ``namespace`` (all started by this benchmark)."""
    pids = run_command(["ip", "netns", "pids", namespace], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def teardown(cluster: Cluster) -> list[str]:
    """Kill what runs inside the cluster's namespaces, delete them; the errors (none
    when the namespaces are gone)."""
    errors = []
    existing = set(run_command(["ip", "netns", "list"], check=False).stdout.split())
    for ns in cluster.namespaces:
        if ns in existing:
            kill_namespace_processes(ns)
    time.sleep(0.2)
    for cmd in teardown_commands(cluster):
        if cmd[-1] in existing:
            done = run_command(cmd, check=False)
            if done.returncode != 0:
                errors.append(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return errors


def leftover_namespaces() -> list[str]:
    """Namespaces named by this benchmark (:data:`NS_PREFIX`) that exist now."""
    listed = run_command(["ip", "netns", "list"], check=False).stdout.splitlines()
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
            run_command(cmd)
        yield cluster
    finally:
        errors = teardown(cluster)
        for s, handler in previous.items():
            signal.signal(s, handler)
        if errors:
            print("teardown: " + "; ".join(errors), file=sys.stderr)
