"""Context parallelism: attention over a sequence split across ranks.

:class:`DistributedAttention` (Ulysses, DeepSpeed's name and layout: all-to-all from a
sequence slice to a head slice and back), :class:`RingAttention` / :func:`ring_attention`
(K/V blocks passed around the ranks, online softmax; zig-zag load balancing when causal),
and the split of a batch's sequence over the ``cp`` ranks (:func:`split_sequence`,
:func:`combine_sequence`, :func:`position_ids`, :func:`token_mean_loss`). The ranks come
from the mesh's ``"cp"`` group (``shardkit.distributed.mesh``); the parameters are
replicated over it, so the data-parallel wrappers take ``"dp_shard_cp"``.
"""

from shardkit.nn.context_parallel.ring import RingAttention, ring_attention
from shardkit.nn.context_parallel.sequence_all_to_all import sequence_all_to_all
from shardkit.nn.context_parallel.split import (
    combine_sequence,
    position_ids,
    split_sequence,
    token_mean_loss,
)
from shardkit.nn.context_parallel.ulysses import DistributedAttention

__all__ = [
    "DistributedAttention",
    "RingAttention",
    "combine_sequence",
    "position_ids",
    "ring_attention",
    "sequence_all_to_all",
    "split_sequence",
    "token_mean_loss",
]
