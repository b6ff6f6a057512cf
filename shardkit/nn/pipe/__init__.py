"""Pipeline parallelism: a model split by depth into stages that micro-batches flow through.

- :class:`Pipe`: one process, one partition per device (``"cpu"`` allowed), GPipe
  clock order, activation checkpointing, deferred BatchNorm (torchgpipe / FairScale).
- :class:`PipelineStage` with :class:`ScheduleGPipe` or :class:`Schedule1F1B`: one
  stage per rank, activations and gradients by send/recv over a process group.
- Balancing (:func:`balance_by_size`, :func:`balance_by_time`), partitioning
  (:func:`stage_module`) and state (:func:`consolidated_state_dict`).

Modules: ``microbatch`` (split/gather), ``partition`` and ``balance``, ``checkpoint``
and ``batchnorm``, ``stream`` and ``copy`` (device abstraction), ``schedule`` (pure
orders), ``pipeline`` and ``pipe`` (one process), ``p2p``, ``stage``, ``runtime`` and
``state`` and ``failure`` (across ranks).
"""

import shardkit.nn.pipe.universal_layout  # noqa: F401 (registers the universal-checkpoint adapter)
from shardkit.nn.pipe.balance import balance_by_size, balance_by_time, solve_balance
from shardkit.nn.pipe.batchnorm import DeferredBatchNorm
from shardkit.nn.pipe.checkpoint import CheckpointMode, is_recomputing
from shardkit.nn.pipe.failure import StageFailedError
from shardkit.nn.pipe.partition import BalanceError, split_module, stage_module
from shardkit.nn.pipe.pipe import Pipe
from shardkit.nn.pipe.runtime import Schedule1F1B, ScheduleGPipe
from shardkit.nn.pipe.schedule import bubble_fraction, gpipe_actions, one_f_one_b_actions
from shardkit.nn.pipe.stage import PipelineStage
from shardkit.nn.pipe.state import consolidated_state_dict, load_stage_state_dict

__all__ = [
    "BalanceError",
    "CheckpointMode",
    "DeferredBatchNorm",
    "Pipe",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleGPipe",
    "StageFailedError",
    "balance_by_size",
    "balance_by_time",
    "bubble_fraction",
    "consolidated_state_dict",
    "gpipe_actions",
    "is_recomputing",
    "load_stage_state_dict",
    "one_f_one_b_actions",
    "solve_balance",
    "split_module",
    "stage_module",
]
