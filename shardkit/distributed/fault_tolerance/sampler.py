"""Which samples a replica trains on at a step, so that replicas may come and go.

An epoch is a random permutation of the dataset cut into *slots* of
``batch_size`` samples: step ``s`` of the epoch owns slots ``s R`` to ``s R + R - 1``
for ``R = max_replicas``, and replica ``i`` takes slot ``s R + i``. A slot is a
function of the step and the replica id only, never of who else is alive, so:

- with a replica missing at step ``s``, the step's global batch is the survivors'
  slots (``len(members) x batch_size`` samples); the missing replica's slot is not
  trained on in this epoch (it is not handed to anyone else: the survivors' batches
  keep their size);
- a replica that rejoins receives the committed step count and takes its slot of the
  next step, so no sample is trained on twice in an epoch: each step is committed once,
  and each member of its quorum has its own slot.
"""

from __future__ import annotations

import torch

__all__ = ["ReplicaSampler"]


class ReplicaSampler:
    """The sample indices of replica ``replica_id`` at step ``step``.

    Example::

        sampler = ReplicaSampler(len(dataset), batch_size=8, max_replicas=4, seed=0)
        rows = sampler.indices(ft.step, ft.replica_id)   # 8 indices into dataset

    Args:
        num_samples: the dataset's size (> 0).
        batch_size: samples per replica per step (> 0).
        max_replicas: the number of replica ids (slots per step, > 0).
        seed: the permutations' seed; epoch ``e`` uses ``seed + e``. Default 0.

    Raises:
        ValueError: a size < 1, or fewer samples than one step of every replica needs
            (``batch_size x max_replicas``).
    """

    def __init__(self, num_samples: int, batch_size: int, max_replicas: int, seed: int = 0) -> None:
        if min(num_samples, batch_size, max_replicas) < 1:
            raise ValueError(
                f"ReplicaSampler: num_samples={num_samples}, batch_size={batch_size}, "
                f"max_replicas={max_replicas}; all must be >= 1"
            )
        if num_samples < batch_size * max_replicas:
            raise ValueError(
                f"ReplicaSampler: {num_samples} samples do not fill one step of "
                f"{max_replicas} replicas x {batch_size} samples = {batch_size * max_replicas}; "
                "lower batch_size or max_replicas"
            )
        self.num_samples, self.batch_size = num_samples, batch_size
        self.max_replicas, self.seed = max_replicas, seed
        self._permutation: tuple[int, torch.Tensor] | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Whole steps of every replica in one pass (the remainder is left out)."""
        return self.num_samples // (self.batch_size * self.max_replicas)

    def epoch_of(self, step: int) -> int:
        """The epoch that step ``step`` belongs to."""
        return step // self.steps_per_epoch

    def indices(self, step: int, replica_id: int) -> list[int]:
        """Replica ``replica_id``'s ``batch_size`` sample indices at ``step``.

        Raises:
            ValueError: ``step < 0`` or ``replica_id`` outside ``[0, max_replicas)``.
        """
        if step < 0 or not 0 <= replica_id < self.max_replicas:
            raise ValueError(
                f"ReplicaSampler.indices: step={step}, replica_id={replica_id}; need step >= 0 "
                f"and 0 <= replica_id < max_replicas={self.max_replicas}"
            )
        epoch, within = divmod(step, self.steps_per_epoch)
        slot = within * self.max_replicas + replica_id
        start = slot * self.batch_size
        return self._epoch_permutation(epoch)[start : start + self.batch_size].tolist()

    def _epoch_permutation(self, epoch: int) -> torch.Tensor:
        if self._permutation is None or self._permutation[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._permutation = (epoch, torch.randperm(self.num_samples, generator=generator))
        return self._permutation[1]
