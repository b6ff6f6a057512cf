"""Two nodes on one machine, over a slow link: every multi-node strategy side by side.

Run (as root, with ``ip`` and ``tc``)::

    python -m benchmarks.two_nodes                        # GPT tiny, link 1 Gbit/s
    python -m benchmarks.two_nodes --rate 1gbit 100mbit   # one table row set per rate
    python -m benchmarks.two_nodes --model-size small --steps 5 --strategies "torch DDP" "shardkit hsdp"
    python -m benchmarks.two_nodes --dry-run              # print the commands, run nothing
    python -m benchmarks.two_nodes --cleanup              # remove namespaces left by a killed run

The package, one purpose a module (``python -m benchmarks.two_nodes`` runs :mod:`.cli`):

- :mod:`benchmarks.two_nodes.netem`: the emulated cluster, namespaces, veth, tc token
  bucket (commands, creation, teardown, the kernel's byte counters); [Note: the emulated
  cluster].
- :mod:`benchmarks.two_nodes.rows`: the strategies compared (one registry: the rows of
  :data:`benchmarks.runners.BY_NAME`, and the two-node-only builders as entries of the
  same kind) and each row's link-byte formula.
- :mod:`benchmarks.two_nodes.worker`: the body of every rank.
- :mod:`benchmarks.two_nodes.launch`: one strategy on the cluster (a torchrun agent per
  node in its namespace).
- :mod:`benchmarks.two_nodes.report`: the formulas, the summary rows, the table;
  [Note: what is measured].
- :mod:`benchmarks.two_nodes.cli`: the command line and the run over rates and rounds.

Output: ``benchmarks/results/two_nodes-<time>.json`` (everything: machine, command,
per-rank records) and ``.md`` (the table).

Needs root (namespaces, veth, tc) and iproute2; :func:`preflight` says what is missing.
"""

from __future__ import annotations

from benchmarks.two_nodes.cli import main
from benchmarks.two_nodes.launch import RDZV_PORT, REPO, agent_command, run_strategy
from benchmarks.two_nodes.netem import (
    NNODES,
    NPROC_PER_NODE,
    NS_PREFIX,
    Cluster,
    cluster_for,
    emulated_cluster,
    leftover_namespaces,
    parse_rate,
    preflight,
    setup_commands,
    tbf_burst_bytes,
    teardown,
    teardown_commands,
)
from benchmarks.two_nodes.report import bytes_formula, render_markdown, summarize
from benchmarks.two_nodes.rows import LINK_FORMULA, STRATEGY_NAMES, strategies
from benchmarks.two_nodes.worker import worker

__all__ = [
    "LINK_FORMULA",
    "NNODES",
    "NPROC_PER_NODE",
    "NS_PREFIX",
    "RDZV_PORT",
    "REPO",
    "STRATEGY_NAMES",
    "Cluster",
    "agent_command",
    "bytes_formula",
    "cluster_for",
    "emulated_cluster",
    "leftover_namespaces",
    "main",
    "parse_rate",
    "preflight",
    "render_markdown",
    "run_strategy",
    "setup_commands",
    "strategies",
    "summarize",
    "tbf_burst_bytes",
    "teardown",
    "teardown_commands",
    "worker",
]
