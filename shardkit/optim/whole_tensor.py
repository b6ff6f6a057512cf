"""WholeTensorOptimizer: optimizers that need each parameter whole (Muon, Adafactor,
LAMB), exact under FSDP's flat shards, with their state sharded across ranks.

[Note: which optimizers need whole tensors]
An element-wise optimizer (SGD, Adam, AdamW, Adagrad, RMSprop) updates each element
from that element's gradient and state alone, so stepping FSDP's 1-D shard of a
parameter is exact. Muon orthogonalises each 2-D gradient (Newton-Schulz; Jordan et al.
2024, and ``torch.optim.Muon``), Adafactor factors the second moment of each matrix into
row and column means (Shazeer and Stern 2018, section 3), LAMB and LARS scale each
tensor's update by the ratio of norms (You et al. 2020, algorithm 2): on a piece they
compute something else, or raise (Muon: "only supports 2D parameters").
:func:`needs_whole_tensors` tells them apart: a class attribute
``needs_whole_tensors = True`` (write it on your own LAMB), else ``torch.optim.Muon``
and ``torch.optim.Adafactor`` (and their subclasses). FSDP refuses, at the first step
and before any update, a plain optimizer that needs whole tensors over its flat shards.

[Note: the step]
Under ZeRO-1/2 (``OSS``, ``ShardedDataParallel``) each rank holds every parameter
whole, so the owner's local optimizer already steps whole tensors: wrap Muon or
Adafactor in ``OSS`` as any optimizer. Under ZeRO-3 (FSDP) :class:`WholeTensorOptimizer`
gives each whole-tensor parameter one owner rank (the rank already holding most of it,
balanced by elements like OSS's partition), and at each step:

1. the gradient pieces (already reduce-scattered and averaged by FSDP's backward) and
   the parameter pieces are sent to the owners in one ``all_to_all_single``;
2. each owner steps its whole tensors with the wrapped optimizer (its state lives only
   there: about 1/N of the state per rank, plus the owner's whole copy of the
   parameters it owns, about 1/N of the parameters);
3. the updated values are sent back to the shards in a second ``all_to_all_single``.

Param groups of an element-wise class step the flat shards directly, with no
communication (today's path and speed). Bytes per step: three times the elements held
away from their owner, at most ``3 / N`` of FSDP's reduce-scatter of the same
parameters (see ``[Note: pieces, owners, exchange]`` in
:mod:`shardkit.optim.whole_tensor_exchange`). The layout (which range of which
parameter each rank holds) is read once, at construction, from the model's
universal-checkpoint adapter (``shardkit.checkpoint.universal.layout``), the one
description every wrapper gives of its pieces.

Source: the owner-computes scheme of the distributed Muon in modded-nanogpt and
nanochat (``DistMuonAdamW``: each rank owns a share of the matrices, receives their
averaged gradients, orthogonalises them and all-gathers the update), here over FSDP's
existing shards instead of a separate gradient reduction; DeepSpeed applies Muon in
ZeRO-1/2 only, where each parameter's gradient is still whole (as ``OSS`` does here).
ZeRO: Rajbhandari et al. 2020, section 5.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.profiler import record_function

from shardkit.checkpoint.universal.adapters import PlainLayout
from shardkit.checkpoint.universal.layout import LayoutAdapter, factory_of
from shardkit.distributed.collectives import group_rank, group_size
from shardkit.optim.whole_tensor_exchange import ExchangePlan, Pieces, all_to_all, plan_exchange

__all__ = ["WholeTensorOptimizer", "model_layout", "needs_whole_tensors"]

_KNOWN: tuple[type[Optimizer], ...] = (torch.optim.Muon, torch.optim.Adafactor)


def needs_whole_tensors(optim: Optimizer | type) -> bool:
    """Whether ``optim`` (an optimizer or its class) must see each parameter whole.

    The class attribute ``needs_whole_tensors`` decides when present; else True for
    ``torch.optim.Muon`` and ``torch.optim.Adafactor`` and their subclasses.
    """
    cls = optim if isinstance(optim, type) else type(optim)
    declared = getattr(cls, "needs_whole_tensors", None)
    if declared is not None:
        return bool(declared)
    return issubclass(cls, _KNOWN)


def model_layout(
    model: nn.Module, optimizer: Any, group: dist.ProcessGroup | None
) -> LayoutAdapter:
    """The universal-checkpoint layout of ``model`` stepped by ``optimizer``: the one
    registered for ``model``'s type (FSDP's), else a plain module's over ``group``
    (every rank holds every tensor; in one process each parameter is one whole piece).

    Raises:
        TypeError: ``model`` is no ``nn.Module`` and no layout is registered for it.
    """
    factory = factory_of(model)
    if factory is not None:
        return factory(model, optimizer)
    if not isinstance(model, nn.Module):
        raise TypeError(f"WholeTensorOptimizer: no universal layout for {type(model).__name__}")
    return PlainLayout(model, group=group)


class _Holding:
    """What a layout adapter reads of an optimizer to know its parameters."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.param_groups = [{"params": list(params)}]


class _JoinedState(MutableMapping[torch.Tensor, Any]):
    """The state of the inner optimizers, keyed by the tensors they step."""

    def __init__(self, route: dict[int, Optimizer]) -> None:
        self._route = route

    def _inner(self, param: torch.Tensor) -> Optimizer:
        inner = self._route.get(id(param))
        if inner is None:
            raise KeyError(param)
        return inner

    def __getitem__(self, param: torch.Tensor) -> Any:
        return self._inner(param).state[param]

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        self._inner(param).state[param] = value

    def __delitem__(self, param: torch.Tensor) -> None:
        del self._inner(param).state[param]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for inner in dict.fromkeys(self._route.values()):
            yield from list(inner.state)

    def __len__(self) -> int:
        return sum(len(inner.state) for inner in dict.fromkeys(self._route.values()))


def _optim_of(group: dict[str, Any], index: int) -> type[Optimizer]:
    optim = group.get("optim")
    if isinstance(optim, type) and issubclass(optim, Optimizer):
        return optim
    raise TypeError(
        f"param group {index} of WholeTensorOptimizer needs 'optim', an optimizer class "
        f"(e.g. torch.optim.Muon); got {optim!r}. Example: [{{'params': matrices, 'optim': "
        "torch.optim.Muon, 'lr': 0.02}, {'params': rest, 'optim': torch.optim.AdamW, 'lr': 3e-4}]"
    )


def _hyper(group: dict[str, Any], optim: type[Optimizer] | None = None) -> dict[str, Any]:
    """A group's hyperparameters; with ``optim``, those its constructor takes (a torch
    group holds more: AdamW's ``decoupled_weight_decay``, a scheduler's ``initial_lr``)."""
    hyper = {k: v for k, v in group.items() if k not in ("params", "optim")}
    args = inspect.signature(optim.__init__).parameters if optim is not None else {}
    if not args or any(a.kind is a.VAR_KEYWORD for a in args.values()):
        return hyper
    return {k: v for k, v in hyper.items() if k in args}


class WholeTensorOptimizer(Optimizer):
    """Step FSDP's sharded parameters with optimizers that need whole tensors, exactly.

    Example::

        model = FSDP(model, process_group=shard_group)
        names = {n for n, p in plain_model.named_parameters() if p.ndim == 2}
        matrices = [p for n, p in model.named_parameters() if n in names]
        rest = [p for n, p in model.named_parameters() if n not in names]
        optimizer = WholeTensorOptimizer(model, [
            {"params": matrices, "optim": torch.optim.Muon, "lr": 0.02},
            {"params": rest, "optim": torch.optim.AdamW, "lr": 3e-4},
        ], process_group=shard_group)

    Where every rank holds its parameters whole (a plain model, torch DDP, or as the
    local optimizer of ``OSS`` / ``ShardedDataParallel``), pass the param groups
    alone: each group steps its parameters with its class, with no communication::

        optimizer = OSS(groups, optim=WholeTensorOptimizer)   # ZeRO-1/2: owners step
        optimizer = WholeTensorOptimizer(groups)              # DDP: every rank steps

    Each param group names its optimizer class under ``"optim"``; its other keys are
    the class's arguments. A group whose class needs whole tensors
    (:func:`needs_whole_tensors`) is stepped by owner ranks on whole tensors (see the
    module's ``[Note: the step]``); any other group steps the shards as a plain
    optimizer would. ``param_groups`` is the user's view (an LR scheduler changes it;
    the change reaches the next step); ``state`` holds this rank's state: element-wise
    groups' shards, and the whole tensors this rank owns.

    Args:
        model: the root FSDP module whose parameters are stepped (any module with a
            universal-checkpoint layout whose pieces partition each parameter over
            ``process_group``), or a plain module in one process (each parameter
            whole: the single-process reference of a sharded run, or a resume of its
            universal checkpoint); or, with ``param_groups`` left out, the param
            groups themselves: no model, each parameter held whole on this rank.
        param_groups: param-group dicts, each with ``"params"`` (parameters of
            ``model``, as ``model.named_parameters()`` returns them) and ``"optim"``;
            default None (``model`` is the param groups).
        process_group: the group the parameters are sharded over (FSDP's
            ``process_group``; with hybrid sharding its shard group); default None
            (the world group). Unused without a model.
        **defaults: hyperparameters of every group that does not set them (what
            ``OSS(groups, optim=WholeTensorOptimizer, **defaults)`` passes on).

    Raises:
        TypeError: a group without an optimizer class; a model that is no
            ``nn.Module`` and has no registered layout; a model without param groups.
        ValueError: a whole-tensor parameter that is not ``model``'s, is a
            tensor-parallel part, or whose pieces over ``process_group`` do not cover
            it exactly once (a parameter held whole, or the wrong group); the whole
            tensors differ in dtype; the inner class's own errors.

    Memory per rank: the element-wise groups' state as without this wrapper; the
    whole-tensor groups' state of the owned parameters (about 1/N) and one whole copy
    of each owned parameter and its gradient during the step (about 1/N each).
    """

    needs_whole_tensors = False  # it is the path that gives them whole tensors

    def __init__(
        self,
        model: nn.Module | Iterable[dict[str, Any]],
        param_groups: Iterable[dict[str, Any]] | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        **defaults: Any,
    ) -> None:
        held: nn.Module | None
        if param_groups is None:  # WholeTensorOptimizer(param_groups): every tensor whole here
            if isinstance(model, nn.Module):
                raise TypeError(
                    f"WholeTensorOptimizer({type(model).__name__}) got no param groups: pass "
                    "WholeTensorOptimizer(model, param_groups, process_group=...) over FSDP's "
                    "shards, or WholeTensorOptimizer(param_groups) where each rank holds the "
                    "parameters whole"
                )
            held, param_groups = None, model
        else:
            held = cast(nn.Module, model)
        groups = [{**defaults, **g} for g in param_groups]
        classes = [_optim_of(g, i) for i, g in enumerate(groups)]
        super().__init__(groups, {})
        self.process_group = process_group
        alone = not dist.is_initialized()
        self.rank = 0 if alone else group_rank(process_group)
        self.world_size = 1 if alone else group_size(process_group)
        whole = [needs_whole_tensors(c) for c in classes]
        self.model = held
        self.plan: ExchangePlan = plan_exchange([], self.rank, self.world_size)
        self._sharded: list[torch.Tensor] = []
        self.writes: dict[str, bool] = {}
        if held is not None:  # else nothing to exchange: no collective, no whole copies
            self.plan, self._sharded, self.writes = self._read_layout(held, whole)
        self._proxies = self._make_proxies()
        self._inners = [
            self._build_inner(g, c, w) for g, c, w in zip(self.param_groups, classes, whole)
        ]
        self._route = {
            id(p): inner for inner in self._inners for p in inner.param_groups[0]["params"]
        }
        self.whole_groups = whole
        if len(set(classes)) == 1:  # the universal checkpoint records the class stepped
            self.optimizer_class = classes[0]  # (loads into OSS(optim=it) and back)

    # construction ----------------------------------------------------------------
    def _read_layout(
        self, model: nn.Module, whole: list[bool]
    ) -> tuple[ExchangePlan, list[torch.Tensor], dict[str, bool]]:
        wanted = {id(p) for g, w in zip(self.param_groups, whole) if w for p in g["params"]}
        holding = _Holding(p for g in self.param_groups for p in g["params"])
        adapter = model_layout(model, holding, self.process_group)
        found: dict[int, tuple[str, tuple[int, ...], int, int, bool, torch.Tensor]] = {}
        for e in adapter.entries():
            if e.param is None or id(e.param) not in wanted:
                continue
            if e.view.split_dim is not None:
                raise ValueError(
                    f"parameter `{e.key}` is a tensor-parallel part {e.view}: a whole-tensor "
                    "optimizer would step the part; step it with an element-wise optimizer"
                )
            start, stop, write = e.start, e.stop, e.write
            if id(e.param) in found:  # several pieces on this rank (DDP spreads its writes)
                _, _, a, b, w, _ = found[id(e.param)]
                start, stop, write = min(a, start), max(b, stop), w or write
            found[id(e.param)] = (e.key, e.view.local_shape, start, stop, write, e.param)
        if len(found) != len(wanted):
            raise ValueError(
                f"WholeTensorOptimizer: {len(wanted) - len(found)} of the whole-tensor groups' "
                f"parameters are not parameters of {type(model).__name__}: pass the wrapped "
                "model's parameters (model.named_parameters() after wrapping)"
            )
        order = list(found.values())
        mine = {key: (start, stop, write) for key, _, start, stop, write, _ in order}
        every = [mine]
        if self.world_size > 1:
            every = [{} for _ in range(self.world_size)]
            dist.all_gather_object(every, mine, group=self.process_group)
        pieces = [Pieces(key, shape, tuple(r[key][:2] for r in every)) for key, shape, *_ in order]
        writes = {key: any(r[key][2] for r in every) for key in mine}
        plan = plan_exchange(pieces, self.rank, self.world_size)
        dtypes = {str(item[5].dtype) for item in order}
        if len(dtypes) > 1:
            raise ValueError(
                f"the whole-tensor parameters must share one dtype; got {sorted(dtypes)}"
            )
        return plan, [item[5] for item in order], writes

    def _make_proxies(self) -> dict[int, nn.Parameter]:
        proxies = {}
        for i in self.plan.owned(self.rank):
            like = self._sharded[i]
            whole = torch.zeros(self.plan.params[i].shape, dtype=like.dtype, device=like.device)
            proxies[i] = nn.Parameter(whole, requires_grad=like.requires_grad)
        return proxies

    def _build_inner(self, group: dict[str, Any], optim: type[Optimizer], whole: bool) -> Optimizer:
        params = group["params"]
        if whole and self.model is not None:
            index = {id(p): i for i, p in enumerate(self._sharded)}
            params = [self._proxies[index[id(p)]] for p in params if index[id(p)] in self._proxies]
        inner = optim([{"params": params}], **_hyper(group, optim))
        inner.param_groups[0].update(_hyper(group))  # the keys the constructor does not take
        for k, v in inner.param_groups[0].items():
            group.setdefault(k, v)
        return inner

    # views -------------------------------------------------------------------------
    @property  # type: ignore[override]
    def state(self) -> MutableMapping[torch.Tensor, Any]:
        """This rank's optimizer state: element-wise groups' shards and the whole
        tensors this rank owns (keyed by the owner's whole copy)."""
        route = self.__dict__.get("_route")
        if route is None:
            return self.__dict__["_bootstrap_state"]  # type: ignore[no-any-return]
        return _JoinedState(route)

    @state.setter
    def state(self, value: Any) -> None:
        self.__dict__["_bootstrap_state"] = value  # only torch's constructor sets it

    @property
    def state_param_groups(self) -> list[list[torch.Tensor]]:
        """Per param group, the tensors its state is keyed by on this rank (the
        universal checkpoint reads it: ``optimizer_params``)."""
        return [list(inner.param_groups[0]["params"]) for inner in self._inners]

    def owned_whole(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(key, whole copy)`` of every parameter this rank owns."""
        for i, proxy in self._proxies.items():
            yield self.plan.params[i].key, proxy

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only at construction: the owners are planned over every group at once.

        Raises:
            RuntimeError: after construction (build a new WholeTensorOptimizer).
        """
        if "_inners" in self.__dict__:
            raise RuntimeError(
                "WholeTensorOptimizer.add_param_group after construction: the owners are "
                "planned over all groups at once; build a new WholeTensorOptimizer"
            )
        super().add_param_group(param_group)

    # step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Gather whole gradients to the owners, step every group, scatter the update.

        A collective over ``process_group`` when any group needs whole tensors.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with record_function("WholeTensorOptimizer::step"):
            self._push_hyperparameters()
            if self.plan.params:
                self.gather_to_owners(with_grads=True)
            for inner in self._inners:
                inner.step()
            if self.plan.params:
                self.scatter_from_owners()
        return loss

    def _push_hyperparameters(self) -> None:
        """The user's view of each group (an LR scheduler's changes) to its inner optimizer."""
        for group, inner in zip(self.param_groups, self._inners):
            inner.param_groups[0].update(_hyper(group))

    def gather_to_owners(self, with_grads: bool) -> None:
        """Fill each owned whole copy from the ranks' pieces (and its ``.grad`` from the
        gradient pieces when ``with_grads``; None where no rank has a gradient). A
        collective over ``process_group``."""
        plan, rank = self.plan, self.rank
        like = self._sharded[0]
        parts: list[torch.Tensor] = []
        for d in range(plan.world_size):
            for i in plan.owned(d):
                p = self._sharded[i]
                g = p.grad
                flag = 0.0 if g is None else 1.0
                grad = p.detach().new_zeros(p.numel()) if g is None else g.reshape(-1).to(p.dtype)
                parts += [p.detach().new_full((1,), flag), grad, p.detach().reshape(-1)]
        send = torch.cat(parts) if parts else like.detach().new_empty(0)
        send_sizes, recv_sizes = plan.to_owner_sizes()
        recv = all_to_all(send, send_sizes, recv_sizes, self.process_group, "gather to owners")
        mine = plan.owned(rank)
        grads = {i: self._proxies[i].detach().new_zeros(plan.params[i].numel) for i in mine}
        has = dict.fromkeys(mine, False)
        at = 0
        for s in range(plan.world_size):
            for i in mine:
                (a, b), n = plan.params[i].ranges[s], plan.params[i].length(s)
                has[i] = has[i] or bool(recv[at] > 0)
                grads[i][a:b] = recv[at + 1 : at + 1 + n]
                self._proxies[i].detach().view(-1)[a:b] = recv[at + 1 + n : at + 1 + 2 * n]
                at += 1 + 2 * n
        for i in mine:
            proxy = self._proxies[i]
            proxy.grad = grads[i].view(proxy.shape) if with_grads and has[i] else None

    def scatter_from_owners(self) -> None:
        """Send each owner's whole copies back into the ranks' pieces (a collective)."""
        plan, rank = self.plan, self.rank
        mine = plan.owned(rank)
        parts = [
            self._proxies[i].detach().view(-1)[slice(*plan.params[i].ranges[d])]
            for d in range(plan.world_size)
            for i in mine
        ]
        for i in mine:
            self._proxies[i].grad = None
        send = torch.cat(parts) if parts else self._sharded[0].detach().new_empty(0)
        send_sizes, recv_sizes = plan.from_owner_sizes()
        recv = all_to_all(send, send_sizes, recv_sizes, self.process_group, "scatter from owners")
        at = 0
        for s in range(plan.world_size):
            for i in plan.owned(s):
                n = plan.params[i].length(rank)
                self._sharded[i].detach().copy_(recv[at : at + n].view_as(self._sharded[i]))
                at += n

    # state dicts -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: ``{"owners": ..., "inner": [state dict per group]}``.

        Loads back at the same world size and param groups only; to save and load at
        any world size use the universal checkpoint (``save_universal(root, step,
        model, optimizer)``).
        """
        self._push_hyperparameters()
        return {"owners": list(self.plan.owners), "inner": [o.state_dict() for o in self._inners]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned on this rank: the state and the
        hyperparameters of every group.

        Without a model, a plain ``torch.optim`` state dict of the same param groups
        loads too (what ``OSS(groups, optim=WholeTensorOptimizer)`` gives its local
        optimizer: :meth:`OSS.load_state_dict`).

        Raises:
            ValueError: saved with other owners (another world size or other groups);
                a plain state dict with another number of groups or of parameters.
        """
        if "owners" not in state_dict and self.model is None:
            state_dict = self._split_plain(state_dict)
        if list(state_dict["owners"]) != list(self.plan.owners):
            raise ValueError(
                f"this state dict was saved with the owners {state_dict['owners']}, this "
                f"optimizer has {list(self.plan.owners)} (another world size or other param "
                "groups): use the universal checkpoint (save_universal / load_universal)"
            )
        for group, inner, saved in zip(self.param_groups, self._inners, state_dict["inner"]):
            inner.load_state_dict(saved)
            group.update(_hyper(inner.param_groups[0]))  # the saved lr, betas, ...

    def _split_plain(self, plain: dict[str, Any]) -> dict[str, Any]:
        """A plain ``torch.optim`` state dict as :meth:`state_dict` lays it out: one
        inner state dict per param group."""
        saved = plain["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        if [len(g["params"]) for g in saved] != sizes:
            raise ValueError(
                f"the state dict has param groups of sizes {[len(g['params']) for g in saved]}, "
                f"this WholeTensorOptimizer has {sizes}: it was saved for other parameters"
            )
        inner = []
        for group in saved:
            ids = group["params"]
            inner.append(
                {
                    "state": {
                        j: plain["state"][i] for j, i in enumerate(ids) if i in plain["state"]
                    },
                    "param_groups": [{**_hyper(group), "params": list(range(len(ids)))}],
                }
            )
        return {"owners": list(self.plan.owners), "inner": inner}
