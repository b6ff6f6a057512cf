"""Wrap-time checks of the parameters and modules a wrapper is given.

Sharded wrappers pack parameters into flat floating-point buffers, reduce gradients
and step optimizers; each needs floating-point parameters that hold real memory. A
parameter that breaks this (an integer or complex dtype, one on the meta device) fails
much later otherwise, inside a collective or an optimizer, with a message that does
not name the parameter. :func:`check_parameters` names the first such parameter, its
dtype or device, why it cannot be wrapped and the fix.

Wrappers that keep every parameter whole on every rank and only reduce and step the
trainable ones (OSS, ShardedDataParallel: ``allow_frozen_integer=True``) accept a frozen
integer or bool parameter (``requires_grad=False``; torch refuses ``requires_grad=True``
on those dtypes), as torch's DistributedDataParallel and FairScale do: it is never packed
into a gradient bucket nor stepped, only broadcast like a buffer. Wrappers that flatten
every parameter into one floating-point buffer (FSDP) still refuse it. :func:`check_not_wrapped`
refuses a module that is already (or contains) the same wrapper.

A parameter that is one *part* of a split tensor (its shard descriptor records a split
over the global ranks ``split_group``: a tensor-parallel part, an MoE layer's block of
experts) may only be reduced or broadcast over ranks that hold the *same* part. A
data-parallel group holding several parts of it (experts split over ``ep`` inside the
``dp`` group) would average different experts' gradients as if they were copies, or
broadcast one rank's experts over the others: training goes on, silently wrong. Given
the group's ranks (``reduce_ranks``), :func:`parameter_problem` refuses such a
parameter, naming the ranks and the fix.

No collective: every rank checks its own parameters (the cross-rank agreement is
:func:`shardkit.distributed.consistency.verify_consistent`). A distributed wrapper
takes the error from :func:`parameter_problem` instead of raising it, and passes it to
``verify_consistent(..., local_error=...)``, so that a bad parameter on one rank stops
every rank at once (see the note there).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
from torch import nn

from shardkit.distributed.shard_descriptor import Split, view_of

__all__ = ["check_not_wrapped", "check_parameters", "parameter_problem"]


def _dtype_problem(
    name: str, param: torch.Tensor, wrapper: str, allow_frozen_integer: bool = False
) -> str | None:
    dtype = param.dtype
    if dtype.is_complex:
        return (
            f"{wrapper}: parameter `{name}` (shape {tuple(param.shape)}) has the complex dtype "
            f"{dtype}; shardkit packs, reduces and shards real floating-point tensors only. "
            "Store it as a real parameter with a trailing dimension of 2 and view it as "
            "complex in forward: nn.Parameter(torch.view_as_real(w)), then "
            "torch.view_as_complex(self.w)"
        )
    if not dtype.is_floating_point:
        if allow_frozen_integer and not param.requires_grad:
            return None  # never reduced nor stepped: broadcast like a buffer
        return (
            f"{wrapper}: parameter `{name}` (shape {tuple(param.shape)}) has the dtype {dtype}; "
            "optimizers and gradient reductions need floating-point parameters (an integer "
            "or bool tensor has no gradient). Register it as a buffer "
            "(module.register_buffer(name, tensor)) or convert it with .float()"
        )
    return None


def _meta_problem(name: str, param: torch.Tensor, wrapper: str) -> str:
    return (
        f"{wrapper}: parameter `{name}` (shape {tuple(param.shape)}) is on the meta device: "
        "it has no storage to shard, reduce or step. Materialise the module before "
        "wrapping: module.to_empty(device=...) then initialise it (module.apply(init_fn), "
        "reset_parameters() or load_state_dict(...))"
    )


def _mixed_parts_problem(
    name: str, param: torch.Tensor, wrapper: str, reduce_ranks: Collection[int]
) -> str | None:
    for split in view_of(param).splits:  # each mesh dimension the tensor is split over
        if split.group is None:
            continue
        inside = sorted(set(split.group) & set(reduce_ranks))
        if len(inside) > 1:
            return _mixed_parts_message(name, param, wrapper, reduce_ranks, split, inside)
    return None


def _mixed_parts_message(
    name: str,
    param: torch.Tensor,
    wrapper: str,
    reduce_ranks: Collection[int],
    split: Split,
    inside: list[int],
) -> str:
    over = repr(split.mesh_dim) if split.mesh_dim is not None else "a mesh dimension"
    group = list(split.group or ())
    return (
        f"{wrapper}: parameter `{name}` (shape {tuple(param.shape)}) is part {split.part} of "
        f"{split.parts} of a tensor split over {over} across ranks {group}, "
        f"and the {wrapper} process group (ranks {sorted(reduce_ranks)}) holds {len(inside)} "
        f"of its parts (ranks {inside}): it would average or broadcast different parts as "
        "if they were copies (silently wrong training). Leave such parameters out of it "
        "and reduce them over the ranks holding the same part: for MoE experts "
        "shardkit.nn.moe.ignore_experts_in_ddp before torch DDP, then "
        "shardkit.nn.moe.all_reduce_expert_gradients(model, mesh.group('edp')), or an "
        "FSDP unit / optimizer of their own over mesh.group('edp')"
    )


def parameter_problem(
    wrapper: str,
    named_params: Iterable[tuple[str, torch.Tensor]],
    *,
    allow_meta: bool = False,
    allow_frozen_integer: bool = False,
    reduce_ranks: Collection[int] | None = None,
) -> TypeError | ValueError | None:
    """The error :func:`check_parameters` would raise, returned instead (None: all fine).

    For wrappers that hand it to
    :func:`shardkit.distributed.consistency.verify_consistent` as ``local_error``.

    Args:
        reduce_ranks: the global ranks the wrapper reduces or broadcasts the parameters
            over; given, a parameter holding one part of a split tensor whose other
            parts also lie in these ranks is refused (see the module docstring).
            Default None: not checked.
    """
    for name, param in named_params:
        problem = _dtype_problem(name, param, wrapper, allow_frozen_integer)
        if problem is not None:
            return TypeError(problem)
        if param.is_meta and not allow_meta:
            return ValueError(_meta_problem(name, param, wrapper))
        if reduce_ranks is not None:
            mixed = _mixed_parts_problem(name, param, wrapper, reduce_ranks)
            if mixed is not None:
                return ValueError(mixed)
    return None


def check_parameters(
    wrapper: str,
    named_params: Iterable[tuple[str, torch.Tensor]],
    *,
    allow_meta: bool = False,
    allow_frozen_integer: bool = False,
) -> None:
    """Refuse parameters a sharded wrapper cannot hold, naming the first one and the fix.

    Args:
        wrapper: the caller, for the message (e.g. ``"OSS"``).
        named_params: ``(name, parameter)`` pairs, e.g. ``module.named_parameters()``.
        allow_meta: accept parameters on the meta device (a wrapper that materialises
            them itself, such as OffloadModel's disk tier). Default False.
        allow_frozen_integer: accept integer and bool parameters with
            ``requires_grad=False`` (a wrapper that reduces and steps only trainable
            parameters and keeps every parameter whole: OSS, ShardedDataParallel).
            Default False.

    Raises:
        TypeError: a parameter has a complex dtype, or an integer or bool dtype unless
            ``allow_frozen_integer`` (the message says why and how to store it instead).
        ValueError: a parameter is on the meta device and ``allow_meta`` is False (the
            message gives ``module.to_empty(device=...)`` and an initialisation).
    """
    problem = parameter_problem(
        wrapper, named_params, allow_meta=allow_meta, allow_frozen_integer=allow_frozen_integer
    )
    if problem is not None:
        raise problem


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'AEIOU' else 'a'} {noun}"


def check_not_wrapped(wrapper: str, module: object, wrapper_type: type) -> None:
    """Refuse ``module`` when it is, or contains, a ``wrapper_type`` instance already.

    Args:
        wrapper: the caller's name, for the message.
        module: what the user passed to the wrapper (a module or a list of modules).
        wrapper_type: the wrapper's class.

    Raises:
        ValueError: naming where the existing wrapper sits, and the fix.
    """
    if isinstance(module, wrapper_type):
        raise ValueError(
            f"the module given to {wrapper} is already {_a(wrapper_type.__name__)}: wrap "
            f"each module once (pass the inner module, `wrapped.module`, to re-wrap)"
        )
    roots = module if isinstance(module, (list, tuple)) else [module]
    for index, root in enumerate(roots):
        if not isinstance(root, nn.Module):
            continue
        for name, sub in root.named_modules():
            if isinstance(sub, wrapper_type):
                where = name
                if isinstance(module, (list, tuple)):
                    where = f"[{index}].{name}" if name else f"[{index}]"
                raise ValueError(
                    f"the module given to {wrapper} contains {_a(wrapper_type.__name__)} at "
                    f"`{where}`: a wrapper inside the same wrapper would shard twice; wrap "
                    "each module once"
                )
