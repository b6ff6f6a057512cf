"""The model-parallel unit (``mpu``): Megatron-LM / DeepSpeed and FairScale group queries.

Two interfaces over one :class:`~shardkit.distributed.mesh.ProcessMesh`:

- :class:`ModelParallelUnit`, the object DeepSpeed (``deepspeed.initialize(mpu=...)``)
  and Megatron-LM code ask for groups: ``get_tensor_model_parallel_*``,
  ``get_pipeline_model_parallel_*`` / ``get_pipe_parallel_*``, ``get_data_parallel_*``
  (Megatron-LM's ``with_context_parallel``), ``get_context_parallel_*``,
  ``get_model_parallel_*``.
- FairScale's module-level ``fairscale.nn.model_parallel.initialize`` family:
  :func:`initialize_model_parallel` (with FairScale 0.4.13's ``context_parallel_size``:
  the mesh's ``cp`` dimension), :func:`get_model_parallel_group`, ...,
  :func:`get_context_parallel_group` (and its size, rank and ranks),
  :func:`destroy_model_parallel`, holding one process-wide mesh.

Every group comes from the one mesh (:meth:`ProcessMesh.group`); this module creates
none of its own.

[Note: what "model parallel" means]
The name differs between the codebases users come from, and shardkit follows each:

| call | ranks in the group |
|---|---|
| ``mpu.get_tensor_model_parallel_group()`` | tensor-parallel (``tp``) |
| ``mpu.get_model_parallel_group()`` | ``tp x pp`` (Megatron-LM, DeepSpeed: "both intra- and pipeline") |
| ``get_model_parallel_group()`` (module) | ``tp`` only (FairScale) |
| ``get_data_parallel_group()`` (both) | ``dp_replicate x dp_shard`` |
| ``mpu.get_data_parallel_group(with_context_parallel=True)`` | ``dp_replicate x dp_shard x cp`` (Megatron-LM: the gradient reduction) |
| ``get_context_parallel_group()`` (both) | ``cp`` (the ranks splitting each sequence) |
| ``get_pipeline_parallel_group()`` (module) | ``pp`` (FairScale's name) |

With one pipeline stage (the common case) the two meanings of "model parallel" agree.

Rank layout: shardkit's mesh order (``pp`` outermost, ``tp`` innermost, as Megatron-LM);
FairScale's own layout put data parallelism outermost and the pipeline in the middle
(``dp, pp, cp, tp``). Tensor-parallel groups are the same in both (consecutive
ranks), and so are the context-parallel groups when there is one pipeline stage
(``cp`` ranks ``tp`` apart); data and pipeline groups hold other ranks when both
degrees exceed 1, so code that hard-codes global ranks of FairScale's pipeline groups
must read them from :func:`get_pipeline_parallel_ranks` instead.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from shardkit.distributed.mesh import ParallelDims, ProcessMesh

__all__ = [
    "ModelParallelUnit",
    "destroy_model_parallel",
    "get_context_parallel_group",
    "get_context_parallel_rank",
    "get_context_parallel_ranks",
    "get_context_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_ranks",
    "get_data_parallel_world_size",
    "get_mesh",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_src_rank",
    "get_model_parallel_world_size",
    "get_mpu",
    "get_pipeline_parallel_group",
    "get_pipeline_parallel_ranks",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "set_mesh",
]


class ModelParallelUnit:
    """Megatron-LM / DeepSpeed's ``mpu`` interface over a :class:`ProcessMesh`.

    Example:
        >>> mesh = ProcessMesh(ParallelDims(world_size=8, tp=2, pp=2))   # doctest: +SKIP
        >>> mpu = ModelParallelUnit(mesh)
        >>> engine, *_ = deepspeed.initialize(model=model, mpu=mpu, ...)

    Ranks are within the group (0-based); the first call of each ``*_group`` /
    ``*_rank`` family is a collective on every rank (groups are created on demand,
    see :mod:`shardkit.distributed.mesh`).

    Args:
        mesh: the process mesh.
    """

    def __init__(self, mesh: ProcessMesh) -> None:
        self.mesh = mesh

    # tensor parallel (Megatron "tensor model parallel", DeepSpeed "slice parallel")
    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self.mesh.group("tp")

    def get_tensor_model_parallel_rank(self) -> int:
        return self.mesh.coordinates["tp"]

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.mesh.dims.tp

    def get_tensor_model_parallel_src_rank(self) -> int:
        """The global rank of tensor-parallel rank 0 in this rank's group."""
        return self.mesh.ranks("tp")[0]

    get_slice_parallel_group = get_tensor_model_parallel_group
    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size

    # pipeline
    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup:
        return self.mesh.group("pp")

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.mesh.coordinates["pp"]

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.mesh.dims.pp

    def is_pipeline_first_stage(self) -> bool:
        return self.get_pipeline_model_parallel_rank() == 0

    def is_pipeline_last_stage(self) -> bool:
        return self.get_pipeline_model_parallel_rank() == self.mesh.dims.pp - 1

    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size

    # data parallel (replicate x shard; with_context_parallel: x cp, Megatron-LM's flag)
    def get_data_parallel_group(self, with_context_parallel: bool = False) -> dist.ProcessGroup:
        """The ranks seeing different data (``"dp"``); ``with_context_parallel``: also
        the context-parallel ranks (``"dp_cp"``, the gradient reduction). Default False."""
        return self.mesh.group(_dp_name(with_context_parallel))

    def get_data_parallel_rank(self, with_context_parallel: bool = False) -> int:
        return self.mesh.local_rank(_dp_name(with_context_parallel))

    def get_data_parallel_world_size(self, with_context_parallel: bool = False) -> int:
        return self.mesh.size(_dp_name(with_context_parallel))

    # context parallel (Megatron-LM's names)
    def get_context_parallel_group(self) -> dist.ProcessGroup:
        return self.mesh.group("cp")

    def get_context_parallel_rank(self) -> int:
        return self.mesh.coordinates["cp"]

    def get_context_parallel_world_size(self) -> int:
        return self.mesh.dims.cp

    def get_context_parallel_global_ranks(self) -> list[int]:
        """The global ranks of this rank's context-parallel group, ascending."""
        return self.mesh.ranks("cp")

    # model parallel: tensor x pipeline (Megatron-LM and DeepSpeed's meaning)
    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.mesh.group("tp", "pp")

    def get_model_parallel_rank(self) -> int:
        return self.mesh.local_rank("tp", "pp")

    def get_model_parallel_world_size(self) -> int:
        return self.mesh.size("tp", "pp")

    def __repr__(self) -> str:
        return f"ModelParallelUnit({self.mesh!r})"


def _dp_name(with_context_parallel: bool) -> str:
    return "dp_cp" if with_context_parallel else "dp"


_MESH: list[ProcessMesh | None] = [None]


def set_mesh(mesh: ProcessMesh | None) -> None:
    """Make ``mesh`` the process-wide mesh the FairScale-style functions (and the
    tensor-parallel layers' default group) use; None forgets it (without destroying)."""
    _MESH[0] = mesh


def get_mesh() -> ProcessMesh:
    """The process-wide mesh.

    Raises:
        RuntimeError: none is set (call :func:`initialize_model_parallel` or :func:`set_mesh`).
    """
    mesh = _MESH[0]
    if mesh is None:
        raise RuntimeError(
            "model parallel is not initialized: call "
            "shardkit.distributed.mpu.initialize_model_parallel(model_parallel_size) or "
            "set_mesh(ProcessMesh(...)) first"
        )
    return mesh


def get_mpu() -> ModelParallelUnit:
    """The :class:`ModelParallelUnit` of the process-wide mesh (for ``deepspeed.initialize``)."""
    return ModelParallelUnit(get_mesh())


def initialize_model_parallel(
    model_parallel_size_: int,
    pipeline_length: int = 1,
    context_parallel_size: int = 1,
    *,
    model_parallel_backend: str | None = None,
    pipeline_backend: str | None = None,
    cp_backend: str | None = None,
    ddp_backend: str | None = None,
    timeout: timedelta | None = None,
) -> ProcessMesh:
    """FairScale's ``initialize_model_parallel``: split the world into tensor-parallel
    groups of ``model_parallel_size_`` ranks, ``pipeline_length`` stages,
    context-parallel groups of ``context_parallel_size`` ranks, and data parallelism
    over the rest (``dp_shard``), and create the groups (a collective on every rank).

    FairScale 0.4.13's full signature. The groups are those of one
    :class:`~shardkit.distributed.mesh.ProcessMesh` with ``cp = context_parallel_size``
    (``[Note: the order of the dimensions]`` there): a context-parallel group is
    ``context_parallel_size`` ranks ``model_parallel_size_`` apart, as in FairScale's
    layout when ``pipeline_length`` is 1. :func:`get_context_parallel_group` and its
    siblings return it (at size 1: this rank alone, size 1, rank 0). The context-parallel
    ranks hold the same parameters, so reduce gradients over
    ``get_mpu().get_data_parallel_group(with_context_parallel=True)``; the data loader
    splits the batch over :func:`get_data_parallel_group` and each sequence over the
    context-parallel group (``shardkit.nn.context_parallel``).

    Example::

        initialize_model_parallel(2, context_parallel_size=2)   # 8 ranks: tp 2, cp 2, dp 2
        attn = DistributedAttention(local_attn, get_context_parallel_group())

    Args:
        model_parallel_size_: tensor-parallel degree.
        pipeline_length: pipeline-parallel degree. Default 1.
        context_parallel_size: context-parallel degree (the mesh's ``cp``). Default 1.
        model_parallel_backend: backend of the tensor-parallel groups; default None
            (the default group's).
        pipeline_backend: backend of the pipeline groups; default None.
        cp_backend: backend of the context-parallel groups; default None.
        ddp_backend: backend of the data-parallel groups; default None.
        timeout: collective timeout of every group created here; default None (torch's
            default, 30 minutes).

    Returns:
        The mesh (also reachable through :func:`get_mesh`).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised, or model parallel is
            already initialised (call :func:`destroy_model_parallel` first).
        ValueError: the world size is not divisible by ``model_parallel_size_ x
            pipeline_length x context_parallel_size`` (the message gives the
            equation), or ``context_parallel_size`` is below 1.
    """
    if context_parallel_size < 1:
        raise ValueError(f"context_parallel_size must be >= 1; got {context_parallel_size}")
    if _MESH[0] is not None:
        raise RuntimeError(
            "model parallel is already initialized; call destroy_model_parallel() first"
        )
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed initialised first")
    dims = ParallelDims(
        world_size=dist.get_world_size(),
        pp=pipeline_length,
        tp=model_parallel_size_,
        cp=context_parallel_size,
    )
    mesh = ProcessMesh(dims, timeout=timeout)
    mesh.group("tp", backend=model_parallel_backend)
    mesh.group("pp", backend=pipeline_backend)
    mesh.group("cp", backend=cp_backend)
    mesh.group("dp", backend=ddp_backend)
    mesh.group("dp_cp", backend=ddp_backend)  # the gradient reduction (the same at cp 1)
    set_mesh(mesh)
    return mesh


def model_parallel_is_initialized() -> bool:
    """Whether a process-wide mesh is set."""
    return _MESH[0] is not None


def get_model_parallel_group() -> dist.ProcessGroup:
    """The tensor-parallel group (FairScale's "model parallel")."""
    return get_mesh().group("tp")


def get_model_parallel_rank() -> int:
    """This rank's tensor-parallel rank."""
    return get_mesh().coordinates["tp"]


def get_model_parallel_world_size() -> int:
    """The tensor-parallel degree."""
    return get_mesh().dims.tp


def get_model_parallel_src_rank() -> int:
    """The global rank of tensor-parallel rank 0 in this rank's group."""
    return get_mesh().ranks("tp")[0]


def get_data_parallel_group() -> dist.ProcessGroup:
    """The data-parallel group (``dp_replicate x dp_shard``)."""
    return get_mesh().group("dp")


def get_data_parallel_rank() -> int:
    """This rank's data-parallel rank."""
    return get_mesh().local_rank("dp")


def get_data_parallel_world_size() -> int:
    """The data-parallel degree."""
    return get_mesh().dims.dp


def get_pipeline_parallel_group() -> dist.ProcessGroup:
    """The pipeline group (the ``pp`` ranks holding the stages of one model replica)."""
    return get_mesh().group("pp")


def get_pipeline_parallel_ranks() -> list[int]:
    """The global ranks of this rank's pipeline group, stage 0 first."""
    return get_mesh().ranks("pp")


def get_data_parallel_ranks() -> list[int]:
    """The global ranks of this rank's data-parallel group, ascending."""
    return get_mesh().ranks("dp")


def get_context_parallel_group() -> dist.ProcessGroup:
    """The context-parallel group: the mesh's ``"cp"`` ranks, which split each sequence
    (this rank alone when ``context_parallel_size`` is 1). The first call on a mesh set
    by :func:`set_mesh` creates the groups: a collective, on every rank.

    Raises:
        RuntimeError: model parallel is not initialized.
    """
    return get_mesh().group("cp")


def get_context_parallel_world_size() -> int:
    """The context-parallel degree (``context_parallel_size``)."""
    return get_mesh().dims.cp


def get_context_parallel_rank() -> int:
    """This rank's index in its context-parallel group (its ``cp`` coordinate)."""
    return get_mesh().coordinates["cp"]


def get_context_parallel_ranks() -> list[int]:
    """The global ranks of this rank's context-parallel group, ascending."""
    return get_mesh().ranks("cp")


def destroy_model_parallel() -> None:
    """Destroy the groups of the process-wide mesh and forget it (no-op when none is set)."""
    mesh = _MESH[0]
    if mesh is not None:
        mesh.destroy()
    set_mesh(None)
