"""The main job's ``--optimizer``: AdamW (default), Muon + AdamW, or Adafactor.

- ``adamw``: ``torch.optim.AdamW`` (:func:`gpt_strategy.adamw_kwargs`), every strategy,
  unchanged.
- ``muon``: ``torch.optim.Muon`` for the 2-D weights of the transformer blocks (the
  attention and MLP matrices), AdamW for the rest (embeddings, LayerNorms, biases), as
  Muon's authors train GPTs (Jordan et al. 2024). Muon runs with
  ``adjust_lr_fn="match_rms_adamw"`` (Liu et al. 2025, "Muon is scalable", section
  2.2), so one ``--lr`` serves both classes. Two optimizer classes in one optimizer:
  ``shardkit.optim.WholeTensorOptimizer``, over FSDP's shards (``fsdp``, ``hsdp``), as
  the local optimizer of ``OSS`` (``oss``, ``sdp``: each owner steps its whole
  tensors), or alone (``ddp``: every rank steps every whole tensor).
- ``adafactor``: ``torch.optim.Adafactor`` (factored second moment, Shazeer and Stern
  2018) at ``--lr`` on every parameter: plain under ``ddp``, wrapped by ``OSS`` under
  ``oss`` / ``sdp`` (each owner steps whole tensors), a ``WholeTensorOptimizer`` under
  ``fsdp`` / ``hsdp``.

Refused (exit 2): any optimizer but AdamW with ``pipe``
and ``offload`` (each stage or slice steps its own AdamW), with ``--tp`` > 1 and
``--cp`` > 1 (a whole-tensor optimizer must not step a tensor-parallel part; not
tried with context parallelism), with ``--moe-experts`` (the experts are a unit of
their own over another group) and with ``--precision fp16`` (loss scaling not tried).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.optim import OSS, WholeTensorOptimizer

OPTIMIZERS = ("adamw", "muon", "adafactor")
"""The ``--optimizer`` choices."""

WHOLE_TENSOR_STRATEGIES = {
    "adamw": ("ddp", "oss", "sdp", "fsdp", "hsdp", "pipe", "offload"),
    "muon": ("ddp", "oss", "sdp", "fsdp", "hsdp"),
    "adafactor": ("ddp", "oss", "sdp", "fsdp", "hsdp"),
}
"""The strategies each ``--optimizer`` runs with."""


def optimizer_error(
    optimizer: str, strategy: str, tp: int, cp: int, moe_experts: int, precision: str
) -> str | None:
    """Why ``--optimizer optimizer`` does not fit the other flags, or None."""
    if optimizer == "adamw":
        return None
    if optimizer not in OPTIMIZERS:
        return f"unknown --optimizer {optimizer!r}; choose one of {list(OPTIMIZERS)}"
    allowed = WHOLE_TENSOR_STRATEGIES[optimizer]
    if strategy not in allowed:
        why = f"--strategy {strategy} steps AdamW on each of its stages or slices"
        return (
            f"--optimizer {optimizer} applies to --strategy {' / '.join(allowed)}, not "
            f"{strategy!r} ({why}); use --strategy {allowed[0]} or --optimizer adamw"
        )
    for flag, value, reason in (
        ("--tp", tp, "a whole-tensor optimizer must not step a tensor-parallel part"),
        ("--cp", cp, "not tried with context parallelism"),
        ("--moe-experts", moe_experts, "the experts are a unit of their own over another group"),
    ):
        if value > (1 if flag != "--moe-experts" else 0):
            return (
                f"--optimizer {optimizer} does not apply with {flag} {value} ({reason}); drop one"
            )
    if precision == "fp16":
        return (
            f"--optimizer {optimizer} is not tried with --precision fp16 (loss scaling); "
            "use --precision bf16 or fp32"
        )
    return None


def optimizer_kwargs(optimizer: str, lr: float, adamw: dict[str, Any]) -> dict[str, Any]:
    """The settings of one param group of ``optimizer`` at the peak LR ``lr``
    (``adamw``: AdamW's, :func:`gpt_strategy.adamw_kwargs`)."""
    if optimizer == "muon":
        return {"lr": lr, "weight_decay": 0.01, "adjust_lr_fn": "match_rms_adamw"}
    if optimizer == "adafactor":
        return {"lr": lr}
    return adamw


def param_groups(
    optimizer: str, params: list[nn.Parameter], muon: list[bool], adamw: dict[str, Any]
) -> list[dict[str, Any]]:
    """The param groups of a :class:`WholeTensorOptimizer` (``muon``, ``adafactor``),
    each naming its class under ``"optim"``.

    Args:
        params: the parameters, in the order of the plain model's.
        muon: :func:`muon_names` of the plain model.

    Raises:
        RuntimeError: ``params`` are another number than ``muon`` says.
    """
    if len(params) != len(muon):
        raise RuntimeError(
            f"the wrapped model has {len(params)} parameters, the plain one {len(muon)}"
        )
    lr = adamw["lr"]
    if optimizer == "adafactor":
        return [{"params": params, "optim": torch.optim.Adafactor, "lr": lr}]
    matrices = [p for p, m in zip(params, muon) if m]
    rest = [p for p, m in zip(params, muon) if not m]
    return [
        {"params": matrices, "optim": torch.optim.Muon, **optimizer_kwargs("muon", lr, adamw)},
        {"params": rest, "optim": torch.optim.AdamW, **adamw},
    ]


def whole_optimizer(
    optimizer: str, model: nn.Module, adamw: dict[str, Any]
) -> torch.optim.Optimizer:
    """The optimizer of a strategy whose ranks hold whole parameters (``ddp``): every
    rank steps every parameter."""
    params = list(model.parameters())
    if optimizer == "adafactor":
        return torch.optim.Adafactor(params, **optimizer_kwargs(optimizer, adamw["lr"], adamw))
    if optimizer == "muon":
        return WholeTensorOptimizer(param_groups(optimizer, params, muon_names(model), adamw))
    return torch.optim.AdamW(params, **adamw)


def oss_optimizer(
    optimizer: str, model: nn.Module, adamw: dict[str, Any], group: dist.ProcessGroup | None
) -> OSS:
    """The ``OSS`` of ``oss`` / ``sdp``: each owner steps its whole parameters with
    AdamW, Adafactor, or (``muon``) a :class:`WholeTensorOptimizer` of Muon and AdamW."""
    if optimizer == "muon":
        groups = param_groups(optimizer, list(model.parameters()), muon_names(model), adamw)
        return OSS(groups, optim=WholeTensorOptimizer, process_group=group)
    oss_class = torch.optim.Adafactor if optimizer == "adafactor" else torch.optim.AdamW
    return OSS(
        model.parameters(),
        optim=oss_class,
        process_group=group,
        **optimizer_kwargs(optimizer, adamw["lr"], adamw),
    )


def muon_names(model: nn.Module) -> list[bool]:
    """Per parameter of ``model`` (``named_parameters()`` order, before wrapping):
    whether Muon steps it (a 2-D weight inside ``blocks``)."""
    return [n.startswith("blocks.") and p.ndim == 2 for n, p in model.named_parameters()]


def sharded_optimizer(
    optimizer: str,
    wrapped: nn.Module,
    params: list[nn.Parameter],
    muon: list[bool],
    adamw: dict[str, Any],
    group: dist.ProcessGroup | None,
) -> torch.optim.Optimizer:
    """The optimizer of FSDP's sharded parameters (``fsdp``, ``hsdp``): AdamW over the
    shards, or a :class:`WholeTensorOptimizer` over ``group`` (FSDP's shard group).

    Args:
        wrapped: the FSDP root.
        params: its parameters, in the order of the plain model's.
        muon: :func:`muon_names` of the plain model.

    Raises:
        RuntimeError: ``params`` are another number than ``muon`` says.
    """
    if optimizer == "adamw":
        return torch.optim.AdamW(params, **adamw)
    return WholeTensorOptimizer(
        wrapped, param_groups(optimizer, params, muon, adamw), process_group=group
    )
