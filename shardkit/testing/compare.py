"""Compare tensors, state dicts and models: against a reference, or across ranks.

Every helper raises ``AssertionError`` with a message naming the first differing
tensor, its shape and the maximum absolute difference, so a failing parity test says
where training diverged, not only that it did.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

__all__ = [
    "assert_same_across_ranks",
    "assert_state_dicts_close",
    "assert_tensors_close",
    "max_abs_diff",
]

StateLike = torch.nn.Module | Mapping[str, torch.Tensor]


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest ``|a - b|`` over all elements, computed in float64 (0.0 for empty)."""
    if a.numel() == 0:
        return 0.0
    return float((a.detach().double() - b.detach().double()).abs().max())


def assert_tensors_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    name: str = "tensor",
) -> None:
    """Assert same shape and ``|actual - expected| <= atol + rtol * |expected|`` everywhere.

    Raises:
        AssertionError: naming ``name``, the shapes or the max absolute difference.
    """
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    if not torch.allclose(a, e, atol=atol, rtol=rtol, equal_nan=True):
        raise AssertionError(
            f"{name}: max |diff| {max_abs_diff(a, e):.3e} exceeds atol={atol:g}, rtol={rtol:g} "
            f"(shape {tuple(actual.shape)})"
        )


def _as_state(obj: StateLike) -> Mapping[str, torch.Tensor]:
    return obj.state_dict() if isinstance(obj, torch.nn.Module) else obj


def assert_state_dicts_close(
    actual: StateLike,
    expected: StateLike,
    *,
    atol: float = 1e-5,
    rtol: float = 1e-5,
) -> None:
    """Assert two state dicts (or modules' state dicts) have the same keys and close tensors.

    Raises:
        AssertionError: naming missing/unexpected keys or the first differing tensor.
    """
    a, e = _as_state(actual), _as_state(expected)
    missing, unexpected = sorted(set(e) - set(a)), sorted(set(a) - set(e))
    if missing or unexpected:
        raise AssertionError(f"state dict keys differ: missing {missing}, unexpected {unexpected}")
    for key in e:
        if isinstance(e[key], torch.Tensor):
            assert_tensors_close(a[key], e[key], atol=atol, rtol=rtol, name=key)
        elif a[key] != e[key]:
            raise AssertionError(f"{key}: {a[key]!r} != expected {e[key]!r}")


def assert_same_across_ranks(
    obj: StateLike,
    *,
    group: dist.ProcessGroup | None = None,
    atol: float = 0.0,
) -> None:
    """Assert every rank of ``group`` holds the same tensors as the group's first rank.

    A collective: every rank of ``group`` must call it with the same keys and shapes.
    Each tensor is broadcast from the group's first rank and compared locally; every
    rank then learns whether any rank differed.

    Raises:
        AssertionError: on every rank, naming the first differing tensor, the ranks
            that differ and the max absolute difference.
    """
    state = _as_state(obj)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    world = dist.get_world_size(group)
    for key, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        reference = tensor.detach().clone()
        dist.broadcast(reference, src=src, group=group)
        diff = torch.tensor([max_abs_diff(tensor, reference)], dtype=torch.float64)
        diffs = [torch.zeros_like(diff) for _ in range(world)]
        dist.all_gather(diffs, diff, group=group)
        bad = [r for r, d in enumerate(diffs) if float(d) > atol]
        if bad:
            worst = max(float(d) for d in diffs)
            raise AssertionError(
                f"{key}: group ranks {bad} differ from rank {src} "
                f"(max |diff| {worst:.3e} > atol={atol:g})"
            )
