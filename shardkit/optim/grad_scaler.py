"""Dynamic loss scaling for sharded training: every rank skips the same steps.

With sharded gradients (ShardedDataParallel, FSDP) or a sharded optimizer (OSS), each
rank sees only part of the gradients, so an inf/NaN may appear on one rank only. If
that rank alone skipped its step and halved its scale, the ranks' parameters and
scales would drift apart silently. :class:`ShardedGradScaler` checks the local part,
then all-reduces the finding (MAX) over the process group before the step decision,
so every rank skips the same step and updates the scale identically.

Source: mixed-precision training with dynamic loss scaling (Micikevicius et al.
2018, "Mixed Precision Training", section 3.2); sharded variant as in ZeRO
(Rajbhandari et al. 2020) and FairScale's ShardedGradScaler, which disables itself
on CPU; this one runs on CPU (gloo) too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import GradScaler

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN finding is agreed on by all ranks.

    Same API as ``torch.amp.GradScaler`` (``scale``, ``unscale_``, ``step``,
    ``update``, ``get_scale``, ``state_dict``, ``load_state_dict``)::

        scaler = ShardedGradScaler()
        with torch.autocast(device_type="cpu", dtype=torch.float16):
            loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)         # optional: e.g. before clip_grad_norm
        scaler.step(optimizer)             # skipped on every rank if any rank saw inf/NaN
        scaler.update()

    Args:
        init_scale: initial scale factor (a multiple applied to the loss). Default 2**16.
        growth_factor: scale multiplier after ``growth_interval`` clean steps. Default 2.0.
        backoff_factor: scale multiplier after a step with inf/NaN. Default 0.5.
        growth_interval: clean steps between growths. Default 2000.
        enabled: False makes every method a pass-through. Default True.
        process_group: the ranks that must agree; default None (the world group).
        device: where the scale lives: ``"cuda"`` when CUDA is available, else ``"cpu"``.

    Every rank of ``process_group`` must call :meth:`unscale_` (directly or through
    :meth:`step`) for the same optimizers in the same order: the agreement is a
    collective (one all-reduce of one float per optimizer per step).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: str | None = None,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this rank's gradients of ``optimizer``, then agree with the other
        ranks on whether any of them found inf/NaN (a collective).

        Raises:
            RuntimeError: as ``torch.amp.GradScaler.unscale_`` (called twice per step,
                or after ``step``).
        """
        if not self._enabled:
            return
        super().unscale_(optimizer)
        state: dict[str, Any] = self._per_optimizer_states[id(optimizer)]
        per_device: dict[torch.device, torch.Tensor] = state["found_inf_per_device"]
        assert self._scale is not None
        local = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for found in per_device.values():
            local = torch.maximum(local, found.to(local.device))
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.process_group)
        # One agreed entry replaces the per-device ones (a rank without gradients
        # still learns that another rank overflowed).
        state["found_inf_per_device"] = {local.device: local}
