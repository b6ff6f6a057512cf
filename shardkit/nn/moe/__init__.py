"""Mixture of experts: gates, MoE layers and expert-parallel dispatch (all-to-all).

FairScale's names first (:class:`Top2Gate`, :class:`MOELayer`, GShard's capacity buffer),
then the general :class:`MoE` layer (top-k, capacity or dropless, load-balancing and
z-loss, shared experts, experts stored stacked and split over an ``ep`` group).
"""

from shardkit.nn.moe.experts import GroupedExperts
from shardkit.nn.moe.gate import Routing, TopKGate
from shardkit.nn.moe.gradients import (
    all_reduce_expert_gradients,
    check_ddp_leaves_experts,
    clip_grad_norm_,
    expert_parameters,
    ignore_experts_in_ddp,
)
from shardkit.nn.moe.layer import MoE
from shardkit.nn.moe.moe_layer import MOELayer
from shardkit.nn.moe.top2gate import Top2Gate

__all__ = [
    "GroupedExperts",
    "MOELayer",
    "MoE",
    "Routing",
    "Top2Gate",
    "TopKGate",
    "all_reduce_expert_gradients",
    "check_ddp_leaves_experts",
    "clip_grad_norm_",
    "expert_parameters",
    "ignore_experts_in_ddp",
]
