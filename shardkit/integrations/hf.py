"""Hugging Face ``transformers.Trainer`` with shardkit's sharding, by one argument.

Swap the class and name a strategy; the rest of a Trainer script stays as it is::

    from shardkit.integrations.hf import ShardkitTrainer

    trainer = ShardkitTrainer(model=model, args=args, train_dataset=train,
                              eval_dataset=val, shardkit="fsdp")   # was: Trainer(...)
    trainer.train()

and launch with ``torchrun --nproc_per_node N script.py``. Strategies:

========  ==============================================  ==========
``oss``   torch DDP + ``OSS`` (gradients reduced to owner) ZeRO-1
``sdp``   ``ShardedDataParallel`` + ``OSS``                ZeRO-2
``fsdp``  ``FullyShardedDataParallel``, one unit per block ZeRO-3
          class of ``model._no_split_modules`` + the root
          (the whole model as one unit if it names none)
========  ==============================================  ==========

The optimizer is the one ``TrainingArguments`` selects (``optim``, ``learning_rate``,
``weight_decay`` with the Trainer's decay / no-decay split), wrapped in ``OSS`` or
built over FSDP's shards. What the Trainer does itself keeps working: the accelerate
data loaders, gradient accumulation (the wrapper's ``no_sync``), ``bf16`` (autocast,
as accelerate applies it), clipping by the global norm (the wrapper's own
``clip_grad_norm``), evaluation, ``save_model()`` (a plain HF checkpoint:
``from_pretrained`` loads it on one process) and checkpoints that
``resume_from_checkpoint`` continues from exactly (the model in HF format, the optimizer
state as a universal checkpoint in ``shardkit-optimizer/``, :data:`OPTIMIZER_DIR`,
saved with the model by :func:`~shardkit.checkpoint.universal.save_universal`: resumed
at any world size, by any strategy). A checkpoint of the previous release (per-rank
``optimizer.rank<r>-of-<n>.pt`` files) is refused. Each log line gains every rank's
model-state bytes (``model_state_bytes/rank<r>/<category>``). The Trainer's
``accelerator.unwrap_model`` sees through shardkit's wrappers, so what the Trainer
decides from the model's class (label smoothing with a causal LM's label shift, the
model card) is what it decides under DDP.

[Note: models without ``_no_split_modules``]
A model class that names no block class in ``_no_split_modules`` (DistilBERT, ALBERT,
ELECTRA, DeBERTa, Marian, Pegasus, ...) becomes ONE FSDP unit: the root holds every
parameter. This is what accelerate's transformer-based wrap policy (the Trainer's
default for its own FSDP) gives such a model, and it is correct for every model: a
size-based policy could put a module whose weight another module reads directly (an
embedding read as ``.weight``, a layer shared by several blocks) in a unit of its own,
and its threshold would have to suit every size. The cost: the whole model is gathered
for forward and backward (parameters, gradients and optimizer state stay sharded between
steps). ``ShardkitConfig(strategy="fsdp", wrap_classes=("TransformerBlock",))`` splits
it by block class. The policy used is printed as one line on rank 0.

Tested with transformers 5.23.0 and accelerate 1.15.0 (``requirements.txt``). The
integration overrides ``Trainer`` methods, some of them private (``_wrap_model``,
``_clip_grad_norm``, ``_get_grad_norm``, ``_save_optimizer_and_scheduler``,
``_load_optimizer_and_scheduler``, ``_load_from_checkpoint``): other versions may
need changes. Not supported: ``fp16`` (its loss scaler would decide per rank), the
Trainer's own ``fsdp`` / ``deepspeed`` options, an optimizer passed in
``optimizers=``. Guide: ``docs/hf_trainer.md``.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.extras import MissingDependency

try:  # the `hf` extra: without it, one line saying what to install
    import accelerate  # type: ignore[import-untyped]  # noqa: F401  (the Trainer needs it)
    from transformers import Trainer
except ImportError as error:
    raise MissingDependency(
        "shardkit.integrations.hf", error.name or "transformers", "pip install -e '.[hf]'"
    ) from error

from shardkit.checkpoint.universal import load_universal, save_universal
from shardkit.memory import model_state_bytes
from shardkit.nn import (
    FullyShardedDataParallel,
    ShardedDataParallel,
    auto_wrap,
    enable_wrap,
    transformer_auto_wrap_policy,
)
from shardkit.nn.wrap import AutoWrapPolicy
from shardkit.optim import OSS, register_reduce_to_owner_hook

__all__ = [
    "OPTIMIZER_DIR",
    "STRATEGIES",
    "ShardkitConfig",
    "ShardkitTrainer",
    "block_classes",
    "fsdp_wrap_policy",
]

Strategy = Literal["oss", "sdp", "fsdp"]
STRATEGIES: tuple[str, ...] = ("oss", "sdp", "fsdp")
SCHEDULER_NAME = "scheduler.pt"  # transformers.trainer.SCHEDULER_NAME
OPTIMIZER_DIR = "shardkit-optimizer"
"""The universal checkpoint root of the optimizer state in a Trainer checkpoint directory."""


# the per-rank optimizer files of the previous release (refused, see _load_optimizer_...)
_OLD_OPTIMIZER_FILE = re.compile(r"optimizer\.rank\d+-of-\d+\.pt")


@dataclass(frozen=True)
class ShardkitConfig:
    """What :class:`ShardkitTrainer` wraps the model with.

    Raises:
        ValueError: an unknown strategy, or ``wrap_classes`` given as one string.

    Attributes:
        strategy: ``"oss"`` (ZeRO-1), ``"sdp"`` (ZeRO-2) or ``"fsdp"`` (ZeRO-3).
        wrap_classes: fsdp: class names of the modules that become one FSDP unit each
            (the root unit holds the rest); None: the model's ``_no_split_modules``
            (``["GPT2Block"]``, ``["BertLayer"]``, ...), or the whole model as one unit
            when those name no submodule's class; ``()``: the whole model as one unit.
            Default None.
        log_state_bytes: add every rank's model-state bytes to each log. Default True.
    """

    strategy: Strategy
    wrap_classes: tuple[str, ...] | None = None
    log_state_bytes: bool = True

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"unknown shardkit strategy {self.strategy!r}; choose one of {list(STRATEGIES)}"
            )
        if isinstance(self.wrap_classes, str):
            raise ValueError(
                f"wrap_classes={self.wrap_classes!r} is one string; pass a tuple of class "
                f"names: wrap_classes=({self.wrap_classes!r},)"
            )


def block_classes(model: nn.Module, names: Iterable[str]) -> set[type[nn.Module]]:
    """The classes of ``model``'s submodules whose class name is in ``names``.

    Raises:
        ValueError: no submodule has one of these class names.
    """
    wanted = set(names)
    found = {type(m) for m in model.modules() if type(m).__name__ in wanted}
    if not found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"fsdp: no module of {type(model).__name__} is of a class named in "
            f"{sorted(wanted)} (ShardkitConfig.wrap_classes); its module classes are "
            f"{present}: name some of them, or pass wrap_classes=None"
        )
    return found


def fsdp_wrap_policy(
    model: nn.Module, wrap_classes: Iterable[str] | None = None
) -> tuple[AutoWrapPolicy | None, str]:
    """The auto-wrap policy :class:`ShardkitTrainer` nests FSDP units by, and a line
    saying which it is.

    Args:
        model: the model to wrap.
        wrap_classes: class names, one unit per instance (``ShardkitConfig.wrap_classes``;
            empty: the whole model is one unit); default None: the classes named in
            ``model._no_split_modules`` that occur in ``model``.

    Returns:
        ``(policy, line)``: ``policy`` is a :func:`~shardkit.nn.transformer_auto_wrap_policy`,
        or None when no block class is named (the whole model is one unit, see
        [Note: models without ``_no_split_modules``]).

    Raises:
        ValueError: ``wrap_classes`` names no class of ``model``'s submodules.
    """
    owner = type(model).__name__
    if wrap_classes is not None:
        wanted = tuple(wrap_classes)
        classes = block_classes(model, wanted) if wanted else set()
        source = "ShardkitConfig.wrap_classes"
    else:
        named = set(getattr(model, "_no_split_modules", None) or ())
        classes = {type(m) for m in model.modules() if type(m).__name__ in named}
        source = f"{owner}._no_split_modules"
    if not classes:
        return None, (
            f"shardkit fsdp: {source} names no block class of the model: the whole {owner} "
            "is one FSDP unit (ShardkitConfig(strategy='fsdp', wrap_classes=(...)) splits it)"
        )
    names = sorted(c.__name__ for c in classes)
    line = f"shardkit fsdp: one FSDP unit per {', '.join(names)} ({source}) + the root"
    return transformer_auto_wrap_policy(classes), line


def _see_through(unwrap_model: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``accelerator.unwrap_model`` that first takes ``model`` out of shardkit's
    wrappers (an FSDP root, ``ShardedDataParallel``): the Trainer reads the model's
    class from what it returns."""
    while isinstance(model, (FullyShardedDataParallel, ShardedDataParallel)):
        model = model.module
    return unwrap_model(model, *args, **kwargs)


def _ensure_process_group() -> None:
    """A one-rank gloo group when the script runs without torchrun."""
    if not dist.is_initialized():
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


class ShardkitTrainer(Trainer):
    """A ``transformers.Trainer`` whose model and optimizer are sharded by shardkit.

    Args:
        *args: as ``Trainer``.
        shardkit: ``"oss"``, ``"sdp"``, ``"fsdp"`` or a :class:`ShardkitConfig`; None:
            a plain ``Trainer`` (DDP under torchrun).
        **kwargs: as ``Trainer``.

    Raises:
        ValueError: an option the integration does not support (``fp16``, the
            Trainer's ``fsdp`` or ``deepspeed``, an optimizer in ``optimizers=``).

    Attributes:
        model_state_bytes: every rank's model-state bytes at the last log
            (``ModelStateBytes.as_dict()`` per rank).
    """

    def __init__(
        self, *args: Any, shardkit: str | ShardkitConfig | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(shardkit, str):
            shardkit = ShardkitConfig(cast(Strategy, shardkit))
        self.shardkit = shardkit
        self.sharded_module: nn.Module | None = None
        self.sharded_optimizer: torch.optim.Optimizer | None = None
        self.model_state_bytes: list[dict[str, int]] = []
        if shardkit is not None:
            self._check_supported()
            _ensure_process_group()
            # an instance attribute: every Trainer path that unwraps goes through it
            unwrap = functools.partial(_see_through, self.accelerator.unwrap_model)
            setattr(self.accelerator, "unwrap_model", unwrap)  # noqa: B010

    def _check_supported(self) -> None:
        args, name = self.args, f"ShardkitTrainer(shardkit={self.shardkit.strategy!r})"  # type: ignore[union-attr]
        if args.fp16:
            raise ValueError(
                f"{name}: fp16 is not supported (its loss scaler decides per rank); use bf16"
            )
        if args.deepspeed or args.fsdp:
            raise ValueError(
                f"{name}: the Trainer's own fsdp / deepspeed options replace shardkit's"
            )
        if self.optimizer is not None:
            raise ValueError(
                f"{name}: pass no optimizer in optimizers=; the optimizer comes from "
                "TrainingArguments (optim, learning_rate, weight_decay, ...)"
            )

    # wrapping ----------------------------------------------------------------------
    @property
    def _plain_model(self) -> nn.Module:
        """``self.model``, the unwrapped model (FSDP nests units inside it)."""
        if self.model is None:
            raise ValueError("ShardkitTrainer needs a model (model= or model_init=)")
        return self.model

    def _fsdp_module(self) -> FullyShardedDataParallel:
        """The FSDP root over ``self.model`` (built once): one unit per block class (see
        :func:`fsdp_wrap_policy`), whose line rank 0 prints."""
        if self.sharded_module is None:
            config = cast(ShardkitConfig, self.shardkit)
            model = self._plain_model
            policy, line = fsdp_wrap_policy(model, config.wrap_classes)
            if self.is_world_process_zero():
                print(line, flush=True)
            if policy is not None:
                with enable_wrap(wrapper_cls=FullyShardedDataParallel):
                    model = auto_wrap(model, policy)
            self.sharded_module = FullyShardedDataParallel(model)
        return cast(FullyShardedDataParallel, self.sharded_module)

    def _build(self) -> None:
        """Wrap the model and build the sharded optimizer (once)."""
        strategy = cast(ShardkitConfig, self.shardkit).strategy
        model = self._plain_model
        optim_cls, optim_kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)  # type: ignore[arg-type]
        decay = set(self.get_decay_parameter_names(model))
        owner: nn.Module = self._fsdp_module() if strategy == "fsdp" else model
        named = [(n, p) for n, p in owner.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        optimizer: torch.optim.Optimizer
        if strategy == "fsdp":
            optimizer = optim_cls(groups, **optim_kwargs)
            module: nn.Module = owner
        else:
            optimizer = OSS(groups, optim=optim_cls, **optim_kwargs)
            if strategy == "sdp":
                module = ShardedDataParallel(model, optimizer)
            else:
                device = self.args.device
                module = DistributedDataParallel(
                    model,
                    device_ids=[device] if device.type == "cuda" else None,
                    find_unused_parameters=bool(self.args.ddp_find_unused_parameters),
                )
                register_reduce_to_owner_hook(module, optimizer)
        self.sharded_module, self.sharded_optimizer = module, optimizer
        # the Trainer then calls accelerator.prepare(optimizer): it finds this one already
        # prepared (no device placement, which would read a full OSS state dict)
        prepared = self.accelerator.prepare_optimizer(optimizer, device_placement=False)
        prepared._is_accelerate_prepared = True
        self.optimizer = prepared

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The sharded optimizer (the model is wrapped at the same time)."""
        if self.shardkit is None:
            return super().create_optimizer(model)
        if self.sharded_optimizer is None:
            self._build()
        return self.optimizer  # type: ignore[return-value]

    def _wrap_model(
        self, model: nn.Module, training: bool = True, dataloader: Any = None
    ) -> nn.Module:
        if self.shardkit is None:
            return super()._wrap_model(model, training, dataloader)  # type: ignore[no-any-return]
        if training:
            self.create_optimizer()
            return cast(nn.Module, self.sharded_module)
        if self.shardkit.strategy == "fsdp":
            return self._fsdp_module()  # the parameters exist only as shards
        return self._plain_model  # full parameters: no collectives

    def autocast_smart_context_manager(
        self, cache_enabled: bool | None = True
    ) -> AbstractContextManager[Any]:
        """``bf16``: accelerate's autocast (it patches the forward of the models it
        prepares; shardkit's wrapped model is not one of them)."""
        if self.shardkit is not None and self.accelerator.native_amp:
            return cast(AbstractContextManager[Any], self.accelerator.autocast())
        return super().autocast_smart_context_manager(cache_enabled)  # type: ignore[no-any-return]

    # gradient norm -----------------------------------------------------------------
    def _sharded_clip(self, max_norm: float) -> torch.Tensor:
        if isinstance(self.sharded_module, FullyShardedDataParallel):
            return self.sharded_module.clip_grad_norm_(max_norm)
        return cast(OSS, self.sharded_optimizer).clip_grad_norm(max_norm)

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        if self.shardkit is None:
            return super()._clip_grad_norm(model)
        return self._sharded_clip(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if self.shardkit is None:
            return super()._get_grad_norm(model, grad_norm)
        return self._sharded_clip(float("inf")) if grad_norm is None else grad_norm

    # saving and resuming -----------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A plain HF checkpoint (``from_pretrained`` loads it); call it on every rank
        (with fsdp the full state dict is gathered)."""
        if self.shardkit is None or not isinstance(self.sharded_module, FullyShardedDataParallel):
            super().save_model(output_dir, _internal_call)
            return
        state = self.sharded_module.state_dict()  # every rank gathers, plain keys
        self._save(output_dir or self.args.output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The optimizer state as a universal checkpoint in
        ``<output_dir>/shardkit-optimizer/ckpt-<global step>`` (with the model, keyed by
        the plain model's names: it loads at any world size and strategy), and the
        scheduler as the Trainer writes it. A collective: every rank calls it."""
        if self.shardkit is None:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        save_universal(
            os.path.join(output_dir, OPTIMIZER_DIR),
            self.state.global_step,
            self.sharded_module,
            self.sharded_optimizer,
            keep=1,
        )
        if self.args.should_save:
            scheduler = cast(torch.optim.lr_scheduler.LRScheduler, self.lr_scheduler)
            torch.save(scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The optimizer state of ``<checkpoint>/shardkit-optimizer`` (saved at any world
        size, by any strategy) and the scheduler; nothing when no optimizer state was
        saved (``save_only_model``), as the Trainer does.

        Raises:
            ValueError: ``checkpoint`` holds the previous release's per-rank optimizer
                files (``optimizer.rank<r>-of-<n>.pt``).
        """
        if self.shardkit is None or checkpoint is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        old = sorted(n for n in os.listdir(checkpoint) if _OLD_OPTIMIZER_FILE.fullmatch(n))
        if old:
            raise ValueError(
                f"{checkpoint} holds per-rank optimizer files of an older shardkit release "
                f"({', '.join(old)}), which this release does not read: resume it with that "
                "release, or resume without its optimizer state (delete those files; the "
                "optimizer starts fresh)"
            )
        directory = os.path.join(checkpoint, OPTIMIZER_DIR)
        if not os.path.isdir(directory):
            return  # no optimizer state saved (save_only_model): as the Trainer does
        load_universal(
            directory, self.sharded_module, self.sharded_optimizer, require_optimizer_state=True
        )
        scheduler = torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
        cast(torch.optim.lr_scheduler.LRScheduler, self.lr_scheduler).load_state_dict(scheduler)

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: nn.Module | None = None
    ) -> None:
        if self.shardkit is not None and isinstance(self.sharded_module, FullyShardedDataParallel):
            raise RuntimeError(
                "resume_from_checkpoint with shardkit fsdp: the model is already sharded (an "
                "evaluate() or train() ran before); resume with a fresh ShardkitTrainer"
            )
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    # logging -----------------------------------------------------------------------
    def gather_model_state_bytes(self) -> list[dict[str, int]]:
        """Every rank's model-state bytes (a collective; call it on every rank)."""
        mine = model_state_bytes(cast(nn.Module, self.sharded_module), self.sharded_optimizer)
        fields = [mine.parameters, mine.gradients, mine.optimizer_state, mine.buffers]
        local = torch.tensor(fields, dtype=torch.int64, device=self.args.device)
        every = torch.empty(
            dist.get_world_size() * len(fields), dtype=torch.int64, device=local.device
        )
        dist.all_gather_single(every, local)  # type: ignore[attr-defined]
        keys = ("parameters", "gradients", "optimizer_state", "buffers")
        rows = every.view(-1, len(fields)).tolist()
        return [dict(zip(keys, (int(v) for v in row))) for row in rows]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """As ``Trainer.log`` (called on every rank), plus every rank's model-state bytes."""
        config = self.shardkit
        if config is not None and config.log_state_bytes and self.sharded_module is not None:
            self.model_state_bytes = self.gather_model_state_bytes()
            for rank, held in enumerate(self.model_state_bytes):
                for key in ("parameters", "gradients", "optimizer_state"):
                    logs[f"model_state_bytes/rank{rank}/{key}"] = float(held[key])
        super().log(logs, start_time)
