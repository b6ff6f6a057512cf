"""``OffloadModel``: train a sequential model larger than fast memory, one slice at a time."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.checkpoint.generations import check_byte_count
from shardkit.distributed.consistency import describe_parameters, verify_consistent
from shardkit.distributed.linear_partition import balance_bounds, solve_balance
from shardkit.distributed.optim_guard import mark_replaced
from shardkit.distributed.validation import check_not_wrapped, parameter_problem
from shardkit.nn.offload.disk import DiskTier
from shardkit.nn.offload.flat import SliceLayout
from shardkit.nn.offload.function import SliceFunction, SliceRunner, average_gradients
from shardkit.nn.offload.optim import SlicedOptimizer
from shardkit.nn.offload.slices import Slice, SliceState, shared_parameter_ids
from shardkit.nn.offload.tiers import MemoryTier, ResidentTier, Tier

__all__ = ["OffloadModel"]

OffloadTarget = torch.device | str | os.PathLike[str] | Tier
_CPU = torch.device("cpu")
_DISK_WRAPPER = "an OffloadModel on the disk tier (an empty placeholder between uses)"
_DISK_FIX = "Step with model.sliced_optimizer(optimizer_class, **kwargs) instead"


def _layers(model: nn.Sequential | Sequence[nn.Module]) -> tuple[list[nn.Module], bool]:
    """The layers of ``model`` and whether they are already slices (a list, as in FairScale)."""
    if isinstance(model, nn.Sequential):
        return list(model), False
    if isinstance(model, (list, tuple, nn.ModuleList)) and all(
        isinstance(m, nn.Module) for m in model
    ):
        return list(model), True
    raise TypeError(
        f"OffloadModel needs an nn.Sequential (or a list of modules, one per slice); got "
        f"{type(model).__name__}. Express the model as a sequence of stages, each taking "
        "one tensor and returning one (see shardkit.models.gpt_stages for a GPT)"
    )


def _named_parameters(
    model: nn.Sequential | Sequence[nn.Module],
) -> Iterator[tuple[str, nn.Parameter]]:
    if isinstance(model, nn.Module):
        yield from model.named_parameters()
        return
    for i, layer in enumerate(model):
        if isinstance(layer, nn.Module):
            yield from layer.named_parameters(prefix=str(i))


def _split(
    model: nn.Sequential | Sequence[nn.Module], num_slices: int, shared: set[int] | None = None
) -> list[nn.Sequential]:
    layers, presplit = _layers(model)
    if presplit:
        return [m if isinstance(m, nn.Sequential) else nn.Sequential(m) for m in layers]
    shared = shared_parameter_ids(layers) if shared is None else shared
    sizes = [sum(p.numel() for p in m.parameters() if id(p) not in shared) for m in layers]
    bounds = balance_bounds(solve_balance(sizes, num_slices, name="num_slices"))
    return [nn.Sequential(*layers[a:b]) for a, b in bounds]


def _make_tier(
    device: torch.device,
    offload_device: OffloadTarget,
    offload_dir: str | os.PathLike[str] | None,
    resume: bool,
    disk_io_bytes: int = 0,
) -> Tier:
    if isinstance(offload_device, Tier):
        return offload_device
    if isinstance(offload_device, os.PathLike):
        offload_dir, offload_device = offload_device, "disk"
    if offload_device == "disk" or offload_dir is not None:
        if offload_dir is None:
            raise ValueError('offload_device="disk" needs offload_dir=<a directory>')
        if offload_device not in ("disk", torch.device("cpu")):
            raise ValueError(
                f"offload_dir is given, so the disk tier is used; offload_device must be "
                f'"disk" (or left at its default), not {offload_device!r}'
            )
        return DiskTier(device, offload_dir, resume=resume, io_bytes=disk_io_bytes)
    if resume:
        raise ValueError("resume=True needs the disk tier (offload_dir=...)")
    if disk_io_bytes:
        raise ValueError("disk_io_bytes needs the disk tier (offload_dir=...)")
    target = torch.device(offload_device)
    return ResidentTier(device) if target == device else MemoryTier(device, target)


class OffloadModel(nn.Module):
    """Keep a sequential model's slices on a slower tier; bring each in only while it runs.

    Example::

        model = nn.Sequential(*layers)
        model = OffloadModel(model, device=torch.device("cuda"), num_slices=4)  # CPU tier
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss_fn(model(x), y).backward(); optimizer.step()

        # disk tier: parameters, gradients and optimizer state in files, on any machine
        model = OffloadModel(model, "cpu", offload_dir="/scratch/run1", num_slices=8)
        optimizer = model.sliced_optimizer(torch.optim.AdamW, lr=1e-3)

    The model is cut into ``num_slices`` contiguous slices with the largest slice as
    small as possible (by parameter count). Forward loads slice 0, runs all
    micro-batches through it, offloads it, and so on; backward does the same in
    reverse, recomputing each slice's activations from its saved input when
    ``checkpoint_activation`` is set (Rhu et al. 2016, vDNN; Ren et al. 2021,
    "ZeRO-Offload", section 4; FairScale's OffloadModel). Parameters used by more than
    one slice (a tied embedding and LM head) form a ``shared`` group that stays
    resident on ``device``.

    Args:
        model: an ``nn.Sequential`` whose children each take and return one tensor, or
            a list of modules that are already the slices (then ``num_slices`` is
            ignored, as in FairScale). Its parameters may be on ``meta`` with the disk
            tier (see ``param_init_fn``, ``resume``).
        device: the compute device (``torch.device`` or string).
        offload_device: where slices live while not running. A device (default
            ``cpu``; equal to ``device``: nothing moves), ``"disk"`` (with
            ``offload_dir``), a ``pathlib.Path`` (the disk tier in that directory), or
            a :class:`~shardkit.nn.offload.tiers.Tier` instance.
        num_slices: number of slices, ``1 <= num_slices <= len(model)``; default 3.
        checkpoint_activation: keep only each slice's input during forward and
            recompute its activations in backward (default False).
        num_microbatches: split the batch (dim 0) into this many micro-batches that
            pass through each loaded slice in turn (default 1). Allowed without
            checkpointing too (FairScale requires it); it lowers activation memory only
            with checkpointing. A batch smaller than this uses one micro-batch per row.
        offload_dir: directory of the disk tier (created if missing); default None.
        resume: disk tier only: continue from the generation stored in ``offload_dir``
            (the model gives only the architecture) instead of starting a new one.
        disk_io_bytes: disk tier only: memory ``optimizer.step()``, forward and
            backward may use beyond one slice to keep the disk busy (see [Note: the step
            at the disk's speed] in :mod:`shardkit.nn.offload.disk`), in bytes: at most
            this many of writes in flight and this many held ahead (the next two
            slices' parameters, and in the step their gradients and optimizer state,
            each part while it fits), so at most one slice plus ``2 * disk_io_bytes``.
            Default 0: one slice at a time, each written before the next is read.
        param_init_fn: disk tier only, for a model on ``meta``: called on each slice
            (an ``nn.Sequential``) once its parameters are allocated, to initialise
            them in place; default: ``reset_parameters()`` of every submodule having one.
        process_group: average gradients over this group after each slice's backward
            (data-parallel OffloadModel: every rank holds the whole model offloaded);
            default None: no averaging (single process, and no cross-rank check). With a
            group, construction is a collective that checks every rank has the same
            parameters and slicing options (one small all-gather).

    Raises:
        TypeError: if ``model`` is not an ``nn.Sequential`` or a list of modules, or a
            parameter has an integer, bool or complex dtype, or ``num_slices`` is not an int.
        ValueError: if ``model`` is (or contains) an OffloadModel already; for
            ``num_slices`` out of range (``BalanceError``), ``num_microbatches < 1``,
            ``disk_io_bytes`` not an int >= 0 or given off the disk tier, an
            unwritable or mismatching ``offload_dir``, or a ``meta`` model off the disk tier.
        ConsistencyError: with ``process_group``, the ranks' models or options differ;
            ``PeerRejectedError`` (a subclass) if another rank refused its parameters.

    Warning:
        Buffers (BatchNorm statistics) and shared parameters are not offloaded. With
        the disk tier, ``model.parameters()`` hold empty placeholders between uses:
        step with :meth:`sliced_optimizer` (a torch optimizer given them raises
        ``shardkit.distributed.optim_guard.ReplacedParameterError``, naming the
        parameter) and read values with :meth:`state_dict`. ``retain_graph=True`` is not supported.
    """

    def __init__(
        self,
        model: nn.Sequential | Sequence[nn.Module],
        device: torch.device | str,
        offload_device: OffloadTarget = _CPU,
        num_slices: int = 3,
        checkpoint_activation: bool = False,
        num_microbatches: int = 1,
        *,
        offload_dir: str | os.PathLike[str] | None = None,
        resume: bool = False,
        disk_io_bytes: int = 0,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        check_not_wrapped("OffloadModel", model, OffloadModel)
        problem = parameter_problem("OffloadModel", _named_parameters(model), allow_meta=True)
        if process_group is not None:  # data parallel: every rank must hold the same model
            options = {"num_slices": num_slices, "num_microbatches": num_microbatches}
            verify_consistent(
                describe_parameters(_named_parameters(model)),
                what="OffloadModel",
                group=process_group,
                options={**options, "checkpoint_activation": checkpoint_activation},
                local_error=problem,  # a bad parameter on one rank stops every rank
            )
        if problem is not None:
            raise problem
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1; got {num_microbatches}")
        self.device = torch.device(device)
        self.checkpoint_activation = checkpoint_activation
        self.num_microbatches = num_microbatches
        self.model_slices = nn.ModuleList(_split(model, num_slices))
        self.num_slices = len(self.model_slices)
        check_byte_count("disk_io_bytes", disk_io_bytes)
        self.tier = _make_tier(self.device, offload_device, offload_dir, resume, disk_io_bytes)
        self.slices = self._build_slices()
        self._materialize_meta(param_init_fn)
        self._attach()
        hook = self._average_hook(process_group)
        self.runners = [
            SliceRunner(s, self.tier, checkpoint_activation, hook)
            for s in self.slices
            if not s.pinned
        ]
        for i, runner in enumerate(self.runners):  # two ahead, nearest first
            runner.forward_ahead = [r.slice for r in self.runners[i + 1 : i + 3]]
            runner.backward_ahead = [r.slice for r in self.runners[max(i - 2, 0) : i][::-1]]
        self._dummy = torch.empty(0, requires_grad=True)

    # -- construction ------------------------------------------------------------------

    def _build_slices(self) -> list[Slice]:
        shared_ids = shared_parameter_ids(list(self.model_slices))
        named = dict(self.named_parameters())
        names = {id(p): n for n, p in named.items()}
        shared = [(names[i], p) for i, p in ((id(p), p) for p in named.values()) if i in shared_ids]
        slices = []
        if shared:
            slices.append(Slice("shared", None, shared, SliceLayout.of(shared), pinned=True))
        for i, module in enumerate(self.model_slices):
            own = [(names[id(p)], p) for p in module.parameters() if id(p) not in shared_ids]
            slices.append(Slice(f"slice{i}", module, own, SliceLayout.of(own)))
        return slices

    def _materialize_meta(self, param_init_fn: Callable[[nn.Module], None] | None) -> None:
        """Swap ``meta`` parameters for placeholders the disk tier fills slice by slice."""
        if not any(p.is_meta for p in self.parameters()):
            return
        if not isinstance(self.tier, DiskTier):
            raise ValueError(
                "the model has parameters on the meta device; only the disk tier can "
                "materialise them slice by slice (offload_dir=...): build the model on a "
                "real device for the memory tiers"
            )
        self._init_fn = param_init_fn or _reset_parameters
        for s in self.slices:
            shape = None if s.pinned else (0,)  # pinned: allocated on device, filled by init
            s.params = [
                (name, _replace_parameter(self, p, shape, self.device)) for name, p in s.params
            ]

    def _attach(self) -> None:
        for b in self.buffers():
            b.data = b.data.to(self.device)
        if isinstance(self.tier, DiskTier):
            init = getattr(self, "_init_fn", None)
            self.tier.attach_model(self.slices, dict(self.named_buffers()), init)
            for name, p in self.named_parameters():
                mark_replaced(p, name=f"`{name}`", wrapper=_DISK_WRAPPER, fix=_DISK_FIX)
        else:
            self.tier.attach(self.slices)

    def _average_hook(self, group: dist.ProcessGroup | None) -> Callable[[Slice], None] | None:
        if group is None:
            return None
        average = average_gradients(group)
        shared = [s for s in self.slices if s.pinned]
        first = next(s for s in self.slices if not s.pinned)

        def hook(s: Slice) -> None:
            average(s)
            if s is first:  # the last slice to run backward: shared gradients are complete
                for group_slice in shared:
                    average(group_slice)

        return hook

    # -- running -----------------------------------------------------------------------

    def forward(self, *inputs: torch.Tensor, **_: Any) -> torch.Tensor:
        """Run the slices in order on ``inputs[0]`` (shape ``(batch, ...)``); output on ``device``."""
        x = inputs[0].to(self.device)
        chunks = list(x.tensor_split(min(self.num_microbatches, max(1, x.shape[0]))))
        if not torch.is_grad_enabled():
            for runner in self.runners:
                chunks = runner.run_no_grad(chunks)
        else:
            for runner in self.runners:
                chunks = list(SliceFunction.apply(runner, self._dummy, *chunks))
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def sliced_optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], **defaults: Any
    ) -> SlicedOptimizer:
        """An optimizer that steps the disk tier slice by slice (state in per-slice files).

        Args:
            optimizer_class: any ``torch.optim.Optimizer`` whose state is per parameter
                (SGD, Adam, AdamW, RMSprop, ...).
            **defaults: its hyperparameters (``lr=...``); editable later through
                ``param_groups[0]``.

        Raises:
            ValueError: if this model is not on the disk tier, or the directory was
                written with another optimizer class.
        """
        if not isinstance(self.tier, DiskTier):
            raise ValueError(
                f"sliced_optimizer is for the disk tier; this model uses the {self.tier.kind} "
                "tier: use any torch optimizer over model.parameters()"
            )
        return SlicedOptimizer(self.tier, optimizer_class, defaults)

    # -- state -------------------------------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """The model's state dict; the disk tier loads one slice at a time and copies it
        out (with ``keep_vars=True``: the parameters themselves, empty placeholders
        between uses on the disk tier)."""
        if not isinstance(self.tier, DiskTier) or kwargs.get("keep_vars"):
            return super().state_dict(*args, **kwargs)
        out: dict[str, torch.Tensor] = dict(self.tier.buffers)
        for s in self.slices:
            with self._resident(s):
                out.update((name, p.detach().clone()) for name, p in s.params)
        return out

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a state dict (memory tiers; for the disk tier, reopen the directory)."""
        if isinstance(self.tier, DiskTier):
            raise ValueError(
                "the disk tier keeps its state in offload_dir: reopen it with resume=True"
            )
        return super().load_state_dict(state_dict, strict, assign)

    def _resident(self, s: Slice) -> _Resident:
        return _Resident(self.tier, s)

    @property
    def balance(self) -> list[int]:
        """Number of layers in each slice."""
        return [len(m) for m in self.model_slices]  # type: ignore[arg-type]

    def named_slices(self) -> Iterator[tuple[str, Slice]]:
        """``(name, slice)`` pairs, the pinned ``shared`` group first if any."""
        return ((s.name, s) for s in self.slices)


class _Resident:
    """Context manager: a slice resident for the body (no-op for a resident or pinned slice)."""

    def __init__(self, tier: Tier, s: Slice) -> None:
        self.tier, self.slice, self.loaded = tier, s, False

    def __enter__(self) -> Slice:
        if not self.slice.pinned and self.slice.state is SliceState.OFFLOADED:
            self.tier.load(self.slice)
            self.loaded = True
        return self.slice

    def __exit__(self, *exc: object) -> None:
        if self.loaded:
            self.tier.offload(self.slice)


def _reset_parameters(module: nn.Module) -> None:
    for m in module.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()


def _replace_parameter(
    root: nn.Module, old: nn.Parameter, shape: tuple[int, ...] | None, device: torch.device
) -> nn.Parameter:
    """Put a new parameter (``shape``, default ``old``'s, on ``device``) everywhere ``old`` is."""
    data = torch.empty(old.shape if shape is None else shape, dtype=old.dtype, device=device)
    new = nn.Parameter(data, requires_grad=old.requires_grad)
    for module in root.modules():
        for key, p in module._parameters.items():
            if p is old:
                module._parameters[key] = new
    return new
