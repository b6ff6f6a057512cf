"""Materialise one pipeline stage of a GPT built on the meta device, as the plain GPT would be.

``--strategy pipe`` builds the GPT under ``torch.device("meta")`` (no storage) and
allocates only this rank's stage, so a rank's peak memory holds its stage, not the whole
model. The stage's values must still equal the plain model's at the same seed (the
pipeline's losses are compared with DDP's), and the random number generator must end in
the same state (dropout and later draws):

[Note: replaying the GPT's initialisation]
``GPT(config)`` draws from the CPU generator twice per layer: each ``nn.Linear`` /
``nn.Embedding`` constructor initialises itself (``reset_parameters``, in construction
order, which is ``model.modules()`` order for the GPT), then ``GPT._init_weights`` draws
every Linear / Embedding weight again (``model.apply`` order: children first). A draw
consumes the generator by the tensor's element count only, so :func:`materialize_stage`
replays both passes on CPU scratch tensors of the same shapes and copies the values of the
layers this stage holds (peak extra memory: one layer; the CUDA generator is not used). The tied
embedding / LM-head weight is found by identity, so the stage holding either copy gets
the last draw, as the plain model's one shared tensor does.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from shardkit.models import GPT

__all__ = ["materialize_stage"]


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``(qualified name prefix, module)`` in ``nn.Module.apply`` order (children first)."""
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}{name}.")
    yield prefix, module


def _replay_constructors(model: GPT) -> None:
    """Pass 1: every layer's ``reset_parameters`` on a CPU scratch copy (the generator
    advances as in construction); layers held by this stage take the copy's values."""
    with torch.no_grad():
        for module in model.modules():
            own = dict(module.named_parameters(recurse=False))
            if not own or not hasattr(module, "reset_parameters"):
                continue
            scratch = copy.deepcopy(module).to_empty(device="cpu")
            cast(Any, scratch).reset_parameters()  # mypy: Module attributes are Tensor | Module
            for name, value in scratch.named_parameters(recurse=False):
                if not own[name].is_meta:
                    own[name].copy_(value)


def _replay_init_weights(model: GPT, real: dict[int, torch.Tensor], ident: dict[str, int]) -> None:
    """Pass 2: ``GPT._init_weights`` in ``apply`` order, drawn on the CPU and copied into
    this stage's tensors (found by the meta parameter's identity, so a tied copy is)."""
    with torch.no_grad():
        for prefix, module in _post_order(model):
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                continue
            draw = nn.init.normal_(torch.empty(module.weight.shape), mean=0.0, std=0.02)
            weight = real.get(ident[f"{prefix}weight"])
            if weight is not None:
                weight.copy_(draw)
            bias = real.get(ident.get(f"{prefix}bias", -1))
            if bias is not None:
                nn.init.zeros_(bias)


def _retie(model: GPT, ident: dict[str, int]) -> dict[int, torch.Tensor]:
    """``to_empty`` gives each module its own new tensor: make the names that shared a
    parameter on meta share the first real one again; the real tensors by identity."""
    real: dict[int, nn.Parameter] = {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if param.is_meta:
            continue
        first = real.setdefault(ident[name], param)
        if first is not param:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, first)
    return {key: p.data for key, p in real.items()}


def materialize_stage(model: GPT, stage: nn.Module, device: torch.device) -> None:
    """Allocate ``stage`` (a sub-module of the meta ``model``) on ``device`` and
    initialise it as ``GPT(config)`` would at the current seed (see the note).

    Args:
        model: the GPT built under ``torch.device("meta")``; ``stage`` shares its layers.
        stage: this rank's stage module (e.g. from ``stage_module(gpt_stages(model), ...)``).
        device: where the stage's tensors go.

    Afterwards ``stage``'s tensors (and the same layers inside ``model``) are real, the
    other layers of ``model`` stay on meta, and the CPU generator is where it would be
    after ``GPT(config)``.
    """
    ident = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    stage.to_empty(device=device)
    real = _retie(model, ident)
    _replay_constructors(model)
    _replay_init_weights(model, real, ident)
