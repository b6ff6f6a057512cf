"""The GPT behind the pipeline and offload wrappers: the loop's ``module(x, targets=y)``
and checkpoints under the plain GPT's keys.

:class:`PipelineGPT` runs this rank's stage of a :class:`shardkit.compose.ParallelModel`
(the schedule); :class:`OffloadGPT` runs an :class:`OffloadModel`. Their strategies
(:class:`PipeStrategy`, :class:`OffloadStrategy`) and :class:`GPTKeys`, the layout
adapter that lists their tensors under the plain GPT's keys so that their checkpoints
cross to and from ddp, oss, sdp, fsdp, are registered here with the universal
checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpt_strategy import Strategy
from torch import nn

from shardkit.checkpoint.universal import (
    LayoutAdapter,
    ParamEntry,
    Purpose,
    layout_of,
    register_layout,
    session_of,
)
from shardkit.compose import ParallelModel
from shardkit.models import GPT, gpt_stages
from shardkit.nn import tensor_parallel as tp
from shardkit.nn.offload import DiskTier, OffloadModel
from shardkit.nn.pipe import consolidated_state_dict

__all__ = [
    "GPTKeys",
    "OffloadGPT",
    "OffloadStrategy",
    "PipeStrategy",
    "PipelineGPT",
    "gpt_key",
    "lm_loss",
]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, as ``GPT.forward`` computes it."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class PipelineGPT(nn.Module):
    """This rank's pipeline stage of the GPT: the schedule in :meth:`forward_backward`.

    Built by :func:`shardkit.compose.parallelize_model` over the mesh's ``pp`` ranks
    (``gpt_stages``, balanced by size), after ``--tp`` and
    ``--activation-checkpointing``; with ``dp`` > 1 each stage is replicated (torch
    DDP) over the ranks holding the same stage. ``model`` may be built on the meta
    device (the main job does without ``--tp``, see the spec's ``meta_init``): only
    this rank's stage is then allocated and initialised, bit-identically to the plain
    GPT's initialisation at the same seed (:func:`gpt_stage_init.materialize_stage`).

    Every rank samples its own batch, as under DDP; the batches of one pipeline's ranks
    (its ``pp`` group) are all-gathered so that each pipeline trains on ``pp x batch``
    rows and the ``dp`` pipelines together on the global batch DDP would (mean loss,
    gradients averaged over the replicas). :meth:`forward_backward` runs the whole
    schedule (forwards and backwards of every micro-batch); ``forward``
    (``module(x, targets=y)``, as the evaluation calls it) runs the forwards only,
    without gradients. The tied embedding / LM-head weight lives on the first and the
    last stage; :meth:`ParallelModel.pipeline_step` sums their gradients.
    """

    def __init__(self, parallel: ParallelModel) -> None:
        super().__init__()
        assert parallel.stage is not None and parallel.schedule is not None
        self.parallel = parallel
        self.stage, self.runner = parallel.stage, parallel.schedule
        self.group = parallel.mesh.group("pp")
        self.last = parallel.mesh.ranks("pp")[-1]
        # this rank's stage, unwrapped: plain gpt_stages keys
        inner = getattr(self.stage.module, "module", self.stage.module)
        self.stage_module: nn.Module = inner

    def _global(self, t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts)

    def _on_every_rank(self, loss: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """The last stage's loss (shape ``()``), broadcast to every stage."""
        out = loss.detach().reshape(()) if loss is not None else torch.zeros((), device=device)
        dist.broadcast(out, self.last, group=self.group)
        return out

    def forward_backward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule on this pipeline's batch; its mean loss (detached, on every rank)."""
        x, y = self._global(x), self._global(targets)
        first, last = self.stage.is_first, self.stage.is_last
        loss = self.parallel.pipeline_step(x if first else None, y if last else None)
        return self._on_every_rank(loss, x.device)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[None, torch.Tensor]:
        """The forwards only (evaluation): ``(None, mean loss)`` on every rank."""
        x, y = self._global(x), self._global(targets)
        logits = self.runner.forward(x if self.stage.is_first else None)
        loss = lm_loss(logits, y) if isinstance(logits, torch.Tensor) else None
        return None, self._on_every_rank(loss, x.device)


class PipeStrategy(Strategy):
    """Checkpoints hold this rank's stage (keys of ``gpt_stages``); the final
    ``model.pt`` holds the plain GPT, consolidated from every stage onto rank 0."""

    module: PipelineGPT

    def __init__(self, module: PipelineGPT, optimizer: torch.optim.Optimizer, gpt: GPT) -> None:
        super().__init__(module=module, optimizer=optimizer, model=module.stage_module)
        self.gpt = gpt

    def forward_backward(
        self, x: torch.Tensor, y: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        if weight != 1.0:
            raise ValueError(f"pipe runs whole steps only (weight {weight}, expected 1.0)")
        return self.module.forward_backward(x, y)

    def checkpoint_module(self) -> Any:
        """The :class:`PipelineGPT`: this rank's stage under the plain GPT's keys
        (:class:`GPTKeys`)."""
        return self.module

    def accumulate(self, x: torch.Tensor, y: torch.Tensor, accumulation: int) -> torch.Tensor:
        """Every row in one schedule (its ``--chunks`` micro-batches already accumulate
        the gradients of the global batch): the same gradient for any ``accumulation``."""
        return self.forward_backward(x, y)

    def consolidated_model_state(self) -> dict[str, Any] | None:
        """The plain GPT's state dict on rank 0: each stage's tensor-parallel parts
        gathered over ``tp``, then the stages over ``pp`` (every pipeline replica
        gathers its own; rank 0's is kept)."""
        parallel = self.module.parallel
        split = parallel.split_tensors
        group = parallel.mesh.group("tp")

        def full(key: str, value: torch.Tensor) -> torch.Tensor:
            if gpt_key(key) not in split:
                return value
            dim, stride = split[gpt_key(key)]
            return tp.full_tensor(value, dim, group, stride)

        merged = consolidated_state_dict(
            self.module.stage_module, process_group=self.module.group, transform=full
        )
        if merged is None:
            return None
        # plain GPT keys, matched to gpt_stages keys by tensor identity (rank 0 may hold
        # only its stage: the other layers are on meta)
        stage_key = {id(t): k for k, t in gpt_stages(self.gpt).state_dict(keep_vars=True).items()}
        return {k: merged[stage_key[id(t)]] for k, t in self.gpt.state_dict(keep_vars=True).items()}


class OffloadGPT(nn.Module):
    """The GPT as an :class:`OffloadModel` behind the loop's ``module(x, targets=y)``."""

    def __init__(self, offload: OffloadModel) -> None:
        super().__init__()
        self.offload = offload

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.offload(x)
        return logits, lm_loss(logits, targets)


class OffloadStrategy(Strategy):
    """Offload: checkpoints and ``model.pt`` hold plain GPT keys. On the disk tier the
    model state lives in ``--offload-dir/rank<r>`` (stepped by ``sliced_optimizer``);
    the universal checkpoint reads it from there and a resume writes it back
    (:class:`GPTKeys` over OffloadModel's layout). The per-rank ``state_dict`` records
    the directory's generation: loading it needs the directory at that generation."""

    module: OffloadGPT

    def __init__(self, module: OffloadGPT, optimizer: torch.optim.Optimizer, gpt: GPT) -> None:
        super().__init__(module=module, optimizer=optimizer, model=gpt)
        names = {id(p): n for n, p in gpt.named_parameters()}
        self.to_gpt = {n: names[id(p)] for n, p in module.offload.named_parameters()}
        self.disk = module.offload.tier if isinstance(module.offload.tier, DiskTier) else None

    def _gpt_state(self) -> dict[str, Any]:
        if self.disk is None:
            return self.model.state_dict()
        state = {self.to_gpt[k]: v for k, v in self.module.offload.state_dict().items()}
        state["lm_head.weight"] = state["wte.weight"]  # tied
        return state

    def state_dict(self) -> dict[str, Any]:
        if self.disk is None:
            return super().state_dict()
        return {
            "model": self._gpt_state(),
            "optimizer": self.optimizer.state_dict(),  # hyperparameters (LR) only
            "offload_generation": self.disk.generation,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.disk is None:
            super().load_state_dict(state)
        elif state["offload_generation"] != self.disk.generation:
            raise ValueError(
                f"the checkpoint is at offload generation {state['offload_generation']} but "
                f"{self.disk.directory} holds generation {self.disk.generation}; resume from "
                "the checkpoint written with the directory's last step"
            )
        else:
            self.optimizer.load_state_dict(state["optimizer"])

    def consolidated_model_state(self) -> dict[str, Any] | None:
        return self._gpt_state()

    def checkpoint_module(self) -> Any:
        """The :class:`OffloadGPT`: its slices under the plain GPT's keys
        (:class:`GPTKeys`), on the CPU tier or the disk tier."""
        return self.module


def gpt_key(stage_key: str) -> str:
    """The plain GPT's key of a ``gpt_stages`` key: ``"0.wte.weight"`` -> ``"wte.weight"``,
    ``"2.attn.qkv.weight"`` -> ``"blocks.1.attn.qkv.weight"``, ``"5.ln_f.bias"`` ->
    ``"ln_f.bias"`` (the embedding and the head keep their attribute names)."""
    index, _, rest = stage_key.partition(".")
    if rest.startswith(("wte.", "wpe.", "ln_f.", "lm_head.")):
        return rest
    return f"blocks.{int(index) - 1}.{rest}"


class GPTKeys:
    """The universal-checkpoint layout of a ``gpt_stages`` wrapper (pipe, offload) under
    the plain GPT's keys, so that its checkpoints cross to and from ddp, oss, sdp, fsdp.

    ``inner`` is the wrapper's own adapter (keys of ``gpt_stages``). The tied LM-head
    weight appears as ``lm_head.weight`` only where it is a copy of its own (the last
    pipeline stage, the first holding ``wte.weight``): the plain GPT saves the tied
    weight once, as ``wte.weight``, so that copy is listed under ``wte.weight`` and
    not written (the first stage writes it), and loading fills it from ``wte.weight``.
    """

    def __init__(self, inner: LayoutAdapter) -> None:
        self.inner = inner
        self.strategy = inner.strategy

    def entries(self) -> Iterator[ParamEntry]:
        for entry in self.inner.entries():
            key = gpt_key(entry.key)
            if key == "lm_head.weight":
                yield dataclasses.replace(entry, key="wte.weight", write=False)
            else:
                yield dataclasses.replace(entry, key=key)

    def aliases(self) -> dict[str, str]:
        """The plain GPT's tied key (its LM head is the token embedding), recorded in
        the manifest so that ``python -m shardkit.checkpoint convert`` writes both
        names and the output loads into ``GPT`` with ``strict=True``."""
        return {"lm_head.weight": "wte.weight"}

    def after_load(self) -> None:
        self.inner.after_load()

    def session(self, purpose: Purpose) -> contextlib.AbstractContextManager[Any]:
        """The inner adapter's session (the offload disk tier maps its files in it)."""
        return session_of(self.inner, purpose)


register_layout(PipelineGPT, lambda model, optimizer: GPTKeys(layout_of(model.stage, optimizer)))


register_layout(OffloadGPT, lambda model, optimizer: GPTKeys(layout_of(model.offload, optimizer)))
