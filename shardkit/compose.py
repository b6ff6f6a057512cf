"""Apply parallelisms to a model from a process mesh, in one fixed, documented order.

:func:`parallelize_model` reads the degrees of a :class:`~shardkit.distributed.mesh.ProcessMesh`
(``pp x dp_replicate x dp_shard x cp x tp``) and applies, in this order:

1. tensor parallel over ``mesh.group("tp")`` (``tp_plan``,
   :func:`shardkit.nn.tensor_parallel.parallelize`);
2. activation checkpointing (``checkpoint_wrapper`` around every module of the
   ``activation_checkpointing`` classes);
3. data parallel over ``dp_replicate x dp_shard x cp`` (``data_parallel``): ``"fsdp"``
   makes ``fsdp_units`` FSDP units and the rest a root unit, sharded over
   ``dp_shard_cp`` (``dp_shard x cp``: the context-parallel ranks hold the same
   parameters, so they share the gradient reduction, as in torchtitan) and, when
   ``dp_replicate > 1``, hybrid (``HYBRID_SHARD`` over ``(dp_shard_cp, dp_replicate)``;
   with ``dp_shard x cp`` 1 that is DDP-style replication with FSDP's features: mixed
   precision, the flat-parameter checkpoint layout); ``"ddp"`` wraps torch
   ``DistributedDataParallel`` over ``dp_cp``; ``"none"`` leaves it to the caller. At
   ``cp = 1`` these are the ``dp_shard`` and ``dp`` groups. The attention itself is
   not changed here: the caller makes it context parallel over ``mesh.group("cp")``
   (``shardkit.nn.context_parallel``);
4. the pipeline split over ``pp`` (``pipeline``): this rank keeps its stage of the
   layers, and a :class:`~shardkit.nn.pipe.PipelineStage` with its schedule runs it.

[Note: why this order]
It is torchtitan's (``models/*/infra/parallelize.py``). Tensor parallel comes first so
that FSDP flattens and shards the tensor-parallel *local* parameters: FSDP never sees
the full weight, and the column / row layers keep their own collectives inside each
unit. Activation checkpointing comes before FSDP so that the recomputed region lies
inside an FSDP unit: the unit's parameters are gathered once for the forward and once
for the recompute + backward, never held across the whole backward. The pipeline is
the outermost layer: each stage is a plain module to the wrappers inside it, so the
split is done on the tensor-parallel, checkpointed model, and the data parallelism
acts on one stage's parameters.

[Note: what composes]
Every product of the four degrees runs, with these rules:

- ``tp > 1`` needs ``tp_plan``; ``pp > 1`` needs ``pipeline``; ``cp > 1`` refuses a
  pipeline (a stage would need the sequence split on its own ranks);
- under a pipeline a stage is replicated over its data-parallel ranks
  (``data_parallel="ddp"``, over ``dp_replicate x dp_shard`` of them): a weight tied
  across stages (a GPT's token embedding and LM head) has its gradient summed between
  those stages after each schedule, which needs whole gradients, so FSDP inside a
  stage (``data_parallel="fsdp"`` with a pipeline and ``dp > 1``) is refused;
- ``mixed_precision`` is FSDP's policy: it needs ``data_parallel="fsdp"`` and no
  pipeline (use ``torch.autocast`` around the forward otherwise);
- ``data_parallel="none"`` leaves data parallelism to the caller (torch DDP, OSS,
  ShardedDataParallel over ``mesh.group("dp")``); it refuses a pipeline;
- a mixture of experts with ``tp > 1`` splits each expert itself: build the layer with
  ``MoE(..., ep_group=mesh.group("ep"), tp_group=mesh.group("tp"))`` (its first
  projection column-parallel, its second row-parallel; the weights' shard descriptors
  record both splits); the ``tp_plan`` covers the dense layers only;
- experts split over ``ep`` must be data parallel over ``edp`` only: wrap them first
  (``FullyShardedDataParallel(moe.experts, process_group=mesh.group("edp"))``, or
  ``ignore_experts_in_ddp`` for ``"ddp"``); FSDP over ``dp`` holding an unwrapped
  expert part is refused here, torch DDP at the MoE layer's first forward.

Each refusal is a ``ValueError`` naming the values and what to change.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.distributed.collectives import new_group
from shardkit.distributed.mesh import ProcessMesh
from shardkit.distributed.validation import parameter_problem
from shardkit.nn import tensor_parallel as tp
from shardkit.nn.checkpoint import CheckpointWrapper, checkpoint_wrapper
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel, MixedPrecision
from shardkit.nn.moe import expert_parameters
from shardkit.nn.pipe import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    balance_by_size,
    stage_module,
)
from shardkit.nn.tensor_parallel.partition import split_of
from shardkit.nn.tensor_parallel.plan import ParallelStyle
from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy

__all__ = ["DataParallel", "ParallelModel", "PipelineSplit", "parallelize_model"]

DataParallel = Literal["fsdp", "ddp", "none"]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PipelineSplit:
    """How :func:`parallelize_model` cuts the model into ``pp`` stages.

    Attributes:
        layers: ``layers(model) -> nn.Sequential`` sharing the model's parameters
            (e.g. :func:`shardkit.models.gpt_stages`); called after tensor parallel
            and activation checkpointing.
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last stage, the mean
            over the micro-batch's rows.
        chunks: micro-batches per step. Default 4.
        schedule: ``"1f1b"`` (:class:`~shardkit.nn.pipe.Schedule1F1B`) or ``"gpipe"``.
            Default ``"1f1b"``.
        balance: layers per stage, ``pp`` numbers summing to the layer count; None:
            :func:`~shardkit.nn.pipe.balance_by_size`. Default None.
        materialize: ``materialize(model, stage_module, device)`` for a model built on
            the meta device: allocate and initialise this rank's stage only. Default
            None (the model must then be materialised).
    """

    layers: Callable[[Any], nn.Sequential]
    loss_fn: LossFn
    chunks: int = 4
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    balance: Sequence[int] | None = None
    materialize: Callable[[Any, nn.Module, torch.device], None] | None = None


class ParallelModel:
    """What :func:`parallelize_model` returns: this rank's wrapped model and how to run it.

    Attributes:
        mesh: the mesh it was built from.
        module: the outermost wrapper of this rank's model: the FSDP root unit, torch
            DDP, or the (tensor-parallel, checkpointed) model itself; under a pipeline,
            this rank's stage module (DDP-wrapped when ``dp > 1``). Call it for
            forward when there is no pipeline; pass it to
            :func:`shardkit.checkpoint.universal.save_universal` (no pipeline) or pass
            :attr:`stage` (pipeline).
        stage: this rank's :class:`~shardkit.nn.pipe.PipelineStage`; None without a
            pipeline.
        schedule: the stage's schedule (``step`` / ``forward``); None without a pipeline.
        split_tensors: ``(partition_dim, partition_stride)`` of every tensor-parallel
            tensor, by its key in the model's ``state_dict`` before any other wrapper
            (what :func:`shardkit.nn.tensor_parallel.full_tensor` needs to gather it back).
    """

    def __init__(
        self,
        mesh: ProcessMesh,
        module: nn.Module,
        split_tensors: dict[str, tuple[int, int]],
        stage: PipelineStage | None = None,
        schedule: ScheduleGPipe | Schedule1F1B | None = None,
        tied: Sequence[tuple[torch.Tensor, dist.ProcessGroup]] = (),
    ) -> None:
        self.mesh, self.module, self.split_tensors = mesh, module, split_tensors
        self.stage, self.schedule, self._tied = stage, schedule, list(tied)

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's trainable parameters (build the optimizer over these)."""
        return (p for p in self.module.parameters() if p.requires_grad)

    def pipeline_step(
        self, inputs: torch.Tensor | None, target: torch.Tensor | None
    ) -> torch.Tensor | None:
        """One pipeline step: the schedule's forwards and backwards of every micro-batch
        of this pipeline's batch, then the gradients of weights tied across stages
        summed between those stages.

        Args:
            inputs: the batch, ``(rows, ...)``, used on the first stage.
            target: the targets, used on the last stage.

        Returns:
            The mean loss on the last stage (detached); None on the other stages.

        Raises:
            RuntimeError: the model has no pipeline (call ``module`` instead).
        """
        if self.schedule is None:
            raise RuntimeError("no pipeline was given: call ParallelModel.module instead")
        loss = self.schedule.step(inputs, target=target)
        for weight, group in self._tied:
            if weight.grad is not None:
                dist.all_reduce(weight.grad, group=group)
        return None if loss is None else loss.detach()


def parallelize_model(
    model: nn.Module,
    mesh: ProcessMesh,
    *,
    tp_plan: Mapping[str, ParallelStyle] | None = None,
    activation_checkpointing: Collection[type[nn.Module]] = (),
    fsdp_units: Collection[type[nn.Module]] = (),
    mixed_precision: MixedPrecision | None = None,
    fsdp_kwargs: Mapping[str, Any] | None = None,
    pipeline: PipelineSplit | None = None,
    data_parallel: DataParallel = "fsdp",
    device: torch.device | None = None,
) -> ParallelModel:
    """Apply tensor parallel, activation checkpointing, data parallel and the pipeline
    split to ``model``, in that order, over ``mesh`` (see the module's notes).

    Example::

        mesh = ProcessMesh(ParallelDims(world_size=8, dp_replicate=2, tp=2))  # dp_shard 2
        pm = parallelize_model(GPT(config), mesh, tp_plan=tp.gpt_plan(),
                               activation_checkpointing={Block}, fsdp_units={Block})
        optimizer = torch.optim.AdamW(pm.parameters())
        _, loss = pm.module(x, targets=y)

    Args:
        model: the model, identical on every rank (same seed or loaded weights); changed
            in place (tensor parallel, checkpoint wrappers).
        mesh: the process mesh; its degrees decide what is applied.
        tp_plan: module-name pattern -> style (e.g. ``tp.gpt_plan()``); needed when
            ``tp > 1``, ignored otherwise. Default None.
        activation_checkpointing: module classes whose instances are wrapped in
            ``checkpoint_wrapper``. Default none.
        fsdp_units: ``data_parallel="fsdp"``: module classes that become FSDP units
            of their own (e.g. the transformer block class; a checkpointed block is
            matched through its wrapper); the rest of the model goes in the root unit.
            Default none: one unit.
        mixed_precision: FSDP's policy. Default None (fp32).
        fsdp_kwargs: further ``FullyShardedDataParallel`` arguments (``param_init_fn``,
            ``grad_compression``, ...). Default none.
        pipeline: the split into ``pp`` stages (one stage, the whole model, when ``pp``
            is 1: the schedule still runs micro-batches); needed when ``pp > 1``.
            Default None.
        data_parallel: ``"fsdp"``, ``"ddp"`` or ``"none"`` (see the module docstring).
            Default ``"fsdp"``.
        device: this rank's device (the pipeline stage's). Default: the parameters'.

    Returns:
        A :class:`ParallelModel`.

    Raises:
        ValueError: a combination that does not compose (see ``[Note: what
            composes]``); the message names the degrees and the fix.
    """
    _check(mesh, tp_plan, mixed_precision, pipeline, data_parallel)
    _check_experts(model, mesh, data_parallel)
    if mesh.size("tp") > 1:
        assert tp_plan is not None
        tp.parallelize(model, tp_plan, process_group=mesh.group("tp"))
    split = _split_tensors(model)
    if activation_checkpointing:
        _wrap_instances(model, tuple(activation_checkpointing))
    if pipeline is not None:
        return _pipelined(model, mesh, pipeline, split, device)
    if data_parallel == "none" or (data_parallel == "ddp" and mesh.size("dp_cp") == 1):
        return ParallelModel(mesh, model, split)
    if data_parallel == "ddp":
        return ParallelModel(mesh, _ddp(model, mesh.group("dp_cp")), split)
    units: set[type[nn.Module]] = set(fsdp_units)
    if units & set(activation_checkpointing):  # a checkpointed unit is met as its wrapper
        units.add(CheckpointWrapper)
    kwargs: dict[str, Any] = {**(fsdp_kwargs or {}), "mixed_precision": mixed_precision}
    if mesh.size("dp_replicate") > 1:
        kwargs["sharding_strategy"] = "HYBRID_SHARD"
        kwargs["process_group"] = (mesh.group("dp_shard_cp"), mesh.group("dp_replicate"))
    else:
        kwargs["process_group"] = mesh.group("dp_shard_cp")
    if units:
        with enable_wrap(wrapper_cls=FullyShardedDataParallel, **kwargs):
            model = auto_wrap(model, transformer_auto_wrap_policy(units))
    return ParallelModel(mesh, FullyShardedDataParallel(model, **kwargs), split)


def _check(
    mesh: ProcessMesh,
    tp_plan: Mapping[str, Any] | None,
    mixed_precision: MixedPrecision | None,
    pipeline: PipelineSplit | None,
    data_parallel: DataParallel,
) -> None:
    """Raise the ValueError of ``[Note: what composes]`` for a combination that fails."""
    d = mesh.dims
    cp = f" x cp {d.cp}" if d.cp > 1 else ""
    degrees = f"pp {d.pp} x dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard}{cp} x tp {d.tp}"
    if d.tp > 1 and tp_plan is None:
        raise ValueError(f"the mesh ({degrees}) has tp {d.tp} but no tp_plan was given")
    if d.pp > 1 and pipeline is None:
        raise ValueError(
            f"the mesh ({degrees}) has pp {d.pp} but no pipeline was given; pass "
            "pipeline=PipelineSplit(...) or build the mesh with pp=1"
        )
    if pipeline is not None and d.cp > 1:
        raise ValueError(
            f"a pipeline with cp {d.cp} ({degrees}): context parallelism is not composed "
            "with the pipeline split; build the mesh with cp=1 or without pp"
        )
    if pipeline is not None and data_parallel == "none":
        raise ValueError(
            f"data_parallel='none' with a pipeline ({degrees}): the stages' replicas are "
            "wrapped here; pass data_parallel='ddp'"
        )
    if pipeline is not None and data_parallel == "fsdp" and d.dp > 1:
        raise ValueError(
            f"data_parallel='fsdp' with a pipeline ({degrees}): a stage is replicated over "
            f"its {d.dp} data-parallel ranks, not sharded (a weight tied across stages "
            "needs whole gradients); pass data_parallel='ddp'"
        )
    if mixed_precision is not None and (data_parallel != "fsdp" or pipeline is not None):
        raise ValueError(
            f"mixed_precision is FSDP's policy but data_parallel={data_parallel!r} with "
            f"the mesh ({degrees}) builds no FSDP unit; pass data_parallel='fsdp' without "
            "a pipeline, or use torch.autocast around the forward"
        )
    if pipeline is not None and pipeline.chunks < 1:
        raise ValueError(f"pipeline chunks must be >= 1; got {pipeline.chunks}")


def _check_experts(model: nn.Module, mesh: ProcessMesh, data_parallel: DataParallel) -> None:
    """Raise the ValueError of ``[Note: what composes]`` for expert parts the
    data-parallel wrapper would average across ranks holding other experts."""
    experts = expert_parameters(model)
    if data_parallel != "fsdp" or mesh.size("dp") == 1:
        return  # torch DDP: the MoE layer refuses it at the first forward (the same rule)
    wrapper = "parallelize_model(data_parallel='fsdp')"
    problem = parameter_problem(wrapper, experts.items(), reduce_ranks=mesh.ranks("dp"))
    if problem is not None:
        raise problem


def _split_tensors(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``(partition_dim, partition_stride)`` of each tensor-parallel tensor, by key, read
    from its shard descriptor."""
    return {
        name: split_of(t)
        for name, t in model.state_dict(keep_vars=True).items()
        if tp.is_tensor_parallel(t)
    }


def _wrap_instances(model: nn.Module, classes: tuple[type[nn.Module], ...]) -> None:
    """Replace every submodule that is an instance of ``classes`` (outermost only) by
    ``checkpoint_wrapper(submodule)``, in place."""
    for name, child in list(model.named_children()):
        if isinstance(child, classes):
            setattr(model, name, checkpoint_wrapper(child))
        else:
            _wrap_instances(child, classes)


def _ddp(module: nn.Module, group: dist.ProcessGroup) -> DistributedDataParallel:
    first = next(module.parameters(), None)
    on_cuda = first is not None and first.device.type == "cuda"
    return DistributedDataParallel(
        module, device_ids=[first.device] if on_cuda and first else None, process_group=group
    )


def _pipelined(
    model: nn.Module,
    mesh: ProcessMesh,
    split: PipelineSplit,
    split_tensors: dict[str, tuple[int, int]],
    device: torch.device | None,
) -> ParallelModel:
    """This rank's stage of ``split.layers(model)``, replicated over ``dp`` (DDP), run by
    a schedule over ``mesh.group("pp")``."""
    pp, index = mesh.size("pp"), mesh.local_rank("pp")
    layers = split.layers(model)
    balance = list(split.balance) if split.balance is not None else balance_by_size(pp, layers)
    part = stage_module(layers, balance, index)
    tied_names = _tied_groups(layers, balance, mesh)
    if split.materialize is not None and any(p.is_meta for p in part.parameters()):
        split.materialize(model, part, device or torch.device("cpu"))
    tied = [(layers.get_parameter(name), group) for name, group in tied_names]
    module: nn.Module = part if mesh.size("dp") == 1 else _ddp(part, mesh.group("dp"))
    stage = PipelineStage(module, process_group=mesh.group("pp"), device=device)
    runner: ScheduleGPipe | Schedule1F1B
    if split.schedule == "1f1b":
        runner = Schedule1F1B(stage, split.chunks, loss_fn=split.loss_fn)
    else:
        runner = ScheduleGPipe(stage, split.chunks, loss_fn=split.loss_fn)
    return ParallelModel(mesh, module, split_tensors, stage, runner, tied)


def _tied_groups(
    layers: nn.Sequential, balance: list[int], mesh: ProcessMesh
) -> list[tuple[str, dist.ProcessGroup]]:
    """For each parameter used by several stages (a tied weight), its name in ``layers``
    within this rank's stage and the group of the pipeline ranks holding it; creates the
    groups on every rank (a collective: the same stage sets everywhere, since every rank
    has the same model). Called before a meta stage is materialised (which unties)."""
    bounds = list(itertools.accumulate([0, *balance]))
    holders: dict[int, dict[int, str]] = {}  # parameter id -> {stage: name in layers}
    for s in range(len(balance)):
        for i in range(bounds[s], bounds[s + 1]):
            for name, p in layers[i].named_parameters(remove_duplicate=False):
                holders.setdefault(id(p), {}).setdefault(s, f"{i}.{name}")
    stage_sets = sorted({tuple(sorted(h)) for h in holders.values() if len(h) > 1})
    index = mesh.local_rank("pp")
    tied: list[tuple[str, dist.ProcessGroup]] = []
    for stages in stage_sets:
        mine = None
        for ranks in mesh.dims.group_ranks(["pp"]):  # every rank creates every group
            group = new_group([ranks[s] for s in stages])
            if mesh.rank in ranks and index in stages:
                mine = group
        if mine is not None:
            tied.extend((h[index], mine) for h in holders.values() if tuple(sorted(h)) == stages)
    return tied
