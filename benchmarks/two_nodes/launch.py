"""One strategy on the emulated cluster: a torchrun agent per node, in its namespace
(the real multi-node launch path, [Note: the emulated cluster] in
:mod:`benchmarks.two_nodes.netem`), the wait, the result or the error."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.two_nodes.netem import NNODES, NPROC_PER_NODE, Cluster, kill_namespace_processes

REPO = Path(__file__).resolve().parents[2]
RDZV_PORT = 29400

__all__ = ["RDZV_PORT", "REPO", "agent_command", "run_strategy"]


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
            kill_namespace_processes(ns)
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
