"""One checkpoint format for every strategy: save in one layout, load into any other.

    ckpt = save_universal(root, step, model, optimizer, extra={...}, keep=2)  # collective
    loaded = load_universal(root_or_ckpt, model, optimizer)                  # collective
    loaded.step, loaded.saved_world_size, loaded.saved_strategy, loaded.extra(rank)

    checkpointer = AsyncCheckpointer()                  # collective, once
    checkpointer.save(root, step, model, optimizer, extra={...}, keep=2)  # returns at once
    checkpointer.close()                                # waits for the last commit

``model`` is the wrapped model as the user holds it (plain, DDP, ShardedDataParallel,
FullyShardedDataParallel (any sharding strategy), a model with tensor-parallel layers,
Pipe, OffloadModel); ``optimizer`` the one it steps with (plain, OSS, or None).
Loading works at any world size, mesh and strategy (each rank reads only the byte
ranges it needs); ``extra`` is per-rank plain data + tensors (LR scheduler, RNG states,
data position, loss history), returned by ``loaded.extra(rank)`` (None for a rank that
did not exist at save time; ``loaded.extra(0)`` always exists).

Modules: :mod:`.layout` (the adapter contract and registry), :mod:`.adapters` (plain
module, torch DDP, ``layout_of``), :mod:`.plan` (which saved bytes fill a piece), :mod:`.shardfile` (the safetensors
shard file and its index), :mod:`.optim_state`, :mod:`.meta` (the manifest layout),
:mod:`.writer` (``save_universal``), :mod:`.loader` (``load_universal``),
:mod:`.staging` and :mod:`.asynchronous` (``AsyncCheckpointer``: the same save, copied
to host memory at the step boundary and committed by a background thread),
:mod:`.peer` (``universal_state`` / ``load_universal_states``: a checkpoint held in
memory, sent by live ranks to ranks of another layout; ``gradient_pieces``: the pieces
replicas of different layouts average gradients over).
Wrapper adapters live with their wrappers and call :func:`register_layout` at import.
Every piece is described by its shard descriptor,
:class:`shardkit.distributed.shard_descriptor.TensorView` (re-exported here), with its
element arithmetic in :mod:`shardkit.distributed.shard_elements`; this package reads
descriptors only, never a process-wide mesh.
"""

from shardkit.checkpoint.universal.adapters import DDPLayout, PlainLayout, layout_of
from shardkit.checkpoint.universal.asynchronous import AsyncCheckpointer, AsyncSave
from shardkit.checkpoint.universal.layout import (
    LayoutAdapter,
    ParamEntry,
    Purpose,
    register_layout,
    session_of,
)
from shardkit.checkpoint.universal.loader import LoadedCheckpoint, load_universal
from shardkit.checkpoint.universal.meta import FORMAT
from shardkit.checkpoint.universal.peer import (
    gradient_pieces,
    load_universal_states,
    universal_state,
)
from shardkit.checkpoint.universal.writer import save_universal
from shardkit.distributed.shard_descriptor import TensorView

__all__ = [
    "FORMAT",
    "AsyncCheckpointer",
    "AsyncSave",
    "DDPLayout",
    "LayoutAdapter",
    "LoadedCheckpoint",
    "ParamEntry",
    "PlainLayout",
    "Purpose",
    "TensorView",
    "gradient_pieces",
    "layout_of",
    "load_universal",
    "load_universal_states",
    "register_layout",
    "save_universal",
    "session_of",
    "universal_state",
]
