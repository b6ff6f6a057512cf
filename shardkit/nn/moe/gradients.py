"""Expert gradients reduced over the expert-data-parallel group only.

[Note: why experts are not data parallel over dp]
Under expert parallelism the ranks of a data-parallel group hold *different* experts, so
averaging every gradient over ``dp`` (what DDP does) would mix the gradients of
different experts. The dense parameters (attention, the gate, shared experts) stay data
parallel over ``dp``; the experts are data parallel over ``edp`` (the ranks holding the
same experts, ``ProcessMesh.group("edp")``).

After the backward, expert ``e`` on a rank holds the mean gradient of the losses of
the ranks of its expert-parallel group (the combine all-to-all's backward brought them
back; ``GroupedExperts`` scales by ``1 / ep``, see its ``[Note: expert gradients are
means over the ep group]``). Averaging over ``edp`` (``dp / ep`` ranks) gives the mean
over all ``dp`` ranks' losses, DDP's mean, so the step equals the single-process step on
the global batch. :class:`~shardkit.nn.moe.MOELayer` (FairScale's semantics) does not
scale: its expert gradients are sums over the ep group, as in FairScale.

With torch DDP::

    ignore_experts_in_ddp(model)                     # before wrapping
    ddp = DistributedDataParallel(model, process_group=mesh.group("dp"))
    loss.backward()                                  # DDP averages the dense grads
    all_reduce_expert_gradients(model, mesh.group("edp"))
    optimizer.step()

[Note: refusing DDP across experts]
Forgetting ``ignore_experts_in_ddp`` trains on: DDP averages expert ``e``'s gradient
with expert ``e + E / ep``'s, every step, and nothing fails. So an expert-parallel
:class:`~shardkit.nn.moe.MoE` checks, at its first forward under each torch DDP
module (``DistributedDataParallel._get_active_ddp_module()``, which DDP sets around
its forward), whether that DDP reduces its experts over a group holding several of
their parts (the experts' shard descriptor records the ``ep`` ranks; see
:func:`shardkit.distributed.validation.parameter_problem`), and raises before any
gradient is averaged. ``OSS`` (and so ``ShardedDataParallel``) refuses the same
parameters at construction. A DDP over a group meeting each ``ep`` group in one rank
(``edp``) is accepted: its ranks hold the same experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.distributed.collectives import group_rank, group_ranks
from shardkit.distributed.grad_norm import clip_grad_norm_sharded, held_outside
from shardkit.distributed.shard_descriptor import ranks_of, view_of
from shardkit.distributed.validation import parameter_problem
from shardkit.nn.moe.experts import GroupedExperts

__all__ = [
    "all_reduce_expert_gradients",
    "check_ddp_leaves_experts",
    "clip_grad_norm_",
    "expert_parameters",
    "ignore_experts_in_ddp",
]


def expert_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of ``module`` marked ``expert = True`` (the experts of every
    :class:`~shardkit.nn.moe.MoE` and :class:`~shardkit.nn.moe.MOELayer` in it), by
    name."""
    return {n: p for n, p in module.named_parameters() if getattr(p, "expert", False)}


def ignore_experts_in_ddp(module: nn.Module) -> list[str]:
    """Make torch ``DistributedDataParallel`` leave the expert parameters of ``module``
    alone (neither broadcast at wrap time nor all-reduced); call before wrapping.

    Returns:
        The names of the parameters DDP will ignore.
    """
    names = sorted(expert_parameters(module))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
    return names


@torch.no_grad()
def all_reduce_expert_gradients(module: nn.Module, group: dist.ProcessGroup | None) -> int:
    """Average the expert gradients of ``module`` over ``group``, the expert-data-parallel
    group (see ``[Note: why experts are not data parallel over dp]``). Call after the
    backward, on every rank of ``group``.

    Args:
        module: the model (or the unwrapped model under DDP).
        group: the ``edp`` process group (``mesh.group("edp")``); None: the world.

    Returns:
        The number of gradients reduced (parameters without a gradient are skipped).
    """
    size = dist.get_world_size(group)
    grads = [p.grad for p in expert_parameters(module).values() if p.grad is not None]
    for grad in grads:
        dist.all_reduce(grad, group=group)
        grad.div_(size)
    return len(grads)


def clip_grad_norm_(
    module: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    ep_group: dist.ProcessGroup | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip the gradients of an expert-parallel model under data parallelism (DDP
    layout: dense parameters whole on every rank, experts split over ``ep_group``) by
    the norm of the single-process model's gradients.

    Expert gradients are summed over ``ep_group`` (each of its ranks holds other
    experts); dense gradients, the same on every rank after DDP's all-reduce, count
    once (on ``ep_group``'s rank 0). One all-reduce of one element over ``ep_group``.
    Call after the backward, DDP's reduction and :func:`all_reduce_expert_gradients`
    (so that the ranks of an expert-data-parallel group hold the same gradients and get
    the same norm)::

        loss.backward()
        all_reduce_expert_gradients(model, mesh.group("edp"))
        clip_grad_norm_(model, 1.0, ep_group=mesh.group("ep"))
        optimizer.step()

    With tensor parallel inside each expert (``MoE(..., tp_group=...)``) or a
    tensor-parallel model around the layers, pass ``tp_group`` too: a parameter split
    over it counts on every tensor-parallel rank, one held whole (the gate, a
    replicated LayerNorm) on its rank 0 only, and the sum runs over ``ep_group`` then
    ``tp_group`` (one more all-reduce of one element).

    Under FSDP use the root's ``FullyShardedDataParallel.clip_grad_norm_`` instead (it
    counts the expert units over the expert-data-parallel group itself).

    Args:
        module: the model (or the unwrapped model under DDP).
        max_norm: the largest allowed total norm.
        norm_type: ``p`` of the p-norm; ``float("inf")`` for the max norm. Default 2.
        ep_group: the expert-parallel group (``mesh.group("ep")``); None: the world.
        tp_group: the tensor-parallel group (``mesh.group("tp")``) when parameters are
            split over it; default None (no tensor parallelism).

    Returns:
        The total norm (0-d fp32) before clipping, the same on every rank, equal to
        ``torch.nn.utils.clip_grad_norm_`` on the single-process model.

    Raises:
        ValueError: ``ep_group`` is not the group the experts of a
            :class:`~shardkit.nn.moe.MoE` in ``module`` are split over (for experts
            built with ``ep_group=None``, whole on every rank: any group of more than
            one rank); the norm would count experts several times. Checked before any
            gradient is touched; :class:`~shardkit.nn.moe.MOELayer`'s experts record
            no group and are not checked. Also: parameters split over (or copied on)
            ranks outside ``ep_group`` that are not ``tp_group``'s (``tp_group`` None
            with tensor-parallel parameters: each tensor-parallel rank would clip by
            its own part's norm), or a ``tp_group`` meeting ``ep_group`` in more than
            this rank.
    """
    _check_ep_group(module, ep_group)
    _check_tp_group(module, ep_group, tp_group)
    experts = expert_parameters(module)
    ids = {id(p) for p in experts.values()}
    dense = [p for p in module.parameters() if id(p) not in ids]
    first = group_rank(ep_group) == 0
    tp_ranks = None if tp_group is None else ranks_of(tp_group)
    tp_first = tp_group is None or group_rank(tp_group) == 0

    def counts_over_tp(p: torch.Tensor) -> bool:
        return tp_first or any(s.group == tp_ranks for s in view_of(p).splits)

    counted = [p for p in [*experts.values(), *(dense if first else [])] if counts_over_tp(p)]
    kept = {id(p) for p in counted}
    copies = [p for p in module.parameters() if id(p) not in kept]
    groups = [ep_group] if tp_group is None else [ep_group, tp_group]
    return clip_grad_norm_sharded(counted, max_norm, norm_type, groups, copies=copies)


def _check_tp_group(
    module: nn.Module, ep_group: dist.ProcessGroup | None, tp_group: dist.ProcessGroup | None
) -> None:
    """Refuse parameters held outside ``ep_group`` other than over ``tp_group`` (see
    :func:`clip_grad_norm_`)."""
    world = ranks_of(ep_group)
    if world is None:  # one process: nothing split
        return
    outside = held_outside((view_of(p) for p in module.parameters()), world)
    tp = None if tp_group is None else ranks_of(tp_group)
    if tp is not None and len(set(tp) & set(world)) != 1:
        raise ValueError(
            f"clip_grad_norm_: tp_group holds ranks {list(tp)}, which meet ep_group's "
            f"{list(world)} in more than this rank: the norm would count parameters "
            "several times; pass mesh.group('tp') and mesh.group('ep') of one mesh"
        )
    extra = sorted(list(r) for r in outside if r != tp)
    if extra:
        fix = "pass tp_group=mesh.group('tp')" if tp is None else "pass the tp_group they use"
        raise ValueError(
            f"clip_grad_norm_: parameters are split over (or copied on) ranks {extra} "
            f"outside ep_group's {list(world)}"
            + ("" if tp is None else f" and tp_group's {list(tp)}")
            + f": the norm would be this rank's part only; {fix}"
        )


def _check_ep_group(module: nn.Module, ep_group: dist.ProcessGroup | None) -> None:
    """Refuse an ``ep_group`` other than the one ``module``'s grouped experts are split
    over (see :func:`clip_grad_norm_`)."""
    given = ranks_of(ep_group)
    if given is None:  # one process: nothing split
        return
    for name, experts in module.named_modules():
        if not isinstance(experts, GroupedExperts):
            continue
        ep = [s for s in view_of(experts.w1).splits if s.mesh_dim == "ep"]
        holders = ep[0].group if ep else (dist.get_rank(),)
        if tuple(holders or ()) != given:
            raise ValueError(
                f"clip_grad_norm_: ep_group holds ranks {list(given)}, but the experts "
                f"`{name}` are split over ranks {list(holders or ())} (ep "
                f"{experts.num_experts // experts.num_local_experts}): their gradients "
                "would be counted several times in the norm. Pass the ep_group the MoE "
                "was built with (mesh.group('ep')); for experts whole on every rank "
                "(ep_group=None at construction) use torch.nn.utils.clip_grad_norm_ "
                "after the gradient reduction"
            )


def check_ddp_leaves_experts(ddp: DistributedDataParallel, experts: nn.Module) -> None:
    """Refuse a torch DDP module that would reduce ``experts``' parameters over ranks
    holding different experts (see ``[Note: refusing DDP across experts]``).

    Args:
        ddp: the DDP module whose forward is running.
        experts: an expert-parallel layer's experts (their parameters carry the shard
            descriptor of their ``ep`` split).

    Raises:
        ValueError: an expert parameter is among DDP's reduced parameters and DDP's
            process group holds several of its parts; the message names the parameter,
            the ranks and the fix (:func:`ignore_experts_in_ddp` before wrapping).
    """
    ignored = ddp.parameters_to_ignore
    names = {id(p): n for n, p in ddp.module.named_parameters() if n not in ignored}
    reduced = [(names[id(p)], p) for p in experts.parameters() if id(p) in names]
    problem = parameter_problem(
        "torch DistributedDataParallel", reduced, reduce_ranks=group_ranks(ddp.process_group)
    )
    if problem is not None:
        raise problem
