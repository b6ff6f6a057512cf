"""A model-parallel random-number tracker: dropout that differs across tensor-parallel
ranks where Megatron-LM says it must, and agrees where it must.

[Note: two random streams]
Inside a tensor-parallel region each rank holds a different part of the activations
(its attention heads, its MLP columns): their dropout masks must be *independent*
across ranks, or every rank drops the same positions of different heads. Outside
(the replicated residual stream, after a row-parallel all-reduce) every rank holds the
same activations and must drop the *same* elements, or the replicas diverge. Megatron-LM
(Shoeybi et al. 2019, section 3; ``mpu/random.py``) therefore keeps the default
generator seeded the same on every tensor-parallel rank, and a second, named state
seeded ``seed + 2718 + tp_rank`` that code swaps in with :meth:`RNGStatesTracker.fork`
around region-local dropout.

The tracker swaps the CPU generator's state and, where CUDA is available, the current
CUDA device's, so the same code gives the same behaviour on gloo and NCCL.

[Note: forks under activation checkpointing]
``torch.utils.checkpoint`` replays the default generators in the recompute, not the
tracker's state, which the forward has advanced meanwhile: a fork in the recompute
would draw different dropout masks than in the forward (silently wrong gradients).
:meth:`RNGStatesTracker.fork` therefore starts from
:func:`shardkit.nn.checkpoint.replayed` of its state: in a checkpointed region's
recompute, the state the same fork started from in the forward; and a fork in a
recompute leaves the tracker's state where it was (the draws were made once already).
This covers every region checkpointed by shardkit (``checkpoint_wrapper``, Pipe's and
OffloadModel's checkpointing), as Megatron-LM's ``CheckpointFunction`` does for its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from shardkit.nn.checkpoint import is_recomputing, replayed
from shardkit.nn.tensor_parallel.groups import TPGroup, rank_and_size, resolve_group

__all__ = [
    "MODEL_PARALLEL_RNG",
    "RNGStatesTracker",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "model_parallel_manual_seed",
]

#: The name of the tensor-parallel state (Megatron-LM's).
MODEL_PARALLEL_RNG = "model-parallel-rng"
#: Offset of the tensor-parallel seed from the user's seed (Megatron-LM's constant).
_TP_SEED_OFFSET = 2718

_States = dict[str, torch.Tensor]


def _current_states() -> _States:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_states(states: _States) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


class RNGStatesTracker:
    """Named generator states that :meth:`fork` swaps in and out.

    Example:
        >>> tracker = RNGStatesTracker()
        >>> tracker.add("model-parallel-rng", 1234 + 2718 + tp_rank)   # doctest: +SKIP
        >>> with tracker.fork():           # dropout of this rank's heads
        ...     probs = F.dropout(probs, 0.1)
    """

    def __init__(self) -> None:
        self._states: dict[str, _States] = {}
        self._seeds: set[int] = set()

    def reset(self) -> None:
        """Forget every state."""
        self._states.clear()
        self._seeds.clear()

    def get_states(self) -> dict[str, _States]:
        """A copy of the states (for a checkpoint)."""
        return {name: dict(states) for name, states in self._states.items()}

    def set_states(self, states: dict[str, _States]) -> None:
        """Replace the states (from :meth:`get_states`)."""
        self._states = {name: dict(s) for name, s in states.items()}

    def add(self, name: str, seed: int) -> None:
        """A new state ``name`` seeded with ``seed``; the current generators are unchanged.

        Raises:
            ValueError: ``name`` or ``seed`` is already used.
        """
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already used by another state")
        if name in self._states:
            raise ValueError(f"state {name!r} already exists")
        saved = _current_states()
        torch.manual_seed(seed)
        self._states[name] = _current_states()
        _set_states(saved)
        self._seeds.add(seed)

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from state ``name`` inside the block; the default state resumes after it
        exactly where it was, and ``name`` resumes where the block left it. In the
        recompute of an activation-checkpointed region the block draws what it drew in
        the forward and ``name`` is left unchanged (``[Note: forks under activation
        checkpointing]``).

        Raises:
            KeyError: no state ``name`` (call :func:`model_parallel_manual_seed`).
        """
        if name not in self._states:
            raise KeyError(f"no random state {name!r}; call model_parallel_manual_seed(seed) first")
        saved = _current_states()
        start = replayed(self._states[name])
        assert isinstance(start, dict)
        _set_states(start)
        try:
            yield
        finally:
            if not is_recomputing():
                self._states[name] = _current_states()
            _set_states(saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (FairScale / Megatron-LM: ``get_cuda_rng_tracker``)."""
    return _TRACKER


def model_parallel_manual_seed(seed: int, process_group: TPGroup = None) -> None:
    """Seed both streams of ``[Note: two random streams]``: the default generators with
    ``seed`` (the same on every tensor-parallel rank) and the tracker's
    ``"model-parallel-rng"`` state with ``seed + 2718 + tp_rank``. Resets the tracker.

    Args:
        seed: the user's seed, the same on every rank.
        process_group: the tensor-parallel group; default None (the mesh's).
    """
    group = resolve_group(process_group)
    tp_rank, _ = rank_and_size(group)
    _TRACKER.reset()
    torch.manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)


# FairScale / Megatron-LM names
get_cuda_rng_tracker = get_rng_tracker
model_parallel_cuda_manual_seed = model_parallel_manual_seed
