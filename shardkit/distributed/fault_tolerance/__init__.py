"""Fault tolerance without a restart: lose a data-parallel replica, keep training.

- :mod:`~shardkit.distributed.fault_tolerance.quorum`: the per-step quorum on a c10d
  store (:class:`Quorum`, :class:`Verdict`).
- :mod:`~shardkit.distributed.fault_tolerance.transport`: gloo groups keyed by a store
  prefix; a state sent from a live replica to a joiner; :func:`host_store` /
  :func:`connect_store`, the quorum store's server and clients.
- :mod:`~shardkit.distributed.fault_tolerance.replicas`: :class:`FaultTolerantReplicas`,
  one replica's side (quorum, healing, gradient averaging with redo).
- :mod:`~shardkit.distributed.fault_tolerance.layouts`: a replica's layout fingerprint,
  and the reduction in the plain model's index space between replicas of different
  layouts.
- :mod:`~shardkit.distributed.fault_tolerance.sampler`: :class:`ReplicaSampler`, the
  samples of a replica at a step.

[Note: the protocol]
Replicas (replica ids 0, 1, ...) share a ``TCPStore`` and nothing else: no default
process group, no world size. Each step:

1. **Quorum.** Every live replica appends ``(replica id, committed step, layout
   fingerprint, batch schedule)`` to the round's arrivals; a replica that cannot train
   with the others (another batch schedule; a layout that does not pair, such as a
   replica of several ranks without ``layout=``) is refused, the later one first
   (:func:`~shardkit.distributed.fault_tolerance.quorum.admit`). The round closes when every replica the previous round kept has
   arrived (at least ``min_replicas``), or ``join_timeout_s`` after a replica's own
   arrival; the first replica to see it closed writes the decision with
   ``compare_set`` and every replica reads that one. Members behind the highest step
   (a new or restarted replica, one dropped earlier) *heal*: each receives the
   parameters, optimizer state and step count from a member at that step, over a
   two-member gloo group, before its forward pass.
2. **Cross-replica group.** When the members change (or the last reduction failed),
   a fresh gloo group is created on a ``PrefixStore`` keyed by the round, with the
   collective timeout; otherwise the group of the round that created it is reused.
   The survivors never restart; a group that is replaced is destroyed (threads joined,
   connections closed), the last one at ``FaultTolerantReplicas.close()``.
3. **Reduction.** Each member divides its flattened gradients by the member count and
   all-reduces them (sum): the average over the replicas that contributed. Members of
   different layouts do it in the plain model's index space (:mod:`.layouts`).
4. **Verdict.** Each member appends whether its reduction succeeded. When all did,
   the verdict is *commit*: every member applies the average and advances its step.
   When one failed, or a member did not report within ``timeout_s`` (dead, or slow),
   the verdict is *redo* with the members that reported: they arrive at a redo round
   (joiners wait for the next), build a new group and reduce their own, unchanged
   gradients again, divided by the new count. The verdict is written once, so every
   survivor applies the same average (no divergence); a member left out (slow, late)
   skips its optimizer step and heals at its next quorum.

[Note: why a TCPStore of our own, not torchrun's rendezvous]
torchrun's c10d rendezvous is a restart mechanism: a membership change restarts the
workers of every agent, which is what this package avoids, and its store belongs to
one agent's job. A plain ``TCPStore`` (started by a small process every replica
reaches, like torchft's lighthouse, or by the launcher) gives what the protocol needs:
atomic ``add``, ``append`` and ``compare_set``, and ``PrefixStore`` for the gloo
groups of each quorum. Like the rendezvous host, the store's host must survive.

Source: torchft (PyTorch, 2024): a quorum per step through a lighthouse, a
reconfigurable process group per quorum, ``should_commit`` before the optimizer step,
and live recovery from a peer. This is shardkit's own implementation on gloo.
"""

from shardkit.distributed.fault_tolerance.quorum import (
    Quorum,
    QuorumTimeoutError,
    ReplicaMismatchError,
    Verdict,
)
from shardkit.distributed.fault_tolerance.replicas import (
    FaultTolerantReplicas,
    ReplicaState,
    ReplicaStats,
)
from shardkit.distributed.fault_tolerance.sampler import ReplicaSampler
from shardkit.distributed.fault_tolerance.transport import connect_store, host_store

__all__ = [
    "FaultTolerantReplicas",
    "Quorum",
    "QuorumTimeoutError",
    "ReplicaMismatchError",
    "ReplicaSampler",
    "ReplicaState",
    "ReplicaStats",
    "Verdict",
    "connect_store",
    "host_store",
]
