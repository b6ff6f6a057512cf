"""``load_universal``: each rank fills the pieces it holds from the byte ranges it needs.

[Note: the steps of a load]
1. The checkpoint: a root's newest intact one (:func:`find_valid_checkpoint`: a
   damaged newest one falls back to the previous with a warning), or the directory
   given (verified; the ranks share the checksum work).
2. The index: the header of every shard file (a few KB each; no tensor bytes).
3. The keys: the union of every rank's keys against the checkpoint's (strict:
   missing or unexpected keys, or another global shape, raise
   :class:`CheckpointMismatchError` naming them), and every needed key's saved
   pieces must cover it (:func:`~.plan.cover_problem`).
4. The plan, checked before anything is written (:func:`_plan_local`): the entries,
   the optimizer class, the param groups' hyperparameters, the index against the
   keys, every optimizer state's offset and scalar, this rank's ``extra`` file (read
   now: an unsafe one refuses the load); every shard file holding a needed piece is
   opened (memory-mapped: a file deleted from then on still reads).
5. The ranks agree: a failure on any rank raises on every rank before any rank
   writes a tensor, so a refused load leaves every model and optimizer unchanged.
6. The pieces, read (:class:`~.plan.Filler`: range intersection, or assemble one
   global tensor and cut) into buffers of their own, with the optimizer state of
   each piece's ``param`` (:class:`_Staged`): nothing the model or the optimizer
   holds is written yet. What can still fail here is reading the bytes (an I/O
   error, a file truncated after the checks, memory): that error (problem
   ``read``) says the model and optimizer are unchanged.
7. The ranks agree again: a read failure on any rank raises on every rank.
8. The commit: in-memory copies of what was read into the model and the optimizer
   state, then the param groups' hyperparameters, then ``after_load``. The cost:
   this rank's share of the checkpoint is held once more during the load.

Why this module is long: load_universal's steps (the Note above) run in order over one
staging object, each a function under 90 lines; what stands alone is already apart
(plan.py, shardfile.py, optim_state.py, meta.py).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardkit.checkpoint.manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    CheckpointError,
    CheckpointMismatchError,
    Manifest,
    _rank_world,
    _saved_step,
    find_valid_checkpoint,
    load_tensors_only,
    not_the_committed_save,
    read_manifest,
    verify_checkpoint,
)
from shardkit.checkpoint.universal.adapters import layout_of
from shardkit.checkpoint.universal.layout import ParamEntry, session_of
from shardkit.checkpoint.universal.meta import FORMAT, extra_file_name
from shardkit.checkpoint.universal.optim_state import (
    entry_offset,
    group_keys,
    holds_whole,
    hyperparameter_problems,
    is_per_tensor,
    merge_group_keys,
    optimizer_class,
    optimizer_params,
    plan_hyperparameters,
    restore_hyperparameters,
    state_shape,
)
from shardkit.checkpoint.universal.plan import Filler, assemble, cover_problem
from shardkit.checkpoint.universal.shardfile import (
    SavedPiece,
    SavedScalar,
    dtype_from_name,
    read_index,
)
from shardkit.checkpoint.universal.writer import check_entry

__all__ = [
    "LoadedCheckpoint",
    "SavedIndex",
    "load_universal",
    "read_saved_index",
    "read_tensor",
]

PathLike = str | os.PathLike[str]
_SHARD_PREFIX = "shard-"


@dataclass
class LoadedCheckpoint:
    """What :func:`load_universal` loaded.

    Attributes:
        path: the checkpoint directory.
        step: the step it was saved at.
        saved_world_size: the ranks that wrote it.
        saved_strategy: the saving layout's strategy (``"ddp"``, ``"fsdp"``, ...).
        manifest: its manifest.
    """

    path: Path
    step: int
    saved_world_size: int
    saved_strategy: str
    manifest: Manifest = field(repr=False)
    _extras: dict[int, Any] = field(default_factory=dict, repr=False)

    def extra(self, rank: int) -> Any | None:
        """The ``extra`` saved by ``rank`` (``{}`` if it saved none), or None for a rank
        that did not exist at save time. Read with ``weights_only=True``.

        Raises:
            CheckpointUnsafeError: the file holds something other than tensors and
                plain containers.
        """
        if rank not in self._extras:
            name = extra_file_name(rank)
            if name not in {f.name for f in self.manifest.files}:
                return None
            self._extras[rank] = load_tensors_only(self.path / name, map_location="cpu")
        return self._extras[rank]


@dataclass
class SavedIndex:
    """Every saved piece, by ``(key, state)``, and the scalar state by key."""

    pieces: dict[tuple[str, str], list[SavedPiece]]
    scalars: dict[str, dict[str, SavedScalar]]
    _states: dict[str, list[str]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for key, state in sorted(self.pieces):
            if state:
                self._states.setdefault(key, []).append(state)

    def states(self, key: str) -> list[str]:
        """The optimizer state names saved for ``key`` (element-wise and per-tensor),
        sorted."""
        return self._states.get(key, [])


def read_saved_index(ckpt: Path, manifest: Manifest) -> SavedIndex:
    """The index from the headers of the shard files of ``manifest``."""
    pieces: dict[tuple[str, str], list[SavedPiece]] = {}
    scalars: dict[str, dict[str, SavedScalar]] = {}
    for record in manifest.files:
        if not record.name.startswith(_SHARD_PREFIX):
            continue
        try:
            saved, saved_scalars = read_index(ckpt / record.name)
        except Exception as err:  # safetensors raises its own error types
            raise CheckpointError(
                ckpt / record.name, "index", f"{ckpt / record.name}: unreadable index: {err}"
            ) from err
        for p in saved:
            pieces.setdefault((p.key, p.state), []).append(p)
        for s in saved_scalars:
            scalars.setdefault(s.key, {}).setdefault(s.state, s)
    return SavedIndex(pieces, scalars)


class _FileSource:
    """Reads piece ranges from the shard files, lazily (safetensors slices)."""

    def __init__(self, ckpt: Path) -> None:
        self.ckpt = ckpt
        self._open: dict[str, Any] = {}
        self.read_elements = 0

    def open(self, file: str) -> Any:
        """The safetensors handle of ``file`` (memory-mapped), opened once."""
        from safetensors import safe_open

        handle = self._open.get(file)
        if handle is None:
            handle = self._open[file] = safe_open(str(self.ckpt / file), framework="pt")
        return handle

    def read(self, piece: SavedPiece, lo: int, hi: int) -> torch.Tensor:
        self.read_elements += hi - lo
        return self.open(piece.file).get_slice(piece.name)[lo:hi]


def read_tensor(
    ckpt: Path, index: SavedIndex, key: str, shape: tuple[int, ...], dtype: str, state: str = ""
) -> torch.Tensor:
    """The full tensor ``key`` (or its optimizer state ``state``) of checkpoint ``ckpt``,
    put together from the byte ranges of its pieces (one process, no ranks).

    Raises:
        CheckpointMismatchError: the pieces do not hold every element exactly once.
    """
    pieces = index.pieces.get((key, state), [])
    if not any(s == 0 for s in shape) or pieces:
        problem = cover_problem(pieces, shape)
        if problem is not None:
            raise CheckpointMismatchError(ckpt, "coverage", f"{ckpt}: {key!r}: {problem}")
    if not pieces:
        return torch.empty(shape, dtype=dtype_from_name(dtype))
    return assemble(pieces, _FileSource(ckpt)).view(shape)


def _agree(error: BaseException | None, group: Any, world_size: int) -> None:
    """Raise on every rank if any rank failed: its own error, else the first one."""
    errors: list[Any] = [error]
    if world_size > 1:
        errors = [None] * world_size
        dist.all_gather_object(errors, error, group=group)
    if error is not None:
        raise error
    for rank, err in enumerate(errors):
        if err is not None:
            raise CheckpointError(
                getattr(err, "path", ""), "load", f"loading failed on rank {rank}: {err}"
            ) from err


def _resolve(path: PathLike, group: Any, rank: int, world_size: int) -> Path:
    p = Path(path)
    if (p / LATEST_NAME).is_file():
        found = find_valid_checkpoint(p, group=group)
        if found is None:
            raise FileNotFoundError(f"{p}: no committed checkpoint")
        return found
    if not (p / MANIFEST_NAME).is_file():
        if not p.is_dir():
            raise FileNotFoundError(f"{p} is not a checkpoint root or directory")
        unfinished = sorted(c.name for c in p.glob("ckpt-*") if _saved_step(c.name) is not None)
        if unfinished:  # a root before its first commit
            raise FileNotFoundError(
                f"{p}: no committed checkpoint (no {LATEST_NAME!r} file; {unfinished} "
                "never finished saving)"
            )
        if _saved_step(p.name) is None:  # not ckpt-<step>[.new]: those, a save not finished
            raise FileNotFoundError(
                f"{p} is not a checkpoint root (no {LATEST_NAME!r} file) or checkpoint "
                f"directory (no {MANIFEST_NAME!r})"
            )
    elif (uncommitted := not_the_committed_save(p)) is not None:
        raise FileNotFoundError(uncommitted)  # never committed, or superseded
    error: BaseException | None = None
    try:  # the ranks share the checksum work
        manifest = verify_checkpoint(p, names=[])
        verify_checkpoint(p, names=[f.name for f in manifest.files[rank::world_size]])
    except CheckpointError as err:
        error = err
    _agree(error, group, world_size)
    return p


def _check_format(ckpt: Path, manifest: Manifest) -> None:
    fmt = manifest.layout.get("format")
    if fmt != FORMAT:
        raise CheckpointMismatchError(
            ckpt,
            "format",
            f"{ckpt} is not a universal checkpoint (layout format {fmt!r}, this shardkit "
            f"reads {FORMAT!r}); save it with save_universal, or convert a checkpoint of "
            f"the previous release's sharded formats: python -m shardkit.checkpoint "
            f"convert {ckpt} <new root>",
        )


def _key_problems(
    ckpt: Path, layout: dict[str, Any], entries: list[ParamEntry], all_keys: set[str], strict: bool
) -> None:
    saved = layout["keys"]
    missing = sorted(all_keys - set(saved))
    unexpected = sorted(set(saved) - all_keys)
    shapes = sorted(
        f"{e.key!r}: checkpoint {saved[e.key]['shape']}, model {list(e.view.global_shape)}"
        for e in {e.key: e for e in entries}.values()
        if e.key in saved and list(e.view.global_shape) != list(saved[e.key]["shape"])
    )
    problems = []
    if strict and missing:
        problems.append(f"missing keys (in the model, not in the checkpoint): {missing}")
    if strict and unexpected:
        problems.append(f"unexpected keys (in the checkpoint, not in the model): {unexpected}")
    if shapes:
        problems.append(f"other global shapes: {shapes}")
    if problems:
        raise CheckpointMismatchError(
            ckpt, "keys", f"{ckpt} does not fit the model: " + "; ".join(problems)
        )


def _cover_check(
    ckpt: Path, index: SavedIndex, layout: dict[str, Any], keys: Iterable[str]
) -> None:
    problems = []
    for key in sorted(set(keys)):
        shape = tuple(layout["keys"][key]["shape"])
        if math.prod(shape) == 0:  # empty: nothing to hold
            continue
        states = [""] + index.states(key)
        for state in states:
            pieces = index.pieces.get((key, state), [])
            problem = cover_problem(pieces, state_shape(shape, pieces) if state else shape)
            if problem is not None:
                what = f"{key!r}" + (f" (optimizer state {state!r})" if state else "")
                problems.append(f"{what}: {problem}")
    if problems:
        raise CheckpointMismatchError(
            ckpt,
            "coverage",
            f"{ckpt}: saved pieces do not hold every element of {len(problems)} tensors: "
            + "; ".join(problems[:10]),
        )


@dataclass
class _Staged:
    """Everything a load writes, read from the files but not yet visible to the model
    or the optimizer (step 6 of [Note: the steps of a load]); :meth:`commit` copies
    it in with in-memory copies only.

    Attributes:
        pieces: ``(destination, offset, read values)`` of every filled piece: the
            values go to elements ``[offset, offset + n)`` of the row-major
            flattened destination (a parameter's or buffer's storage on this rank,
            or an existing optimizer state tensor shaped like its param).
        created: ``(param, name, tensor)``: optimizer state tensors made for this load
            (none of that shape before), already filled.
        scalars: ``(param, name, value)``: scalar optimizer state (``step``).
        stateless: params saved without optimizer state: theirs is dropped.
    """

    pieces: list[tuple[torch.Tensor, int, torch.Tensor]] = field(default_factory=list)
    created: list[tuple[torch.Tensor, str, torch.Tensor]] = field(default_factory=list)
    scalars: list[tuple[torch.Tensor, str, Any]] = field(default_factory=list)
    stateless: list[torch.Tensor] = field(default_factory=list)

    def read_piece(
        self,
        filler: Filler,
        dst: torch.Tensor,
        offset: int,
        pieces: Sequence[SavedPiece],
        entry: ParamEntry,
    ) -> None:
        """Read ``entry``'s range of ``pieces`` now, for elements ``[offset, offset +
        n)`` of ``dst`` (row-major) at commit."""
        if entry.stop <= entry.start:
            return
        values = torch.empty(entry.stop - entry.start, dtype=dst.dtype)
        filler.fill(values, pieces, entry.view, entry.start, entry.stop)
        self.pieces.append((dst, offset, values))

    @torch.no_grad()
    def commit(self, optimizer: Any) -> None:
        """Copy everything read into the model and the optimizer."""
        for dst, offset, values in self.pieces:
            n = values.numel()
            if dst.is_contiguous():
                dst.view(-1)[offset : offset + n].copy_(values)
            else:  # strided (a state tensor laid out like its param): via a copy
                flat = dst.reshape(-1).clone()
                flat[offset : offset + n].copy_(values)
                dst.copy_(flat.view(dst.shape))
        for param, name, tensor in self.created:
            optimizer.state[param][name] = tensor
        for param, name, value in self.scalars:
            optimizer.state[param][name] = value
        for param in self.stateless:  # saved before its first step: no state
            optimizer.state.pop(param, None)


def _read_state(
    staged: _Staged,
    filler: Filler,
    index: SavedIndex,
    entry: ParamEntry,
    optimizer: Any,
    group: dict[str, Any],
    made: dict[tuple[int, str], torch.Tensor],
) -> None:
    """Optimizer state of ``entry``'s param from the saved pieces, as torch's
    ``Optimizer.load_state_dict`` places it: new element-wise state in the param's
    dtype (a floating param; else the saved dtype) and on its device; an existing
    state tensor of the param's shape is filled in place (any strides); a 0-dim
    ``step`` on the param's device when ``group`` is ``capturable`` or ``fused``.
    Read into ``staged`` (``made``: the state tensors this load creates, by param and
    name, shared by the param's pieces)."""
    param = entry.param
    assert param is not None
    state = optimizer.state.get(param, {})
    offset, n = entry_offset(entry), entry.stop - entry.start
    for name in index.states(entry.key):
        pieces = index.pieces[(entry.key, name)]
        if is_per_tensor(entry.view.global_shape, pieces):
            if (id(param), name) not in made:  # once per param, whole
                made[(id(param), name)] = _read_per_tensor(staged, filler, pieces, param, name)
            continue
        current = made.get((id(param), name), state.get(name))
        if not isinstance(current, torch.Tensor) or current.shape != param.shape:
            saved = dtype_from_name(pieces[0].dtype)
            dtype = param.dtype if param.is_floating_point() else saved
            current = torch.zeros(param.shape, dtype=dtype, device=param.device)
            made[(id(param), name)] = current
            staged.created.append((param, name, current))
        if not n:
            continue
        if (id(param), name) in made:  # not visible before the commit: filled now
            filler.fill(
                current.view(-1)[offset : offset + n], pieces, entry.view, entry.start, entry.stop
            )
        else:  # the optimizer's own tensor: filled at commit
            staged.read_piece(filler, current, offset, pieces, entry)
    on_param = bool(group.get("capturable") or group.get("fused"))
    for name, scalar in index.scalars.get(entry.key, {}).items():
        value = scalar.restore()
        old = state.get(name)
        if isinstance(value, torch.Tensor):
            if isinstance(old, torch.Tensor):
                value = value.to(old.device)
            elif on_param:
                value = value.to(param.device)
        staged.scalars.append((param, name, value))


def _read_per_tensor(
    staged: _Staged, filler: Filler, pieces: Sequence[SavedPiece], param: torch.Tensor, name: str
) -> torch.Tensor:
    """Per-tensor state ``name`` of ``param`` (see ``[Note: per-tensor optimizer state]``
    in :mod:`.optim_state`), read whole into a new tensor of its saved shape, in the
    param's dtype (a floating param; else the saved dtype) and on its device."""
    view = pieces[0].view
    dtype = param.dtype if param.is_floating_point() else dtype_from_name(pieces[0].dtype)
    values = torch.empty(view.global_shape, dtype=dtype)
    filler.fill(values, pieces, view, 0, view.local_numel)
    tensor = values.to(param.device)
    staged.created.append((param, name, tensor))
    return tensor


def _read(
    entries: Sequence[ParamEntry], index: SavedIndex, optimizer: Any, source: _FileSource
) -> _Staged:
    """Read every piece this rank loads, changing nothing (see :class:`_Staged`)."""
    filler = Filler(source)
    staged = _Staged()
    in_optimizer = optimizer_params(optimizer) if optimizer is not None else {}
    stateless: dict[int, torch.Tensor] = {}  # params none of whose keys has saved state
    with_state: set[int] = set()
    made: dict[tuple[int, str], torch.Tensor] = {}
    for entry in sorted(entries, key=lambda e: e.key):  # a key's pieces together
        pieces = index.pieces.get((entry.key, ""))
        if pieces is None:  # not strict, key not saved
            continue
        staged.read_piece(filler, entry.tensor, 0, pieces, entry)
        if entry.param is not None and id(entry.param) in in_optimizer:
            if index.states(entry.key) or entry.key in index.scalars:
                group = optimizer.param_groups[in_optimizer[id(entry.param)]]
                _read_state(staged, filler, index, entry, optimizer, group, made)
                with_state.add(id(entry.param))
            else:
                stateless[id(entry.param)] = entry.param
    filler.release()
    staged.stateless = [p for pid, p in stateless.items() if pid not in with_state]
    return staged


def load_universal(
    path: PathLike,
    model: Any,
    optimizer: Any = None,
    *,
    group: dist.ProcessGroup | None = None,
    strict: bool = True,
    require_optimizer_state: bool = False,
) -> LoadedCheckpoint:
    """Load a universal checkpoint into ``model`` (and ``optimizer``), whatever the
    layout and world size it was saved with.

    A collective over ``group``: every rank calls it (see [Note: the steps of a load]).

    Args:
        path: a checkpoint root (its newest intact checkpoint is used) or one
            checkpoint directory ``ckpt-<step>``.
        model: the model as the training loop holds it (see ``save_universal``).
        optimizer: the optimizer to restore state and hyperparameters into, or None.
        group: the process group; default None: the world group.
        strict: default True: every key of the model must be in the checkpoint and
            the other way round. False: missing keys keep their values, extra keys
            are ignored.
        require_optimizer_state: default False: a checkpoint saved without optimizer
            state loads the model and leaves ``optimizer`` as it is. True (with an
            ``optimizer``): such a checkpoint is refused (``CheckpointMismatchError``,
            problem ``optimizer``), as the wrappers' ``load_fsdp_sharded`` /
            ``OSS.load_sharded`` do.

    Returns:
        :class:`LoadedCheckpoint`: ``step``, ``saved_world_size``, ``saved_strategy``,
        ``extra(rank)``.

    Raises:
        FileNotFoundError: nothing committed under ``path``.
        CheckpointCorruptError: damage (every checkpoint of a root damaged, or the
            directory given).
        CheckpointMismatchError: not a universal checkpoint; missing, unexpected or
            reshaped keys; saved pieces that do not cover a tensor; param groups that
            mix saved groups of different hyperparameters; no optimizer state saved
            (with ``require_optimizer_state``).
        CheckpointUnsafeError: this rank's extra file holds something other than
            tensors and plain containers.
        CheckpointError: (problem ``load``) another rank failed; (problem
            ``read``) reading the tensors failed after every check had passed (an
            I/O error). Every error above is raised on every rank before any tensor
            is written: the model and optimizer are unchanged (see [Note: the steps
            of a load]).
    """
    rank, world_size = _rank_world(group)
    ckpt = _resolve(path, group, rank, world_size)
    with contextlib.ExitStack() as session:  # the adapter's session(), left at the end
        error: BaseException | None = None
        plan: _Plan | None = None
        adapter: Any = None
        # every rank's keys, and the keys of each param group (a rank may hold no piece of
        # a group's parameters, yet sets its hyperparameters)
        held: list[Any] = [(set(), {})]
        try:
            manifest = read_manifest(ckpt)
            _check_format(ckpt, manifest)
            adapter = layout_of(model, optimizer, group=group)
            session.enter_context(session_of(adapter, "load"))
            entries = list(adapter.entries())
            groups = group_keys(entries, optimizer) if optimizer is not None else {}
            held = [({e.key for e in entries}, groups)]
        except BaseException as err:  # every rank must reach the gather below
            error = err
        if world_size > 1:
            mine = held[0]
            held = [None] * world_size
            dist.all_gather_object(held, mine, group=group)
        if error is None:
            try:
                all_keys: set[str] = set().union(*(keys for keys, _ in held))
                all_groups = merge_group_keys(g for _, g in held)
                if require_optimizer_state and optimizer is not None:
                    _require_optimizer_state(ckpt, manifest)
                plan = _plan_local(
                    ckpt, manifest, entries, all_keys, all_groups, optimizer, rank, strict
                )
            except BaseException as err:
                error = err
        _agree(error, group, world_size)  # a failure raises on every rank: nothing written
        assert plan is not None and adapter is not None
        staged = _Staged()
        try:
            staged = _read(entries, plan.index, optimizer, plan.source)
        except Exception as err:
            error = _read_failed(ckpt, err)
        except BaseException as err:
            error = err
        _agree(error, group, world_size)  # a read failure on any rank: nothing written
        staged.commit(optimizer)
        restore_hyperparameters(optimizer, plan.hyper)
        del staged
        adapter.after_load()
        return plan.loaded


def _require_optimizer_state(ckpt: Path, manifest: Manifest) -> None:
    if not manifest.layout.get("optimizer"):
        raise CheckpointMismatchError(
            ckpt,
            "optimizer",
            f"{ckpt}: the checkpoint has no optimizer state (saved with optimizer=None); "
            "load the model only, without an optimizer",
        )


def _read_failed(ckpt: Path, err: Exception) -> CheckpointError:
    """The error of a read that failed after the checks (step 6 of [Note: the steps of
    a load]), chained to ``err``."""
    error = CheckpointError(
        getattr(err, "path", ckpt),
        "read",
        f"loading {ckpt} failed while reading the tensors, after every check had "
        f"passed: {type(err).__name__}: {err}. Nothing was copied: the model and "
        "optimizer are unchanged",
    )
    error.__cause__ = err
    return error


@dataclass
class _Plan:
    """What :func:`_plan_local` checked: the index, the hyperparameters per param
    group, the opened shard files, and what ``load_universal`` returns."""

    index: SavedIndex
    hyper: dict[int, dict[str, Any]]
    source: _FileSource
    loaded: LoadedCheckpoint


def _plan_local(
    ckpt: Path,
    manifest: Manifest,
    entries: list[ParamEntry],
    all_keys: set[str],
    all_groups: dict[int, list[str]],
    optimizer: Any,
    rank: int,
    strict: bool,
) -> _Plan:
    """Check everything this rank's load needs, writing nothing (step 4 of [Note: the
    steps of a load]); raises what ``load_universal`` documents."""
    layout = manifest.layout
    for entry in entries:
        check_entry(entry)
    saved_class = (layout.get("optimizer") or {}).get("class")
    if optimizer is not None and saved_class not in (None, optimizer_class(optimizer)):
        raise CheckpointMismatchError(
            ckpt,
            "optimizer",
            f"{ckpt} holds the state of a {saved_class} optimizer, this run steps a "
            f"{optimizer_class(optimizer)}: pass optimizer=None to load the model only",
        )
    _key_problems(ckpt, layout, entries, all_keys, strict)
    hyper: dict[int, dict[str, Any]] = {}
    if optimizer is not None and layout.get("optimizer"):
        hyper, problems = plan_hyperparameters(all_groups, layout["optimizer"]["param_groups"])
        problems += hyperparameter_problems(optimizer, hyper)
        if problems:  # before anything is filled
            raise CheckpointMismatchError(ckpt, "param groups", f"{ckpt}: " + "; ".join(problems))
    index = read_saved_index(ckpt, manifest)
    _cover_check(ckpt, index, layout, {e.key for e in entries if e.key in layout["keys"]})
    source = _FileSource(ckpt)
    _check_pieces(ckpt, entries, index, optimizer, source)
    loaded = LoadedCheckpoint(
        ckpt, manifest.step, manifest.world_size, str(layout.get("strategy")), manifest
    )
    loaded.extra(rank)  # read now: an unsafe file refuses the load on every rank
    return _Plan(index, hyper, source, loaded)


def _check_per_tensor(ckpt: Path, entry: ParamEntry, index: SavedIndex) -> None:
    """Per-tensor optimizer state goes only to an optimizer holding the whole parameter
    (see ``[Note: per-tensor optimizer state]`` in :mod:`.optim_state`).

    Raises:
        CheckpointMismatchError: ``entry``'s param is a piece of its tensor and the
            checkpoint holds per-tensor state of it (the names and the fix).
    """
    shape = entry.view.global_shape
    names = [
        s for s in index.states(entry.key) if is_per_tensor(shape, index.pieces[(entry.key, s)])
    ]
    if names and not holds_whole(entry):
        assert entry.param is not None
        raise CheckpointMismatchError(
            ckpt,
            "optimizer",
            f"{ckpt}: {entry.key!r} has per-tensor optimizer state {names} (saved by an "
            f"optimizer that held the whole {list(shape)} tensor); this optimizer holds "
            f"{entry.param.numel()} of its {math.prod(shape)} elements. Step it with an "
            "optimizer that holds whole tensors (WholeTensorOptimizer over FSDP, OSS, "
            "ShardedDataParallel, a plain model), or load with optimizer=None",
        )


def _check_pieces(
    ckpt: Path, entries: list[ParamEntry], index: SavedIndex, optimizer: Any, source: _FileSource
) -> None:
    """What :func:`_read` needs and would otherwise find wrong only while reading: the
    offset of each piece's optimizer state in its param, every scalar state's value;
    and every shard file it reads, opened now."""
    in_optimizer = optimizer_params(optimizer) if optimizer is not None else {}
    for entry in entries:
        if (entry.key, "") not in index.pieces:  # not strict, key not saved
            continue
        needed = [(entry.key, "")]
        if entry.param is not None and id(entry.param) in in_optimizer:
            needed += [(entry.key, state) for state in index.states(entry.key)]
            _check_per_tensor(ckpt, entry, index)
            try:
                if len(needed) > 1 or entry.key in index.scalars:
                    entry_offset(entry)
                for scalar in index.scalars.get(entry.key, {}).values():
                    scalar.restore()
            except ValueError as err:
                raise CheckpointMismatchError(ckpt, "optimizer", f"{ckpt}: {err}") from err
        for tag in needed:
            for piece in index.pieces[tag]:
                source.open(piece.file)
