"""The general mixture-of-experts layer (DeepSpeed's ``MoE`` shape) with expert parallelism.

[Note: dispatch and combine]
One forward on a rank with ``T`` tokens, ``k`` choices each, over an expert-parallel
group of ``ep`` ranks holding ``E / ep`` experts each:

1. the gate (:class:`~shardkit.nn.moe.gate.TopKGate`) picks the experts, the kept
   choices and their weights;
2. the kept choices are sorted by expert; ``counts`` (``E`` integers) go to every rank
   by one small all-to-all, so each rank knows how many tokens it receives per expert;
3. **dispatch**: one ``all_to_all_single`` with variable splits sends each kept
   choice's token to the rank holding its expert (``N_kept x M`` elements);
4. each rank runs its experts on the tokens it received, grouped by expert;
5. **combine**: the same all-to-all with the splits swapped sends the outputs back;
   each token's output is the sum of its kept choices' outputs times their weights.

Bytes per layer and per forward, each way, for a rank's own tokens (what dispatch
sends out of the rank's buffer, and what combine brings back into it)::

    N_kept x M x dtype bytes  <=  T x k x M x dtype bytes   (equal when dropless)

plus ``E x 8`` bytes of counts; the backward moves the same again. Summed over the
group, what the ranks send in the combine equals what they sent in the dispatch. A
choice routed to this rank's own experts is counted too (it is part of the buffer
handed to ``all_to_all_single``). Unlike GShard's ``(E, C, M)`` buffer
(:class:`~shardkit.nn.moe.MOELayer`), no empty slot is sent.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.distributed.all_to_all import all_to_all
from shardkit.distributed.sequence_split import gather_sequence, split_sequence
from shardkit.nn.moe.experts import GroupedExperts, expert_parallel_rank_and_size
from shardkit.nn.moe.gate import Routing, TopKGate
from shardkit.nn.moe.gradients import check_ddp_leaves_experts

__all__ = ["MoE"]


class MoE(nn.Module):
    """Mixture of experts with top-k routing, capacity, dropless dispatch and expert
    parallelism (DeepSpeed's ``deepspeed.moe.layer.MoE``, experts stored stacked).

    Example:
        >>> moe = MoE(hidden_size=64, ffn_hidden_size=256, num_experts=8, k=2)
        >>> out, l_aux, counts = moe(torch.randn(4, 16, 64))
        >>> out.shape, counts.shape
        (torch.Size([4, 16, 64]), torch.Size([8]))

    ``l_aux`` is the gate's load-balancing loss plus ``z_loss_coef`` times the router
    z-loss (:class:`~shardkit.nn.moe.gate.TopKGate` gives both formulas and sources);
    add ``coef * l_aux`` (Switch uses 1e-2) to the task loss. The ranks of ``ep_group``
    may pass different numbers of tokens, none included (each exchange is sized by the
    counts all-to-all, so this costs nothing more); ``l_aux`` is then each rank's own,
    over its tokens (0 for none).

    Args:
        hidden_size: the token size ``M``.
        ffn_hidden_size: each expert's hidden size ``F``.
        num_experts: the experts ``E`` of all ranks together.
        k: experts per token. Default 1.
        capacity_factor: training capacity factor. Default 1.0.
        eval_capacity_factor: eval-mode capacity factor. Default 1.0.
        min_capacity: least capacity per expert, in tokens. Default 4.
        drop_tokens: default True (capacity); False: dropless.
        noisy_gate_policy: None, ``"Jitter"`` or ``"RSample"``. Default None.
        normalize_weights: default None: True for k > 1.
        z_loss_coef: weight of the router z-loss in ``l_aux``. Default 0.0.
        num_shared_experts: dense experts every token goes through (DeepSeekMoE's shared
            experts), as one feed-forward network of hidden size ``num_shared_experts x
            F``, added to the routed output. Default 0.
        activation: the experts' nonlinearity. Default gelu.
        ep_group: the expert-parallel process group (``ProcessMesh.group("ep")``); the
            experts are split over it. Default None: every expert on this rank.
        bias_update_speed: ``gamma`` of DeepSeek-V3's auxiliary-loss-free expert bias
            (selection only; update it with ``moe.gate.update_expert_bias(dp_group)``
            after each step). Default 0.0: none.
        tp_group: the tensor-parallel process group (``ProcessMesh.group("tp")``): each
            expert's first projection is column-parallel and its second row-parallel
            over it, the partial outputs all-reduced (see :class:`GroupedExperts`'
            ``[Note: tensor parallel inside each expert]``); the gate and the shared
            experts stay whole, and the input must be the same on every rank of it.
            Default None: whole experts.
        sequence_parallel: the input and output are this rank's contiguous chunk of the
            sequence (dim 1 of ``(batch, sequence, M)``) over ``tp_group``, as in a
            sequence-parallel region (Megatron-LM, Korthikanti et al. 2022, section
            4.2.2): the layer all-gathers the sequence, routes every token (the gate
            needs each token's logits: capacity positions are counted over the whole
            batch), and returns this rank's chunk of the output. The gathered
            computation is the same on every rank of ``tp_group``, so the gather's
            backward keeps this rank's chunk of the gradient (no reduce-scatter).
            Default False.

    Attributes:
        gate: the router, a :class:`~shardkit.nn.moe.gate.TopKGate`.
        experts: this rank's experts, a :class:`~shardkit.nn.moe.experts.GroupedExperts`.
        shared_experts: the shared experts' ``nn.Sequential``, or None.
        last_routing: the :class:`~shardkit.nn.moe.gate.Routing` of the last forward.
        last_all_to_all_bytes: ``{"counts", "dispatch", "combine"}`` of the last
            forward: the counts this rank sent, its tokens' bytes sent in the dispatch
            and received back in the combine (see ``[Note: dispatch and combine]``);
            zeros without expert parallelism.

    Raises:
        ValueError: ``num_experts`` not a multiple of the ep group's size, ``k`` outside
            ``[1, num_experts]``, a capacity factor ``<= 0``, ``ffn_hidden_size`` not
            a multiple of the tp group's size, ``sequence_parallel`` without a
            ``tp_group`` of more than one rank; in forward (with ``sequence_parallel``),
            ranks of the tp group passing chunks of different shapes (raised on every
            rank of it, before the gather; each rank's shape named).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        drop_tokens: bool = True,
        noisy_gate_policy: str | None = None,
        normalize_weights: bool | None = None,
        z_loss_coef: float = 0.0,
        num_shared_experts: int = 0,
        activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu,
        ep_group: dist.ProcessGroup | None = None,
        bias_update_speed: float = 0.0,
        tp_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            drop_tokens,
            noisy_gate_policy,
            normalize_weights,
            bias_update_speed,
        )
        self.experts = GroupedExperts(
            num_experts, hidden_size, ffn_hidden_size, activation, ep_group, tp_group
        )
        if sequence_parallel and self.experts.tp_group is None:
            raise ValueError(
                "sequence_parallel=True needs a tp_group of more than one rank (the "
                "sequence is split over it); pass tp_group=mesh.group('tp') or drop "
                "sequence_parallel"
            )
        self.sequence_parallel = sequence_parallel
        self.ep_group = ep_group
        self.ep_rank, self.ep_size = expert_parallel_rank_and_size(ep_group)
        self.z_loss_coef = z_loss_coef
        self.shared_experts: nn.Sequential | None = None
        if num_shared_experts > 0:
            shared = num_shared_experts * ffn_hidden_size
            self.shared_experts = nn.Sequential(
                nn.Linear(hidden_size, shared), nn.GELU(), nn.Linear(shared, hidden_size)
            )
        self.last_routing: Routing | None = None
        self.last_all_to_all_bytes = {"counts": 0, "dispatch": 0, "combine": 0}
        # the DDP modules already checked: weak, so that a new DDP module at a freed
        # one's address (id) is checked too; not pickled or copied (see __getstate__)
        self._checked_ddp: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()

    def __getstate__(self) -> dict[str, Any]:
        """The module's state for ``pickle`` and ``copy.deepcopy``, less the set of DDP
        modules checked (weak references: a copy is checked again under each DDP)."""
        state = dict(super().__getstate__())
        state["_checked_ddp"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a state of :meth:`__getstate__`, with an empty set of checked DDPs."""
        super().__setstate__(state)
        self._checked_ddp = weakref.WeakSet()

    def forward(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden_states``: ``(..., M)``. Returns ``(output, l_aux, exp_counts)``:
        ``output`` shaped like the input, ``l_aux`` a scalar, ``exp_counts`` ``(E,)``
        the kept choices per expert on this rank (DeepSpeed's return values).

        Raises:
            ValueError: under a torch DDP whose process group holds several ranks of
                the ep group, the experts not left out of it (the fix named:
                :func:`~shardkit.nn.moe.ignore_experts_in_ddp` before wrapping); with
                ``sequence_parallel``, ranks of the tp group passing chunks of different
                shapes (on every rank of it, before the gather).
        """
        self._check_data_parallel()
        if self.sequence_parallel:  # every rank routes every token (see Args)
            hidden_states = gather_sequence(
                hidden_states, self.experts.tp_group, 1, "split", check_shapes=True
            )
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        routing = self.gate(tokens)
        self.last_routing = routing
        flat_experts = routing.experts.reshape(-1)
        kept = routing.kept.reshape(-1).nonzero().squeeze(1)
        order = kept[torch.argsort(flat_experts[kept], stable=True)]
        source_token = order // self.gate.k
        routed = self._run_experts(tokens[source_token], routing.counts)
        weighted = routed * routing.weights.reshape(-1)[order].unsqueeze(1).to(routed.dtype)
        output = torch.zeros_like(tokens).index_add(0, source_token, weighted)
        if self.shared_experts is not None:
            output = output + self.shared_experts(tokens)
        l_aux = routing.aux_loss + self.z_loss_coef * routing.z_loss
        output = output.reshape(shape)
        if self.sequence_parallel:
            output = split_sequence(output, self.experts.tp_group, 1)
        return output, l_aux, routing.counts

    def _check_data_parallel(self) -> None:
        """At the first forward under each torch DDP module: refuse one that reduces the
        experts over ranks holding others (``shardkit.nn.moe.gradients``' ``[Note:
        refusing DDP across experts]``)."""
        ddp = DistributedDataParallel._get_active_ddp_module()
        if self.ep_size == 1 or ddp is None or ddp in self._checked_ddp:
            return
        check_ddp_leaves_experts(ddp, self.experts)
        self._checked_ddp.add(ddp)

    def _run_experts(self, sorted_tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Kept tokens sorted by global expert (``counts[e]`` each) through their experts
        and back, in the same order (see ``[Note: dispatch and combine]``)."""
        if self.ep_size == 1:
            return self.experts(sorted_tokens, counts.tolist())
        n_local = self.experts.num_local_experts
        send_counts = counts.reshape(self.ep_size, n_local)
        recv_counts = all_to_all(send_counts.contiguous(), self.ep_group)  # [source, expert]
        send_splits = send_counts.sum(dim=1).tolist()
        recv_splits = recv_counts.sum(dim=1).tolist()
        received = all_to_all(sorted_tokens, self.ep_group, recv_splits, send_splits)
        # received is ordered by source rank, then local expert: regroup by expert
        local_expert = torch.repeat_interleave(
            torch.arange(n_local).repeat(self.ep_size), recv_counts.reshape(-1)
        )
        by_expert = torch.argsort(local_expert, stable=True)
        out = self.experts(received[by_expert], recv_counts.sum(dim=0).tolist())
        restored = torch.empty_like(out).index_copy(0, by_expert, out)
        returned = all_to_all(restored, self.ep_group, send_splits, recv_splits)
        size = sorted_tokens.element_size() * sorted_tokens.shape[1]
        self.last_all_to_all_bytes = {
            "counts": send_counts.numel() * send_counts.element_size(),
            "dispatch": sorted_tokens.shape[0] * size,
            "combine": returned.shape[0] * size,
        }
        return returned
