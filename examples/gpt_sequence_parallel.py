"""The main job's sequence parallelism: ``--sequence-parallel`` with ``--tp T``.

The GPT is split by ``tp.gpt_plan(sequence_parallel=True)`` (Megatron-LM's sequence
parallelism, Korthikanti et al. 2022, section 4.2.2): between the tensor-parallel
regions each rank holds ``seq_len / T`` positions of the residual stream, its
LayerNorms and dropouts run on them, the column-parallel layers all-gather their input
and the row-parallel ones reduce-scatter their output. Outputs, gradients and the bytes
per block are those of ``--tp T`` alone; the blocks keep less for backward.
"""

from __future__ import annotations

__all__ = ["sequence_parallel_error"]


def sequence_parallel_error(enabled: bool, tp: int, seq_len: int, strategy: str) -> str | None:
    """Why ``--sequence-parallel`` does not fit the other flags, or None when it does
    (or is off).

    Args:
        enabled: ``--sequence-parallel``.
        tp: ``--tp``.
        seq_len: ``--seq-len`` (tokens per row, split over the ``tp`` ranks).
        strategy: ``--strategy``.
    """
    if not enabled:
        return None
    if tp == 1:
        return (
            "--sequence-parallel splits each sequence over the tensor-parallel ranks; it "
            "needs --tp > 1 (got --tp 1): add --tp 2 (or more) or drop --sequence-parallel"
        )
    if strategy == "pipe":
        return (
            "--sequence-parallel applies to --strategy ddp / oss / sdp / fsdp / hsdp, not "
            "'pipe' (sequence chunks through pipeline stages are not tested); drop "
            "--sequence-parallel or use --strategy fsdp"
        )
    if seq_len % tp:
        return (
            f"--seq-len {seq_len} is not divisible by --tp {tp} (--sequence-parallel splits "
            f"each sequence into {tp} equal chunks); choose a --seq-len that is a multiple "
            f"of {tp}"
        )
    return None
