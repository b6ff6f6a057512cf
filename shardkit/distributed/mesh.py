"""The process mesh: how the world is split into pipeline, data-, expert-, context- and
tensor-parallel ranks.

:class:`ParallelDims` describes the split (five degrees whose product is the world
size, and the expert-parallel degree ``ep`` that splits ``dp_shard``);
:class:`ProcessMesh` gives this rank's coordinates and creates the process groups of
any set of dimensions on demand.

[Note: the order of the dimensions]
Ranks are numbered row-major over ``(pp, dp_replicate, dp_shard, cp, tp)``: ``tp``
varies fastest, ``pp`` slowest, so::

    rank = (((pp_i * dp_replicate + dpr_i) * dp_shard + dps_i) * cp + cp_i) * tp + tp_i

Tensor-parallel ranks are therefore adjacent (``tp`` consecutive ranks form a group).
torchrun numbers one node's ranks consecutively, so with ``tp`` at most the GPUs per
node a tensor-parallel group stays inside a node: it carries the most frequent and
latency-bound traffic (two all-reduces of activations per transformer layer in
forward and two in backward, Shoeybi et al. 2019, section 3), which needs NVLink, not
the network. Context parallelism comes next (per layer it exchanges the attention's
q/k/v slices, Ulysses, or K/V blocks, ring attention). Data-parallel sharding (all-gather / reduce-scatter of parameters, once
per unit) comes next, replication (one gradient all-reduce per step) after it, and the
pipeline, which only sends activations between neighbouring stages, is outermost and
may cross the slowest links. This is Megatron-LM's and torchtitan's order.

[Note: expert parallelism splits dp_shard]
Expert parallelism does not multiply the world size (torchtitan's way): the ``ep``
ranks of an expert-parallel group are ``ep`` consecutive coordinates of one
``dp_shard`` group, so ``dp_shard = dp_shard_mod_ep x ep`` with ``ep`` the faster::

    dps_i = dps_mod_ep_i * ep + ep_i

The two derived groups are ``"ep"`` (the ranks that exchange tokens by all-to-all and
each hold ``1/ep`` of the experts) and ``"edp"``, expert data parallel: the ranks that
hold the *same* experts, ``dp_replicate x dp_shard_mod_ep`` of them, over which the
experts' gradients are reduced. ``ep`` and ``edp`` together are the data-parallel
ranks (``"dp"``). With ``ep = 1`` (the default) ``"ep"`` is every rank alone and
``"edp"`` is ``"dp"``; every other group is unchanged by ``ep``.

[Note: context parallelism and the data-parallel gradient reduction]
The ``cp`` ranks of a context-parallel group hold the same parameters and each sees
``1/cp`` of every sequence (torchtitan's layout). For the parameters they are therefore
data-parallel ranks: the gradient reduction and the parameter sharding of FSDP, OSS,
ShardedDDP and DDP run over the flattened group ``"dp_shard_cp"`` (``dp_shard x cp``
ranks), and hybrid sharding replicates over ``"dp_replicate"`` as before; the
attention's own exchanges run over ``"cp"``. ``"dp"`` stays the ranks that see
different *data* (``dp_replicate x dp_shard``): the data loader splits the batch over
``"dp"`` and the sequence over ``"cp"``. ``"dp_cp"`` (``dp_replicate x dp_shard x cp``)
is the DDP group. With ``cp = 1`` (the default) ``"dp_shard_cp"`` is ``"dp_shard"``,
``"dp_cp"`` is ``"dp"`` and ``"cp"`` is every rank alone.

[Note: creating groups]
``torch.distributed.new_group`` is a collective: every rank of the world must call it
for every group, in the same order, even for groups it is not part of (gloo and NCCL
both require it). :meth:`ProcessMesh.group` therefore creates *all* the groups of the
requested dimensions the first time any of them is asked for (on every rank, in
ascending order of their lowest rank) and keeps the one holding this rank; later calls
return the cached group. The first call for a set of dimensions must be made by every
rank, in the same order as the other ranks' first calls.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from shardkit.distributed.collectives import new_group

__all__ = ["GROUP_NAMES", "MESH_DIMS", "ParallelDims", "ProcessMesh"]

#: The mesh dimensions, outermost first (``tp`` is innermost: adjacent ranks).
MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

#: The finest split of the ranks: ``dp_shard`` cut into ``dp_shard_mod_ep x ep`` (see
#: ``[Note: expert parallelism splits dp_shard]``); row-major over these is the same
#: rank order as over :data:`MESH_DIMS`.
_FINE_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")

#: Every name :meth:`ParallelDims.group_ranks` and :class:`ProcessMesh` accept.
GROUP_NAMES: tuple[str, ...] = (*MESH_DIMS, "ep", "dp", "edp", "dp_shard_cp", "dp_cp")

#: What each accepted name is made of, in :data:`_FINE_DIMS`.
_TO_FINE: dict[str, tuple[str, ...]] = {
    "pp": ("pp",),
    "dp_replicate": ("dp_replicate",),
    "dp_shard": ("dp_shard_mod_ep", "ep"),
    "cp": ("cp",),
    "tp": ("tp",),
    "ep": ("ep",),
    "dp": ("dp_replicate", "dp_shard_mod_ep", "ep"),
    "edp": ("dp_replicate", "dp_shard_mod_ep"),
    "dp_shard_cp": ("dp_shard_mod_ep", "ep", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard_mod_ep", "ep", "cp"),
}


def fine_dims(dims: Iterable[str]) -> tuple[str, ...]:
    """``dims`` (any of :data:`GROUP_NAMES`, ``"ep"`` and ``"edp"`` included) as the
    finest dimensions they vary over, in mesh order, without repeats.

    Raises:
        ValueError: an unknown dimension name, listing the known ones.
    """
    names: set[str] = set()
    for d in dims:
        if d not in _TO_FINE:
            raise ValueError(f"unknown mesh dimension {d!r}; choose from {list(GROUP_NAMES)}")
        names.update(_TO_FINE[d])
    return tuple(d for d in _FINE_DIMS if d in names)


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of parallelism of a run; their product is the world size.

    Example:
        >>> ParallelDims(world_size=8, tp=2, pp=2).dp_shard   # inferred: 8 / (2 x 2)
        2

    Args:
        world_size: number of ranks.
        pp: pipeline-parallel degree (stages). Default 1.
        dp_replicate: data-parallel replicas (the replica groups of hybrid sharding;
            DDP). Default 1.
        dp_shard: data-parallel ranks sharding parameters / gradients / optimizer
            state (FSDP, OSS, ShardedDDP). Default -1: whatever is left,
            ``world_size / (pp x dp_replicate x cp x tp)``.
        tp: tensor-parallel degree (Megatron-LM's column / row split). Default 1.
        ep: expert-parallel degree: the ranks of a ``dp_shard`` group are cut into
            groups of ``ep`` consecutive ones, each holding all the experts between
            them (``1/ep`` each); not a factor of the world size (see ``[Note:
            expert parallelism splits dp_shard]``). Default 1 (no expert
            parallelism).
        cp: context-parallel degree: each sequence is split over ``cp`` ranks
            (Ulysses or ring attention, ``shardkit.nn.context_parallel``); they hold the
            same parameters and share the data-parallel gradient reduction (group
            ``"dp_shard_cp"``, see ``[Note: context parallelism and the data-parallel
            gradient reduction]``). Default 1.

    Raises:
        ValueError: a degree below 1 (other than ``dp_shard=-1``), degrees whose
            product is not the world size, ``cp`` not dividing the world size, or
            ``ep`` not dividing ``dp_shard``; the message spells out the equation.
    """

    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "pp", "dp_replicate", "tp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.world_size % self.cp != 0:
            raise ValueError(
                f"cp ({self.cp}) must divide the world size ({self.world_size}): each "
                f"sequence is split over cp ranks; choose cp among the divisors of "
                f"{self.world_size}"
            )
        others = self.pp * self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % others != 0:
                raise ValueError(
                    f"cannot infer dp_shard: world size {self.world_size} is not divisible "
                    f"by pp ({self.pp}) x dp_replicate ({self.dp_replicate}) x "
                    f"{self._cp_term()}tp ({self.tp}) = {others}"
                )
            object.__setattr__(self, "dp_shard", self.world_size // others)
        if self.dp_shard < 1:
            raise ValueError(f"dp_shard must be >= 1 or -1 (inferred); got {self.dp_shard}")
        product = others * self.dp_shard
        if product != self.world_size:
            raise ValueError(
                f"pp ({self.pp}) x dp_replicate ({self.dp_replicate}) x dp_shard "
                f"({self.dp_shard}) x {self._cp_term()}tp ({self.tp}) = {product}, but the "
                f"world size is {self.world_size}; choose degrees whose product is "
                f"{self.world_size}"
            )
        if self.dp_shard % self.ep != 0:
            raise ValueError(
                f"ep ({self.ep}) must divide dp_shard ({self.dp_shard}): expert parallelism "
                f"splits the data-parallel sharding ranks (dp_shard = dp_shard_mod_ep x ep); "
                f"choose ep among the divisors of {self.dp_shard}"
            )

    def _cp_term(self) -> str:
        """``"cp (N) x "`` for error messages, empty at ``cp = 1`` (the messages of a
        mesh without context parallelism stay as they were)."""
        return f"cp ({self.cp}) x " if self.cp != 1 else ""

    @property
    def degrees(self) -> tuple[int, ...]:
        """The degrees in mesh order ``(pp, dp_replicate, dp_shard, cp, tp)``."""
        return tuple(getattr(self, d) for d in MESH_DIMS)

    @property
    def dp(self) -> int:
        """The data-parallel degree ``dp_replicate x dp_shard`` (ranks seeing different data)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_cp(self) -> int:
        """The degree of the data-parallel gradient reduction ``dp_shard x cp``: the
        ranks that shard the parameters when context parallelism is on."""
        return self.dp_shard * self.cp

    @property
    def edp(self) -> int:
        """The expert-data-parallel degree ``dp_replicate x dp_shard / ep``: ranks
        holding the same experts."""
        return self.dp_replicate * (self.dp_shard // self.ep)

    def degree(self, *names: str) -> int:
        """The number of ranks in a group of ``names`` (any of :data:`GROUP_NAMES`;
        a dimension named twice, e.g. by ``"dp"`` and ``"ep"``, counts once).

        Raises:
            ValueError: an unknown name.
        """
        return math.prod(self._fine_degree(d) for d in fine_dims(names))

    def _fine_degree(self, fine: str) -> int:
        if fine == "dp_shard_mod_ep":
            return self.dp_shard // self.ep
        return int(getattr(self, fine))

    def coordinates(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` along every dimension (``tp`` varies fastest).

        Raises:
            ValueError: ``rank`` outside ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        coords: dict[str, int] = {}
        rest = rank
        for name, degree in zip(reversed(MESH_DIMS), reversed(self.degrees), strict=True):
            coords[name] = rest % degree
            rest //= degree
        return {d: coords[d] for d in MESH_DIMS}

    def rank_of(self, coords: dict[str, int]) -> int:
        """The rank at ``coords`` (missing dimensions are 0).

        Raises:
            ValueError: a coordinate outside its dimension's degree.
        """
        rank = 0
        for name, degree in zip(MESH_DIMS, self.degrees, strict=True):
            c = coords.get(name, 0)
            if not 0 <= c < degree:
                raise ValueError(f"coordinate {name}={c} is outside [0, {degree})")
            rank = rank * degree + c
        return rank

    def group_ranks(self, dims: Iterable[str]) -> list[list[int]]:
        """Every group of ``dims``: the ranks that differ only along ``dims`` (any of
        :data:`GROUP_NAMES`; ``"ep"`` and ``"edp"`` as in ``[Note: expert parallelism
        splits dp_shard]``).

        Groups are listed in ascending order of their lowest rank; inside a group the
        ranks ascend, so a rank's index in its group is its coordinate along ``dims``
        (row-major when ``dims`` has several dimensions).
        """
        varying = fine_dims(dims)
        fixed = [d for d in _FINE_DIMS if d not in varying]
        degrees = [self._fine_degree(d) for d in _FINE_DIMS]
        groups = []
        for fixed_coords in itertools.product(*(range(self._fine_degree(d)) for d in fixed)):
            base = dict(zip(fixed, fixed_coords, strict=True))
            ranks = []
            for vc in itertools.product(*(range(self._fine_degree(d)) for d in varying)):
                coords = {**base, **dict(zip(varying, vc, strict=True))}
                rank = 0
                for name, degree in zip(_FINE_DIMS, degrees, strict=True):
                    rank = rank * degree + coords[name]
                ranks.append(rank)
            groups.append(sorted(ranks))
        return sorted(groups)


class ProcessMesh:
    """This rank's place in a :class:`ParallelDims` split, and its process groups.

    Example:
        >>> mesh = ProcessMesh(ParallelDims(world_size=4, tp=2))   # doctest: +SKIP
        >>> mesh.coordinates          # rank 3: {'pp': 0, 'dp_replicate': 0, 'dp_shard': 1, 'cp': 0, 'tp': 1}
        >>> tp_group = mesh.group("tp")              # ranks (2, 3) on rank 3
        >>> dp_group = mesh.group("dp")              # ranks (1, 3) on rank 3

    Every wrapper that takes a ``process_group`` takes a group of the mesh, e.g.
    ``FullyShardedDataParallel(module, process_group=mesh.group("dp_shard"))``.

    Args:
        dims: the split; its ``world_size`` must equal the default group's.
        backend: backend of the groups; default None (the default group's).
        timeout: collective timeout of the groups; default None (the default group's,
            e.g. ``init_process_group(timeout=...)``; torch alone would give 30 minutes).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: ``dims.world_size`` is not the world size.
    """

    def __init__(
        self,
        dims: ParallelDims,
        *,
        backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ProcessMesh needs torch.distributed initialised first "
                "(torch.distributed.init_process_group, or torchrun)"
            )
        world = dist.get_world_size()
        if dims.world_size != world:
            raise ValueError(
                f"ParallelDims is for {dims.world_size} ranks but the world has {world}; "
                f"build it with world_size={world}"
            )
        self.dims = dims
        self.rank = dist.get_rank()
        self.coordinates = dims.coordinates(self.rank)
        self._backend = backend
        self._timeout = timeout
        self._groups: dict[tuple[str, ...], tuple[dist.ProcessGroup, list[int]]] = {}
        self._created: list[dist.ProcessGroup] = []
        self._destroyed = False  # see [Note: destroying a mesh]

    def _key(self, dims: Iterable[str]) -> tuple[str, ...]:
        """The cache key of ``dims``: their fine dimensions, without ``cp`` at ``cp = 1``
        (so ``"dp_cp"`` is the very group ``"dp"`` is, and ``"dp_shard_cp"``
        ``"dp_shard"``'s, when there is no context parallelism)."""
        return tuple(d for d in fine_dims(dims) if d != "cp" or self.dims.cp > 1)

    def _entry(
        self, dims: tuple[str, ...], backend: str | None
    ) -> tuple[dist.ProcessGroup, list[int]]:
        key = self._key(dims)
        if key not in self._groups:
            mine: tuple[dist.ProcessGroup, list[int]] | None = None
            for ranks in self.dims.group_ranks(dims):  # every rank, every group, same order
                if len(ranks) == self.dims.world_size:
                    pg = dist.group.WORLD
                    assert pg is not None
                else:
                    pg = new_group(ranks, backend=backend or self._backend, timeout=self._timeout)
                    self._created.append(pg)
                if self.rank in ranks:
                    mine = (pg, ranks)
            assert mine is not None
            self._groups[key] = mine
        return self._groups[key]

    def group(self, *dims: str, backend: str | None = None) -> dist.ProcessGroup:
        """The process group of the ranks that differ from this one only along ``dims``
        (``"dp"`` means ``dp_replicate`` and ``dp_shard``; ``"ep"`` and ``"edp"`` are the
        expert-parallel groups, see ``[Note: expert parallelism splits dp_shard]``;
        ``"dp_shard_cp"`` and ``"dp_cp"`` the data-parallel groups with the
        context-parallel ranks, see ``[Note: context parallelism and the data-parallel
        gradient reduction]``).

        A collective the first time a set of dimensions is asked for (see
        ``[Note: creating groups]``); cached afterwards. The whole world is returned as
        ``torch.distributed.group.WORLD``.

        Args:
            dims: dimension names, in any order.
            backend: backend for this set's groups when they are created; default None
                (the mesh's).

        Raises:
            ValueError: an unknown dimension, or no dimension.
            RuntimeError: the mesh was destroyed (:meth:`destroy`).
        """
        if not dims:
            raise ValueError(f"name at least one dimension of {list(GROUP_NAMES)}")
        if self._destroyed:
            raise RuntimeError(
                f"{self!r} was destroyed (ProcessMesh.destroy()): its groups are gone, and "
                f"making the {'/'.join(dims)} group again would be a collective the other "
                "ranks do not enter; build a new ProcessMesh for new groups"
            )
        return self._entry(dims, backend)[0]

    def ranks(self, *dims: str) -> list[int]:
        """The global ranks of this rank's group of ``dims``, ascending (no collective)."""
        key = self._key(dims)
        if key in self._groups:
            return list(self._groups[key][1])
        return next(r for r in self.dims.group_ranks(dims) if self.rank in r)

    def size(self, *dims: str) -> int:
        """The product of the degrees of ``dims`` (the size of their group)."""
        return self.dims.degree(*dims)

    def local_rank(self, *dims: str) -> int:
        """This rank's index in its group of ``dims`` (row-major over them)."""
        return self.ranks(*dims).index(self.rank)

    def destroy(self) -> None:
        """Destroy the groups this mesh created (not the world); :meth:`group` refuses
        afterwards (idempotent; local to this rank, no collective).

        See ``[Note: destroying a mesh]`` for the wrappers still built on the groups.
        """
        for pg in self._created:
            dist.destroy_process_group(pg)
        self._created.clear()
        self._groups.clear()
        self._destroyed = True

    # [Note: destroying a mesh]
    # ``destroy`` shuts down each created group at once (gloo: no wait, even with a
    # collective of this rank in flight, whose wait then fails with "connection
    # closed"). A later ``group()`` would make new groups: ``new_group`` is a collective
    # of the whole world, so one rank asking lazily (the mpu view, a wrapper holding the
    # mesh) would wait alone until the timeout, and its peers in their next collective:
    # a hang. So ``group()`` raises instead, on the asking rank, without communicating. Wrappers built on the groups are not tracked (torch 2.13, gloo,
    # measured): torch's DDP keeps the group object and goes on reducing over it;
    # shardkit's FSDP and ShardedDDP raise torch's "not registered" ValueError at their
    # next collective, on every rank. Delete them before ``destroy``.

    def __repr__(self) -> str:
        names = [d for d in MESH_DIMS if d != "cp" or self.dims.cp != 1]
        if self.dims.ep != 1:
            names.append("ep")
        degrees = ", ".join(f"{d}={getattr(self.dims, d)}" for d in names)
        return f"ProcessMesh({degrees}; rank {self.rank} at {self.coordinates})"
