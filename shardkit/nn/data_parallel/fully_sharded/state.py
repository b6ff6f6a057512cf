"""Runtime state machines of one FSDP unit: what it is doing, and whether it is sharded.

Both are owned by the unit's runtime,
:class:`~shardkit.nn.data_parallel.fully_sharded.unit.UnitRuntime`; transitions happen
only in its small named methods (``unshard``, ``reshard``, ``begin_summon`` /
``end_summon``) and its phase hooks (``pre_forward`` ... ``end_backward``).
"""

from __future__ import annotations

import enum

__all__ = ["ShardedState", "TrainingState"]


class TrainingState(enum.Enum):
    """What a unit is doing in the training step.

    - ``IDLE``: between steps, and after ``finalize_backward``. Parameters are sharded
      (the root may still be unsharded after a forward pass that expects a backward).
    - ``FORWARD``: entered in ``pre_forward`` (after the all-gather), left in
      ``post_forward``.
    - ``PRE_BACKWARD``: entered when the gradient of one of the unit's outputs is first
      computed (the unit's parameters are all-gathered again); the unit waits for its
      parameters' gradients.
    - ``POST_BACKWARD``: entered when every trainable parameter of the unit has its
      gradient; the reduce-scatter is issued and the parameters are resharded.
    - ``SUMMON_FULL_PARAMS``: inside ``summon_full_params``.
    """

    IDLE = enum.auto()
    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()


class ShardedState(enum.Enum):
    """Whether a unit's full parameters exist on this rank.

    - ``SHARDED``: only this rank's shard exists; the module's attributes hold the
      sharded parameters (1-D pieces). Entered at construction and by ``_reshard``.
    - ``UNSHARDING``: an asynchronous all-gather (a prefetch) is in flight into the
      full flat buffer; the module still holds the sharded parameters.
    - ``UNSHARDED``: the full flat buffer holds every rank's shard and the module's
      attributes hold full-shape views of it. Entered by ``_unshard``.
    """

    SHARDED = enum.auto()
    UNSHARDING = enum.auto()
    UNSHARDED = enum.auto()
