"""Counting the bytes of the torch.distributed collectives a rank issues.

[Note: how counting works]
:func:`install` replaces the tensor collectives of ``torch.distributed`` (both the
``torch.distributed`` namespace and ``torch.distributed.distributed_c10d``, where
torch's own wrappers look them up) by wrappers that, while a :class:`CommCounter` is
counting, record for every call its kind, its payload bytes and its group's size,
then call the original. Only the outermost call counts: ``all_gather_into_tensor``
calling ``all_gather_single`` is one all-gather. Object collectives
(``all_gather_object`` ...) are counted through the tensor collectives they issue.

Payload (``payload_bytes``) is the size of the collective's data, in bytes, as the
caller passes it: an all-reduce of N fp32 elements is 4N bytes; an all-gather or a
reduce-scatter counts the full (gathered / unscattered) tensor; broadcast and reduce
the tensor; send counts what this rank sends; recv counts what it receives (in
``received_bytes``, not in what it sent).

Volume (``volume_bytes``) is what each rank sends under the bandwidth-optimal ring
algorithms that the ZeRO paper's analysis assumes (Rajbhandari et al. 2020, section
7): ``2 (N - 1) / N`` of the payload for an all-reduce (reduce-scatter + all-gather),
``(N - 1) / N`` for all-gather, reduce-scatter, broadcast, reduce, scatter, gather
and all-to-all, the payload for a send. Summed over a step it is the quantity the
paper's "2 psi for DDP and ZeRO-1/2, 3 psi for ZeRO-3" (in elements, times bytes per
element, times ``(N - 1) / N``) predicts: :func:`theory_volume_bytes`.

torch DDP's C++ reducer calls the process group directly, past these Python
functions: :func:`count_ddp` registers a comm hook on a DDP module that does what
DDP's built-in all-reduce does (divide by N, all-reduce, in the same buckets) through
``torch.distributed.all_reduce``, so that it is counted.

DeepSpeed's communication backend takes ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` from ``torch.distributed`` when it is created (its first
``deepspeed.initialize`` in a process): :func:`install` must run before that, as
:func:`benchmarks.compare.run_config` does, or its ZeRO-3 gathers go uncounted.

What it misses: collectives issued from C++ other than DDP's reducer (none in the
benchmarked strategies on CPU), ``torch.distributed._functional_collectives`` (DTensor
redistribution; FSDP2 does not use it in forward / backward), and anything below the
process group: gloo's actual algorithm (its bytes on the wire differ from the ring
model), headers, and the barriers and small all-reduces the harness itself issues
(those run outside :meth:`CommCounter.counting`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo  # before install(): see [Note: dynamo before the wrappers]
import torch.distributed as dist
from torch import nn

__all__ = [
    "COUNTED",
    "CommCounter",
    "count_ddp",
    "counter",
    "install",
    "theory_volume_bytes",
    "uninstall",
]

# function name -> (kind, argument holding the payload, payload multiplier "N" or 1)
COUNTED: dict[str, tuple[str, str, str]] = {
    "all_reduce": ("all_reduce", "tensor", "1"),
    "all_reduce_coalesced": ("all_reduce", "tensors", "1"),
    "broadcast": ("broadcast", "tensor", "1"),
    "reduce": ("reduce", "tensor", "1"),
    "all_gather": ("all_gather", "tensor_list", "1"),
    "all_gather_single": ("all_gather", "output_tensor", "1"),
    "all_gather_into_tensor": ("all_gather", "output_tensor", "1"),
    "_all_gather_base": ("all_gather", "output_tensor", "1"),
    "all_gather_coalesced": ("all_gather", "output_tensor_lists", "1"),
    "reduce_scatter": ("reduce_scatter", "input_list", "1"),
    "reduce_scatter_single": ("reduce_scatter", "input", "1"),
    "reduce_scatter_tensor": ("reduce_scatter", "input", "1"),
    "_reduce_scatter_base": ("reduce_scatter", "input", "1"),
    "all_to_all": ("all_to_all", "input_tensor_list", "1"),
    "all_to_all_single": ("all_to_all", "input", "1"),
    "gather": ("gather", "tensor", "N"),
    "scatter": ("scatter", "tensor", "N"),
    "send": ("send", "tensor", "1"),
    "isend": ("send", "tensor", "1"),
    "recv": ("recv", "tensor", "1"),
    "irecv": ("recv", "tensor", "1"),
    "batch_isend_irecv": ("p2p", "p2p_op_list", "1"),
    "barrier": ("barrier", "", "1"),
}


def _ring_factor(kind: str, n: int) -> float:
    """Bytes each rank sends per payload byte under the ring algorithms (see the note)."""
    if kind in ("send",):
        return 1.0
    if kind in ("recv", "barrier"):
        return 0.0
    share = (n - 1) / n if n > 0 else 0.0
    return 2.0 * share if kind == "all_reduce" else share


def _nbytes(value: Any) -> int:
    """Bytes of a tensor or a (nested) list of tensors."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


@dataclass
class CommCounter:
    """Per-kind totals of the collectives this rank issued while counting.

    Attributes:
        calls: number of calls per kind (``all_reduce``, ``all_gather``, ...).
        payload_bytes: payload bytes per kind (see the module note); recv excluded.
        received_bytes: bytes received by ``recv`` / ``irecv``.
        volume_bytes: ring-algorithm bytes sent per kind (see the module note).
        active: whether calls are counted now.
    """

    calls: dict[str, int] = field(default_factory=dict)
    payload_bytes: dict[str, int] = field(default_factory=dict)
    received_bytes: int = 0
    volume_bytes: dict[str, float] = field(default_factory=dict)
    active: bool = False
    _depth: int = 0

    def reset(self) -> None:
        """Zero every total."""
        self.calls, self.payload_bytes, self.volume_bytes = {}, {}, {}
        self.received_bytes = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[CommCounter]:
        """Count the collectives issued inside the ``with`` block (totals accumulate)."""
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def record(self, kind: str, payload: int, group_size: int) -> None:
        """Add one call of ``kind`` with ``payload`` bytes in a group of ``group_size``."""
        self.calls[kind] = self.calls.get(kind, 0) + 1
        if kind == "recv":
            self.received_bytes += payload
            return
        self.payload_bytes[kind] = self.payload_bytes.get(kind, 0) + payload
        volume = payload * _ring_factor(kind, group_size)
        self.volume_bytes[kind] = self.volume_bytes.get(kind, 0.0) + volume

    def total_volume_bytes(self) -> float:
        """Ring-algorithm bytes sent, all kinds together."""
        return sum(self.volume_bytes.values())

    def snapshot(self) -> dict[str, Any]:
        """The totals as a plain dict (JSON)."""
        return {
            "calls": dict(self.calls),
            "payload_bytes": dict(self.payload_bytes),
            "received_bytes": self.received_bytes,
            "volume_bytes": dict(self.volume_bytes),
            "total_volume_bytes": self.total_volume_bytes(),
        }


counter = CommCounter()
"""The counter of this process, fed by the wrappers :func:`install` puts in place."""

_ORIGINALS: dict[str, Callable[..., Any]] = {}


def _group_size(bound: inspect.BoundArguments) -> int:
    group = bound.arguments.get("group")
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _p2p_record(ops: list[Any]) -> None:
    for op in ops:
        kind = "send" if getattr(op.op, "__name__", "") == "isend" else "recv"
        counter.record(kind, _nbytes(op.tensor), 2)


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    kind, arg, mult = COUNTED[name]
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not counter.active or counter._depth > 0:
            return original(*args, **kwargs)
        counter._depth += 1
        try:
            bound = signature.bind(*args, **kwargs)
            if kind == "p2p":
                _p2p_record(bound.arguments[arg])
            else:
                n = _group_size(bound)
                payload = _nbytes(bound.arguments.get(arg)) * (n if mult == "N" else 1)
                counter.record(kind, payload, n)
            return original(*args, **kwargs)
        finally:
            counter._depth -= 1

    wrapper.__shardkit_counted__ = True  # type: ignore[attr-defined]
    return wrapper


def install() -> CommCounter:
    """Put counting wrappers in place of the collectives (idempotent); the counter.

    [Note: dynamo before the wrappers]
    ``torch._dynamo`` builds its tables of the collectives it traces when it is first
    imported (torch DDP's constructor imports it); imported while the wrappers are in
    place, it keeps the wrappers as the collectives it knows, and every later
    ``torch.compile`` in the process (after :func:`uninstall`) no longer recognises
    ``torch.distributed.all_reduce`` inside a block and compiles 11 graphs where 1 is
    right (tests/compile after tests/benchmarks/test_comm.py in one rank pool). This
    module therefore imports ``torch._dynamo`` before anything can be wrapped.
    """
    from torch.distributed import distributed_c10d

    for name in COUNTED:
        original = getattr(distributed_c10d, name, None)
        if original is None or getattr(original, "__shardkit_counted__", False):
            continue
        _ORIGINALS[name] = original
        wrapped = _wrap(name, original)
        setattr(distributed_c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)
    return counter


def uninstall() -> None:
    """Put the original collectives back."""
    from torch.distributed import distributed_c10d

    for name, original in _ORIGINALS.items():
        setattr(distributed_c10d, name, original)
        if getattr(getattr(dist, name, None), "__shardkit_counted__", False):
            setattr(dist, name, original)
    _ORIGINALS.clear()


def _counted_allreduce_hook(
    group: dist.ProcessGroup | None, bucket: Any
) -> torch.futures.Future[torch.Tensor]:
    """DDP's built-in reduction (divide by N, all-reduce the bucket) through the
    Python ``all_reduce``, so that :func:`install`'s wrapper sees it."""
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size(group))
    work = dist.all_reduce(tensor, group=group, async_op=True)
    assert work is not None
    future: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda fut: fut.value()[0])
    return future


# DDP checks the hook's annotations as objects; postponed (string) annotations fail it.
_counted_allreduce_hook.__annotations__ = {
    "group": dist.ProcessGroup | None,
    "bucket": getattr(dist, "GradBucket"),  # noqa: B009 (not in torch's type stubs)
    "return": torch.futures.Future[torch.Tensor],
}


def count_ddp(module: nn.Module) -> None:
    """Register the counted all-reduce comm hook on every torch DDP module in ``module``
    (before its first backward); other modules are left alone, and so is a DDP that has
    a Python comm hook already (its collectives go through ``torch.distributed``'s
    Python functions, so they are counted as they are: e.g. shardkit's
    ``reduce_to_owner_hook``)."""
    for m in module.modules():
        if isinstance(m, nn.parallel.DistributedDataParallel) and not m._comm_hooks:
            m.register_comm_hook(m.process_group, _counted_allreduce_hook)


def theory_volume_bytes(
    num_params: int, world_size: int, stage: int, bytes_per_element: int = 4
) -> float:
    """Bytes each rank sends per step under ZeRO stage ``stage`` (Rajbhandari et al.
    2020, section 7): ``c psi (N - 1) / N`` elements times ``bytes_per_element``, with
    c = 2 for stages 0 (DDP), 1 and 2 (a reduce-scatter and an all-gather of psi) and
    c = 3 for stage 3 (parameters all-gathered in forward and in backward, gradients
    reduce-scattered).

    Raises:
        ValueError: for a stage outside 0-3 or ``world_size`` < 1.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3 (ZeRO stages); got {stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    c = 3 if stage == 3 else 2
    return c * num_params * bytes_per_element * (world_size - 1) / world_size
