"""The main job's mixture of experts: the GPT with each Block's MLP an ``MoE``.

``--moe-experts E --moe-top-k K [--moe-every N] [--ep P] [--tp T]`` (``train_gpt.py``) builds a
:class:`MoEGPT`: a :class:`shardkit.models.GPT` whose every ``N``-th block (blocks
``N-1, 2N-1, ...``; every block with ``N = 1``) has a :class:`shardkit.nn.moe.MoE` of
``E`` experts (each the dense MLP's shape, hidden size ``4 x n_embd``), top-``K``
routing, capacity factor 1 (tokens over an expert's capacity are dropped: the block
passes them on by its residual). Its loss is the cross entropy plus
:data:`AUX_LOSS_COEF` times the sum of the layers' load-balancing losses.

Each MoE layer is built from its own seed (``seed + layer index``), with every expert on
the rank; :meth:`MoEGPT.split_experts` rebuilds the layers over the mesh's ``ep`` group
from the same seeds, each rank keeping its ``E / P`` experts: the weights are the same
at every ``--ep`` (the expert-parallel run follows the ``--ep 1`` run). With ``--tp T``
each expert is split over the mesh's ``tp`` group as well (its hidden dimension:
``MoE(..., tp_group=...)``), and :func:`moe_tp_plan` leaves the MoE blocks' MLP
patterns out of the GPT's tensor-parallel plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.models import GPT, GPTConfig
from shardkit.nn.moe import MoE, expert_parameters

AUX_LOSS_COEF = 0.01
"""Weight of the summed load-balancing losses in the training loss (Switch's 1e-2)."""


@dataclass(frozen=True)
class MoESettings:
    """``--moe-experts``, ``--moe-top-k``, ``--moe-every`` and the layers' seed.

    Attributes:
        experts: experts per MoE layer (all ranks together).
        top_k: experts per token.
        every: an MoE in every ``every``-th block (1: all blocks).
        seed: layer ``i``'s weights come from ``torch.manual_seed(seed + i)``.
    """

    experts: int
    top_k: int
    every: int = 1
    seed: int = 0


class MoEMLP(nn.Module):
    """A Block's MLP as an :class:`MoE`: ``x -> moe(x)[0]``; keeps the last forward's
    load-balancing loss (``aux``, a scalar with its graph)."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = moe
        self.aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, aux, _ = self.moe(x)
        self.aux = aux
        return out

    def dropped_fraction(self) -> float:
        """Share of the last forward's ``(token, choice)`` pairs dropped by the capacity."""
        routing = self.moe.last_routing
        if routing is None:
            return 0.0
        return 1.0 - float(routing.kept.float().mean())


class MoEGPT(GPT):
    """:class:`shardkit.models.GPT` with :class:`MoEMLP` blocks (see the module's notes).

    Args:
        config: the GPT's shape.
        moe: the experts, top-k and spacing.

    Raises:
        ValueError: ``top_k`` outside ``[1, experts]`` (from :class:`MoE`).
    """

    def __init__(self, config: GPTConfig, moe: MoESettings) -> None:
        super().__init__(config)
        self.moe_settings = moe
        self.split_experts(None)

    def moe_layers(self) -> list[MoEMLP]:
        """The MoE MLPs, in block order."""
        return [m for m in self.modules() if isinstance(m, MoEMLP)]

    def split_experts(
        self,
        ep_group: dist.ProcessGroup | None,
        tp_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        """(Re)build the MoE layers over ``ep_group`` (None: every expert here) and each
        expert over ``tp_group`` (None: whole experts), each layer from its seed: the
        same weights at any expert- and tensor-parallel size. With ``sequence_parallel``
        (``--sequence-parallel``) each layer takes and returns its rank's chunk of the
        sequence (``MoE(sequence_parallel=True)``). Before wrapping."""
        s, n = self.moe_settings, self.config.n_embd
        for i, block in enumerate(self.blocks):
            if i % s.every != s.every - 1:
                continue
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(s.seed + i)
                moe = MoE(
                    n,
                    4 * n,
                    s.experts,
                    k=s.top_k,
                    ep_group=ep_group,
                    tp_group=tp_group,
                    sequence_parallel=sequence_parallel,
                )
            block.mlp = MoEMLP(moe.to(self.wte.weight.device))

    def aux_loss(self) -> torch.Tensor:
        """The sum of the last forward's load-balancing losses."""
        losses = [m.aux for m in self.moe_layers() if m.aux is not None]
        return torch.stack(losses).sum() if losses else torch.zeros(())

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As :meth:`GPT.forward`; the loss adds ``AUX_LOSS_COEF x`` :meth:`aux_loss`."""
        logits, loss = super().forward(idx, targets, position_ids)
        if loss is not None:
            loss = loss + AUX_LOSS_COEF * self.aux_loss().to(loss.dtype)
        return logits, loss


def moe_tp_plan(model: GPT, plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` (the GPT's tensor-parallel plan) for ``model``: without the dense MLP's
    patterns when every block's MLP is an MoE (the experts split over tp themselves)."""
    if not isinstance(model, MoEGPT) or model.moe_settings.every > 1:
        return plan
    return {k: v for k, v in plan.items() if not k.startswith("blocks.*.mlp.")}


def moe_model_flags(experts: int, every: int) -> dict[str, int]:
    """The MoE flags that fix the model's tensors, for the checkpoint's model flags: a
    resume with others (a dense checkpoint into an MoE run, or the reverse) is refused
    naming them, before any key is looked up. ``--moe-top-k`` and ``--ep`` are not
    among them (the same tensors; the experts load at any ``--ep``)."""
    return {"moe_experts": experts, "moe_every": every if experts else 1}


def top_k_change(saved: int | None, experts: int, top_k: int) -> str | None:
    """The warning for a resume whose ``--moe-top-k`` (``top_k``) differs from the
    checkpoint's ``saved`` one, naming both; None when they agree, for a dense run
    (``experts`` 0) and for a checkpoint from before it was kept (``saved`` None).
    Allowed (the same tensors, see :func:`moe_model_flags`), but each token's routing
    and compute change from the next step on."""
    if saved is None or experts == 0 or saved == top_k:
        return None
    return (
        f"--moe-top-k {top_k} differs from the checkpoint's {saved}: each token now goes "
        f"to {top_k} of the {experts} experts instead of {saved}. To route as before, "
        f"resume with --moe-top-k {saved}"
    )


def active_and_total(model: MoEGPT) -> tuple[int, int]:
    """Parameters one token goes through (dense ones plus ``k / E`` of the experts) and
    all of them; counted before any expert-parallel split."""
    total = model.num_parameters()
    experts = sum(p.numel() for p in expert_parameters(model).values())
    s = model.moe_settings
    return total - experts + experts * s.top_k // s.experts, total


def moe_step_stats(model: nn.Module, device: torch.device) -> tuple[float, float]:
    """The last forward's summed load-balancing loss and dropped-choice fraction (mean
    over the MoE layers), each averaged over all ranks (a collective)."""
    layers = [m for m in model.modules() if isinstance(m, MoEMLP)]
    aux = sum(float(m.aux.detach()) for m in layers if m.aux is not None)
    dropped = sum(m.dropped_fraction() for m in layers) / max(1, len(layers))
    both = torch.tensor([aux, dropped], dtype=torch.float64, device=device)
    dist.all_reduce(both)
    both /= dist.get_world_size()
    return float(both[0]), float(both[1])


def moe_error(experts: int, top_k: int, every: int, ep: int, strategy: str) -> str | None:
    """Why the MoE flags do not fit (``--moe-top-k`` above ``--moe-experts``, experts
    not split evenly over ``--ep``, flags given without ``--moe-experts``, a strategy
    without MoE support), or None when they do."""
    if experts == 0:
        if (top_k, every, ep) != (1, 1, 1):
            return (
                "--moe-top-k, --moe-every and --ep need --moe-experts (the experts per MoE "
                "layer); add --moe-experts E or drop them"
            )
        return None
    if top_k > experts:
        return (
            f"--moe-top-k {top_k} is more than the {experts} experts; use --moe-top-k <= {experts}"
        )
    if experts % ep:
        return (
            f"--moe-experts {experts} does not split over --ep {ep} ranks; choose an --ep "
            f"that divides {experts}"
        )
    if strategy not in ("ddp", "oss", "sdp", "fsdp", "hsdp"):
        return (
            f"--moe-experts applies to --strategy ddp / oss / sdp / fsdp / hsdp, not {strategy!r}"
        )
    if ep > 1 and strategy in ("oss", "sdp"):
        return (
            f"--ep {ep} with --strategy {strategy}: OSS would broadcast one rank's experts "
            "over ranks holding others; use --strategy ddp / fsdp / hsdp or --ep 1"
        )
    return None
