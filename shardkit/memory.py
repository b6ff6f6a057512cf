"""Accounting of the model-state bytes each rank holds, and the ZeRO formulas.

Two views of the same quantity:

- :func:`model_state_bytes` *measures* what a module and its optimizer hold on this
  rank right now (parameters, gradients, optimizer state, buffers), counting each
  underlying storage once: views and tied weights are not double counted, and a
  view is charged for its whole storage (what the allocator actually holds).
- :func:`zero_memory_estimate` *predicts* the per-rank model-state bytes of the ZeRO
  stages from the paper (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
  Toward Training Trillion Parameter Models", section 5.1 and figure 1).

Besides the model state, :func:`buffer_pools` reports the reused working buffers
(FSDP's full parameter and gradient buffers of its units): how many exist, how many
hold memory now and at most since :func:`reset_buffer_peaks`, and their bytes.
:func:`trim_heap` returns the free pages of the C heap to the operating system (glibc's
``malloc_trim``); FSDP on CPU does so at the points :func:`set_heap_trim` chooses (by
default after the root's forward, one training forward in 8; ``"unit"``: after every
unit's reshard). :func:`heap_trims` counts the calls and the time they took.

[Note: why storages, not tensors]
``p.numel() * p.element_size()`` over-counts tied weights (an LM head sharing the
token embedding) and under-counts views into a larger flat buffer (a sharded flat
parameter exposes views; the buffer behind them is what occupies memory). Keying
by ``(storage data pointer, storage bytes)`` gives the allocator's view.

Why this module is long: ``shardkit.memory`` is the one public module users import every
accounting from (model-state bytes, the ZeRO estimate, buffer pools, heap trimming, the
``python -m shardkit.memory`` command); each part is about 100 lines and independent, so
the next one added splits it into a package that keeps these names.
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "HEAP_TRIM_MODES",
    "STEP_TRIM_EVERY",
    "BufferAccount",
    "BufferPoolStats",
    "HeapTrimStats",
    "ModelStateBytes",
    "ZeroMemoryEstimate",
    "buffer_account",
    "buffer_pools",
    "heap_trim_point",
    "heap_trims",
    "model_state_bytes",
    "reset_buffer_peaks",
    "set_heap_trim",
    "trim_heap",
    "zero_memory_estimate",
]


@dataclass(frozen=True)
class ModelStateBytes:
    """Model-state bytes held by one rank, by category (all values in bytes).

    Attributes:
        parameters: storages behind ``module.parameters()``.
        gradients: storages behind the parameters' ``.grad`` not already counted.
        optimizer_state: storages of tensors in ``optimizer.state`` not already counted.
        buffers: storages behind ``module.buffers()`` not already counted.
    """

    parameters: int
    gradients: int
    optimizer_state: int
    buffers: int

    @property
    def total(self) -> int:
        """Sum of all categories, in bytes."""
        return self.parameters + self.gradients + self.optimizer_state + self.buffers

    def as_dict(self) -> dict[str, int]:
        """The categories and ``total`` as a plain dict (bytes), e.g. for JSON."""
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_state": self.optimizer_state,
            "buffers": self.buffers,
            "total": self.total,
        }


def _storage_key(tensor: torch.Tensor) -> tuple[str, int, int] | None:
    """Identity of the storage behind ``tensor``; None for meta or empty storages."""
    if tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return (str(tensor.device), storage.data_ptr(), storage.nbytes())


def _count_new(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int, int]]) -> int:
    """Bytes of the storages behind ``tensors`` not in ``seen`` (which is updated)."""
    total = 0
    for tensor in tensors:
        key = _storage_key(tensor)
        if key is None or key in seen:
            continue
        seen.add(key)
        total += key[2]
    return total


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for per_param in optimizer.state.values():
        if isinstance(per_param, dict):
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    yield value
        elif isinstance(per_param, torch.Tensor):
            yield per_param


def model_state_bytes(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> ModelStateBytes:
    """Measure the model-state bytes this rank holds for ``module`` (and ``optimizer``).

    Each storage is counted once, in the first category that reaches it, in the order
    parameters, gradients, optimizer state, buffers; a view is charged for its whole
    storage. Tensors on the meta device and empty storages count 0 bytes.

    Args:
        module: the (possibly wrapped) module on this rank.
        optimizer: an optimizer whose ``state`` holds this rank's optimizer state; for a
            sharded optimizer such as ``shardkit.optim.OSS`` that is the local shard.
            Default None: optimizer state counted as 0.

    Returns:
        A :class:`ModelStateBytes` (bytes per category and ``total``).

    Example:
        >>> m = torch.nn.Linear(4, 2)
        >>> model_state_bytes(m).parameters  # (4 * 2 + 2) fp32 elements
        40
    """
    seen: set[tuple[str, int, int]] = set()
    params = list(module.parameters())
    parameters = _count_new(params, seen)
    gradients = _count_new((p.grad for p in params if p.grad is not None), seen)
    optimizer_state = 0 if optimizer is None else _count_new(_optimizer_tensors(optimizer), seen)
    buffers = _count_new(module.buffers(), seen)
    return ModelStateBytes(parameters, gradients, optimizer_state, buffers)


@dataclass(frozen=True)
class BufferPoolStats:
    """One pool of reused working buffers on this rank (a snapshot).

    Attributes:
        buffers: buffers that exist (each keeps its address; only resident ones hold
            memory).
        capacity_bytes: bytes of all of them together (the address space reserved).
        resident: buffers holding memory now.
        resident_bytes: bytes of those.
        peak_resident: the most buffers resident at once since the last
            :func:`reset_buffer_peaks` (or the start of the process).
        peak_resident_bytes: the most bytes resident at once over the same span.
    """

    buffers: int
    capacity_bytes: int
    resident: int
    resident_bytes: int
    peak_resident: int
    peak_resident_bytes: int


class BufferAccount:
    """The counts behind one :class:`BufferPoolStats`; the owner of the buffers calls
    :meth:`add` / :meth:`remove` when one is made / goes away and :meth:`acquired` /
    :meth:`released` when its memory comes / goes (sizes in bytes)."""

    def __init__(self) -> None:
        self.buffers = self.capacity = self.resident = self.resident_bytes = 0
        self.peak_resident = self.peak_resident_bytes = 0

    def add(self, nbytes: int) -> None:
        """A buffer of ``nbytes`` bytes was made (not resident)."""
        self.buffers += 1
        self.capacity += nbytes

    def remove(self, nbytes: int) -> None:
        """A buffer of ``nbytes`` bytes went away (released before)."""
        self.buffers -= 1
        self.capacity -= nbytes

    def acquired(self, nbytes: int) -> None:
        """A buffer of ``nbytes`` bytes became resident."""
        self.resident += 1
        self.resident_bytes += nbytes
        self.peak_resident = max(self.peak_resident, self.resident)
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def released(self, nbytes: int) -> None:
        """A resident buffer of ``nbytes`` bytes gave its memory back."""
        self.resident -= 1
        self.resident_bytes -= nbytes

    def stats(self) -> BufferPoolStats:
        """A snapshot of the counts."""
        return BufferPoolStats(
            self.buffers,
            self.capacity,
            self.resident,
            self.resident_bytes,
            self.peak_resident,
            self.peak_resident_bytes,
        )


_ACCOUNTS: dict[str, BufferAccount] = {}


def buffer_account(pool: str) -> BufferAccount:
    """The account of the pool named ``pool`` on this rank (made on first use)."""
    return _ACCOUNTS.setdefault(pool, BufferAccount())


def buffer_pools() -> dict[str, BufferPoolStats]:
    """Every pool of reused working buffers on this rank (this process), by name.

    FSDP's pools: ``"fsdp unit parameters"`` (each unit's full parameters; resident from
    the unit's all-gather to its reshard) and ``"fsdp unit gradients"`` (each unit's full
    gradient; resident from the unit's first gradient in a backward until its
    reduce-scatter is done). ``docs/fsdp.md`` ("Memory per rank") gives the bound on
    ``peak_resident``.

    Returns:
        ``{pool name: BufferPoolStats}``, empty before any buffer was made.

    Example:
        >>> from shardkit.memory import buffer_pools, reset_buffer_peaks
        >>> reset_buffer_peaks()
        >>> # ... training steps ...
        >>> peak = buffer_pools().get("fsdp unit parameters")
    """
    return {name: account.stats() for name, account in _ACCOUNTS.items()}


def reset_buffer_peaks() -> None:
    """Start the peaks of every pool afresh from what is resident now."""
    for account in _ACCOUNTS.values():
        account.peak_resident, account.peak_resident_bytes = (
            account.resident,
            account.resident_bytes,
        )


# [Note: trimming the heap]
# Activations, the sharded gradients and optimizer temporaries come from the C allocator.
# glibc keeps freed memory in its heap: it unmaps only allocations above a threshold that
# grows to 32 MiB, and shrinks the heap only from its top, so after a few steps the heap
# holds hundreds of MiB of free but resident pages between live blocks, and the resident
# set is the heap's high-water mark, not the bytes in use. ``malloc_trim(0)`` walks the
# free chunks of every arena and ``madvise(MADV_DONTNEED)``s each whole free page inside
# them (glibc >= 2.8), so those pages leave the resident set at once; the blocks stay
# where they are and the next use of the space faults in zero pages: that re-zeroing,
# not the call, is the cost (a trim after every training forward of the benchmark GPT
# cost 6% of its CPU time per step), hence one trim in STEP_TRIM_EVERY by default, which
# bounds the heap's drift (about 5 MiB per step there without trims). It is a call on
# this process's own heap; no allocator setting (``mallopt``, ``GLIBC_TUNABLES``) changes.
# Off glibc (macOS, Windows, musl) there is no such function and trim_heap does nothing.


def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``int malloc_trim(size_t pad)`` of this process, or None off glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None).malloc_trim  # the C library already loaded
    except (OSError, AttributeError):  # no dlopen(NULL), or not glibc (musl)
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


_MALLOC_TRIM = _find_malloc_trim()
#: When shardkit's own trim points trim (see :func:`set_heap_trim`).
HEAP_TRIM_MODES = ("off", "step", "unit")
#: The default of :func:`set_heap_trim`'s ``every`` in ``"step"`` mode (see there).
STEP_TRIM_EVERY = 8
_TRIM: dict[str, int] = {"points": 0, "trimmed": 0, "ns": 0, "due": 0}
_TRIM_MODE: dict[str, Any] = {"mode": "step", "every": STEP_TRIM_EVERY}


@dataclass(frozen=True)
class HeapTrimStats:
    """What :func:`trim_heap` did in this process (a snapshot).

    Attributes:
        available: glibc's ``malloc_trim`` was found (else every trim is a no-op).
        mode: where shardkit's own trim points trim (:func:`set_heap_trim`; default
            ``"step"``).
        points: trim points reached (:func:`heap_trim_point` calls: FSDP on CPU, once
            per step after the root's forward and once per unit reshard), whether they
            trimmed or not.
        trimmed: ``malloc_trim`` calls run (at trim points and by :func:`trim_heap`).
        seconds: wall time spent in ``malloc_trim`` (s).
        every: the mode's points trim once every ``every`` of them (default 8 in
            ``"step"`` mode, 1 in ``"unit"``; see :func:`set_heap_trim`).
    """

    available: bool
    mode: str
    points: int
    trimmed: int
    seconds: float
    every: int = 1

    @property
    def enabled(self) -> bool:
        """Some trim points trim (``mode != "off"``)."""
        return self.mode != "off"


def trim_heap() -> bool:
    """Return the C heap's free pages to the operating system now (see [Note: trimming
    the heap]): glibc's ``malloc_trim(0)``. A no-op, never an error, off glibc.

    Cost: it walks every free chunk; on the benchmark GPT (a heap of about 700 MiB) a
    call took 25-65 ms on a loaded 2-core machine, and the pages it gives back are
    faulted in again (zeroed) when the space is reused (``docs/fsdp.md``, "Peak RSS on
    CPU: the allocator", has the measured cost per step).

    Returns:
        True if ``malloc_trim`` ran.
    """
    if _MALLOC_TRIM is None:
        return False
    start = time.perf_counter_ns()
    _MALLOC_TRIM(0)
    _TRIM["ns"] += time.perf_counter_ns() - start
    _TRIM["trimmed"] += 1
    return True


def heap_trim_point(kind: str = "unit") -> bool:
    """A point where shardkit's own code may trim: ``kind`` ``"step"`` (FSDP on CPU: the
    root, after each forward a backward follows) or ``"unit"`` (after each unit's reshard).
    If the mode set by :func:`set_heap_trim` is ``kind``, :func:`trim_heap` at every
    ``every``-th such point (the ``every``-th, the ``2 every``-th, ...), else nothing.
    Counted in :func:`heap_trims` either way.

    Returns:
        True if ``malloc_trim`` ran.
    """
    _TRIM["points"] += 1
    if _TRIM_MODE["mode"] != kind:
        return False
    _TRIM["due"] += 1
    if _TRIM["due"] < _TRIM_MODE["every"]:
        return False
    _TRIM["due"] = 0
    return trim_heap()


def set_heap_trim(mode: bool | str, every: int | None = None) -> str:
    """Where shardkit's trim points return the C heap's free pages, for this process.

    Args:
        mode: ``"step"`` (the default): after the FSDP root's forward when a
            backward follows (the step's activations are live: the pages still free
            then are the heap's holes, which the step's peak would otherwise count),
            once every ``every`` such forwards (a micro-batch counts; an evaluation
            forward does not);
            ``"unit"`` (or True): after every unit's reshard in forward and backward,
            the lowest peak and the most CPU time; ``"off"`` (or False): never.
            Measured on the benchmark GPT in ``docs/fsdp.md``, "Peak RSS on CPU: the
            allocator".
        every: trim at one of every ``every`` points of the mode (>= 1). Default
            (None): :data:`STEP_TRIM_EVERY` (8) for ``"step"``, 1 for ``"unit"``; with
            ``"off"`` only None.
            Every trimmed page the heap reuses is faulted in again (zeroed), so a trim
            per step cost about 6% of the benchmark GPT's step; one in 8 bounds the
            heap's drift (about 5 MiB per step there) at an eighth of that cost.

    Returns:
        The previous mode.

    Raises:
        ValueError: another ``mode``; ``every`` < 1 or not an int; ``every`` given
            with mode ``"off"`` (or False), which has no trim point to count.
    """
    given = mode
    if isinstance(mode, bool):
        mode = "unit" if mode else "off"
    if mode not in HEAP_TRIM_MODES:
        raise ValueError(
            f"set_heap_trim: mode must be one of {HEAP_TRIM_MODES} or a bool; got {mode!r}"
        )
    if mode == "off" and every is not None:
        raise ValueError(
            f'set_heap_trim: every={every!r} with mode={given!r} ("off": no trim point '
            'trims, so there is nothing to count); drop every, or use mode "step" or "unit"'
        )
    if every is None:
        every = STEP_TRIM_EVERY if mode == "step" else 1
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"set_heap_trim: every must be an int >= 1; got {every!r}")
    previous = _TRIM_MODE["mode"]
    _TRIM_MODE.update(mode=mode, every=every)
    _TRIM["due"] = 0
    return str(previous)


def heap_trims() -> HeapTrimStats:
    """Counts of :func:`trim_heap` and :func:`heap_trim_point` in this process since
    it started."""
    return HeapTrimStats(
        _MALLOC_TRIM is not None,
        _TRIM_MODE["mode"],
        _TRIM["points"],
        _TRIM["trimmed"],
        _TRIM["ns"] / 1e9,
        _TRIM_MODE["every"],
    )


@dataclass(frozen=True)
class ZeroMemoryEstimate:
    """Per-rank model-state bytes predicted by the ZeRO formulas (floats, in bytes)."""

    parameters: float
    gradients: float
    optimizer_state: float

    @property
    def total(self) -> float:
        """Sum of the three categories, in bytes."""
        return self.parameters + self.gradients + self.optimizer_state


# Bytes per parameter: (parameter, gradient, optimizer state K).
# Mixed-precision Adam (paper, section 3.1): fp16 params and grads, K = 12
# (fp32 master copy, momentum, variance). fp32 Adam: fp32 params and grads, K = 8.
_BYTES_PER_PARAM = {True: (2, 2, 12), False: (4, 4, 8)}


def zero_memory_estimate(
    num_params: float,
    world_size: int,
    stage: int,
    *,
    mixed_precision: bool = True,
    optimizer_bytes_per_param: float | None = None,
) -> ZeroMemoryEstimate:
    """Per-rank model-state bytes of ZeRO stage ``stage`` (Rajbhandari et al. 2020, sec. 5.1).

    With psi = ``num_params``, N = ``world_size`` and K optimizer bytes per parameter:

    ========  =====================  ==================================
    stage     what is sharded        mixed-precision Adam (2 + 2 + 12)
    ========  =====================  ==================================
    0 (DDP)   nothing                16 psi
    1         optimizer state        4 psi + 12 psi / N
    2         + gradients            2 psi + 14 psi / N
    3         + parameters           16 psi / N
    ========  =====================  ==================================

    fp32 Adam (``mixed_precision=False``) uses 4 + 4 + 8 bytes per parameter.

    Args:
        num_params: psi, the number of model parameters (elements).
        world_size: N, the number of data-parallel ranks (>= 1).
        stage: 0, 1, 2 or 3.
        mixed_precision: default True (fp16/bf16 params and grads, fp32 optimizer state
            including a master copy, K = 12); False for fp32 training (K = 8).
        optimizer_bytes_per_param: override K (bytes per parameter), e.g. 4 for SGD with
            momentum in fp32.

    Returns:
        A :class:`ZeroMemoryEstimate` in bytes per rank.

    Raises:
        ValueError: if ``stage`` is not 0-3, ``world_size`` < 1 or ``num_params`` < 0.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3 (ZeRO stages); got {stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0; got {num_params}")
    p_bytes, g_bytes, k_bytes = _BYTES_PER_PARAM[mixed_precision]
    k = k_bytes if optimizer_bytes_per_param is None else optimizer_bytes_per_param
    n = float(world_size)
    return ZeroMemoryEstimate(
        parameters=p_bytes * num_params / (n if stage >= 3 else 1.0),
        gradients=g_bytes * num_params / (n if stage >= 2 else 1.0),
        optimizer_state=k * num_params / (n if stage >= 1 else 1.0),
    )


_CLI_EPILOG = """\
Measured overheads on top of the formula (GPT, fp32 AdamW, gloo, 2 ranks; see
docs/benchmarks.md): optimizer state adds one 4-byte 'step' tensor per parameter tensor
(per flat parameter for FSDP); OSS / ShardedDDP shard whole parameters, so a rank's
optimizer state can exceed 8 psi / N by up to the largest parameter's 8 bytes per
element; FSDP pads each flat parameter to a multiple of N (at most N - 1 elements,
16 bytes each with AdamW); torch DDP keeps its gradient buckets as a second copy of the
gradients (+4 psi bytes, not model state, so not in this table); activations and the
process (about 220-400 MiB per rank with torch and gloo) come on top."""


def main(argv: list[str] | None = None) -> None:
    """``python -m shardkit.memory --params 7.5e9 --world-size 64``: print the per-rank
    model-state bytes of ZeRO stages 0-3 in mixed precision (2 + 2 + 12 bytes per
    parameter) and fp32 (4 + 4 + 8), in GB (10^9 bytes, as the ZeRO paper's figure 1).

    Raises:
        SystemExit: on bad arguments (argparse), e.g. ``--world-size 0``.
    """
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m shardkit.memory",
        description="Per-rank model-state bytes of ZeRO stages 0-3 (Rajbhandari et al. 2020).",
        epilog=_CLI_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--params", type=float, required=True, help="psi: parameters")
    parser.add_argument("--world-size", type=int, required=True, help="N: data-parallel ranks")
    parser.add_argument(
        "--optimizer-bytes", type=float, default=None, help="K per parameter (default Adam)"
    )
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.params < 0:
        parser.error(
            f"need --params >= 0 and --world-size >= 1; got {args.params}, {args.world_size}"
        )
    gb = 1e9
    print(f"psi = {args.params:.4g} parameters, N = {args.world_size}; GB (1e9 bytes) per rank")
    print(
        f"{'stage':<6} {'precision':<16} {'params':>10} {'grads':>10} {'optimizer':>10} {'total':>10}"
    )
    for stage in range(4):
        for mixed, label in ((True, "mixed (2+2+12)"), (False, "fp32 (4+4+8)")):
            est = zero_memory_estimate(
                args.params,
                args.world_size,
                stage,
                mixed_precision=mixed,
                optimizer_bytes_per_param=args.optimizer_bytes,
            )
            values = (est.parameters, est.gradients, est.optimizer_state, est.total)
            print(f"{stage:<6} {label:<16} " + " ".join(f"{v / gb:>10.3f}" for v in values))


if __name__ == "__main__":
    main()
