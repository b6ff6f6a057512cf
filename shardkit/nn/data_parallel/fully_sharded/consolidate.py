"""Merging the ranks' local state dicts offline into one full state dict (fairseq's way).

Each rank saves ``model.local_state_dict()`` and ``model.local_metadata_dict()``; later,
in one process and without a process group, ``FSDP.consolidate_shard_weights(
shard_weights=[...], shard_metadata=[...])`` returns the full state dict, keyed by the
unwrapped model's names. These are the pure functions behind the two methods; they know
only the flat layout (see [Note: flat layout, original parameters] in ``flat_param``).

[Note: local metadata format]
One rank's metadata is plain data (lists, ints, strings; ``json.dumps`` takes it) in
FairScale's layout, so scripts written against FairScale's ``local_metadata_dict``
read it unchanged, plus what shardkit checks before merging::

    {
      "format": "shardkit.fsdp.local_metadata", "version": 1,
      "rank": 1, "world_size": 2,
      "param_metadata": [                   # one entry per unit, in module order
        {
          "fsdp_path": "",                  # the unit's unwrapped path ("" for the root)
          "params": {
            "flat_param": {                 # local state dict key "<fsdp_path>.flat_param"
              "names": ["wte.weight", "ln_f.weight"],   # first name of each parameter
              "shapes": [[32, 16], [16]],
              "numels": [512, 16],
              "padding": 0,                 # elements at the end of this rank's shard
            }
          },
          "shared_param_info": [["wte.weight", "lm_head.weight"]],  # [name, tied alias]
          "no_broadcast_optim_state": False,
          "world_size": 2, "shard_numel": 264,      # the unit's N and S
        },
        {"fsdp_path": "blocks.0", "params": {"flat_param": {...}}, ...},
      ],
      "buffer_names": ["bn.running_mean"],  # unwrapped names, as in the output
      "buffer_keys": ["_fsdp_wrapped_module.bn.running_mean"],  # in the local state dict
    }

Parameter names (``names``, ``shared_param_info``) are relative to the unit, as in
FairScale: the output key is ``"<fsdp_path>.<name>"`` (``"<name>"`` for the root).
A rank's shard of a unit is ``S`` elements; with the padding dropped from the end of
each rank's shard, the shards of ranks 0..N-1 concatenate to the unit's parameters in
flat order. That is also true of FairScale's shards, so FairScale's own metadata (no
``rank``, ``world_size``, ``shard_numel`` or ``buffer_keys``: ranks are taken in list
order, buffer keys equal buffer names) is merged the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from shardkit.nn.data_parallel.fully_sharded.flat_param import FlatLayout, ParamInfo

__all__ = ["METADATA_FORMAT", "clean_path", "consolidate_shard_weights", "local_metadata"]

METADATA_FORMAT = "shardkit.fsdp.local_metadata"
_VERSION = 1
# attribute names that wrappers insert into module paths (shardkit's and FairScale's)
_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_fpw_module"})


def clean_path(path: str) -> str:
    """``path`` without wrapper attribute segments (``_fsdp_wrapped_module``)."""
    return ".".join(part for part in path.split(".") if part not in _WRAPPER_SEGMENTS)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _padding(layout: FlatLayout, rank: int) -> int:
    """Elements of rank ``rank``'s shard past the end of the parameters."""
    lo, hi = layout.shard_range(rank)
    return hi - min(hi, max(lo, layout.total))


def local_metadata(
    units: Mapping[str, tuple[Sequence[ParamInfo], FlatLayout]],
    buffer_names: Iterable[str],
    rank: int,
) -> dict[str, Any]:
    """What :func:`consolidate_shard_weights` needs to merge this rank's local state dict.

    Args:
        units: local state dict key of each unit's shard (``"<unit path>.flat_param"``,
            ``"flat_param"`` for the root) -> the unit's parameters (in flat order) and
            its flat layout.
        buffer_names: the buffers' keys in the local state dict (wrapper segments are
            removed for the output names).
        rank: this rank's index in the units' process group.

    Returns:
        plain data, see [Note: local metadata format].

    Raises:
        ValueError: units of different world sizes, ``rank`` outside ``[0, N)``, or a
            unit whose parameters disagree with its layout.
    """
    sizes = {key: layout.world_size for key, (_, layout) in units.items()}
    world_size = next(iter(sizes.values()), 1)
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"units have different world sizes {sizes}: offline consolidation merges units "
            "sharded over one process group"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size}) (the units' world size)")
    param_metadata = [
        _unit_metadata(key, infos, layout, rank) for key, (infos, layout) in units.items()
    ]
    keys = list(buffer_names)
    return {
        "format": METADATA_FORMAT,
        "version": _VERSION,
        "rank": rank,
        "world_size": world_size,
        "param_metadata": param_metadata,
        "buffer_names": [clean_path(key) for key in keys],
        "buffer_keys": keys,
    }


def _unit_metadata(
    key: str, infos: Sequence[ParamInfo], layout: FlatLayout, rank: int
) -> dict[str, Any]:
    numels = [info.numel for info in infos]
    if tuple(numels) != layout.numels:
        raise ValueError(
            f"unit `{key}`: its parameters have {numels} elements but its layout {list(layout.numels)}"
        )
    path, _, backing = key.rpartition(".")
    path = clean_path(path)
    names = [[clean_path(loc.name) for loc in info.locations] for info in infos]
    return {
        "fsdp_path": path,
        "params": {
            backing: {
                "names": [found[0] for found in names],
                "shapes": [list(info.shape) for info in infos],
                "numels": numels,
                "padding": _padding(layout, rank),
            }
        },
        "shared_param_info": [[found[0], alias] for found in names for alias in found[1:]],
        "no_broadcast_optim_state": False,
        "world_size": layout.world_size,
        "shard_numel": layout.shard_numel,
    }


def consolidate_shard_weights(
    shard_weights: Sequence[Mapping[str, torch.Tensor]],
    shard_metadata: Sequence[Mapping[str, Any]],
    with_module_buffers: bool = True,
    strict: bool = True,
) -> dict[str, torch.Tensor]:
    """The full state dict (unwrapped names) from every rank's local state dict.

    Parameters come from all ranks' shards; tied parameters appear under each of their
    names as one tensor (as in ``state_dict()``); the parameters of one unit are views
    into one buffer per unit. Buffers are rank 0's (FSDP keeps them equal across ranks).
    The ranks may be given in any order (each metadata names its rank).

    Args:
        shard_weights: each rank's ``local_state_dict()``.
        shard_metadata: each rank's ``local_metadata_dict()``, in the same order.
        with_module_buffers: include the buffers. Default True.
        strict: every key of the metadata must be in every rank's weights, and no
            other key; with False, a unit or buffer absent from the weights is left out.
            Default True.

    Raises:
        ValueError: no shards, lists of different lengths, ranks missing or repeated,
            world sizes that disagree, metadata of different wrappings, or a shard of
            the wrong length.
        KeyError: (``strict``) keys missing from or unexpected in some rank's weights;
            a unit present on some ranks only (also without ``strict``).
    """
    weights, metadata = _by_rank(shard_weights, shard_metadata)
    units = metadata[0]["param_metadata"]
    _check_same_wrapping(metadata)
    buffers = _buffer_keys(metadata[0]) if with_module_buffers else {}
    if strict:
        _check_keys(weights, units, _buffer_keys(metadata[0]), with_module_buffers)
    out: dict[str, torch.Tensor] = {}
    for index, unit in enumerate(units):
        for backing, params in unit["params"].items():
            key = _join(unit["fsdp_path"], backing)
            present = [r for r, w in enumerate(weights) if key in w]
            if len(present) < len(weights):
                if present:
                    missing = sorted(set(range(len(weights))) - set(present))
                    raise KeyError(
                        f"`{key}` is in the weights of ranks {present} but not of ranks "
                        f"{missing}: a unit cannot be merged from some of its shards"
                    )
                continue  # not strict: the unit was left out of every rank's weights
            paddings = [m["param_metadata"][index]["params"][backing]["padding"] for m in metadata]
            flat = _unpad_cat(key, [w[key] for w in weights], paddings, unit)
            out.update(_split(key, flat, params, unit["fsdp_path"]))
        for src, dst in unit["shared_param_info"]:
            src, dst = _join(unit["fsdp_path"], src), _join(unit["fsdp_path"], dst)
            if src in out:
                out[dst] = out[src]
    for name, key in buffers.items():
        if key in weights[0]:
            out[name] = weights[0][key]
    return out


def _by_rank(
    shard_weights: Sequence[Mapping[str, torch.Tensor]],
    shard_metadata: Sequence[Mapping[str, Any]],
) -> tuple[list[Mapping[str, torch.Tensor]], list[Mapping[str, Any]]]:
    """Weights and metadata ordered by rank, after checking the ranks are 0..N-1."""
    if len(shard_weights) != len(shard_metadata) or not shard_weights:
        raise ValueError(
            f"need one metadata per shard and at least one shard; got {len(shard_weights)} "
            f"shard weights and {len(shard_metadata)} metadata"
        )
    count = len(shard_metadata)
    sizes = [m.get("world_size", count) for m in shard_metadata]
    if len(set(sizes)) > 1:
        raise ValueError(
            f"the metadata disagree on the world size: {sizes} (in the order given); the "
            "shards come from different runs"
        )
    ranks = [m.get("rank", position) for position, m in enumerate(shard_metadata)]
    missing = sorted(set(range(sizes[0])) - set(ranks))
    repeated = sorted({r for r in ranks if ranks.count(r) > 1})
    if sizes[0] != count or missing or repeated:
        raise ValueError(
            f"the shards were saved at world size {sizes[0]} but {count} were given, of "
            f"ranks {ranks}: missing ranks {missing}, repeated ranks {repeated}; pass "
            "every rank's local state dict and metadata once"
        )
    order = sorted(range(count), key=lambda position: ranks[position])
    return [shard_weights[p] for p in order], [shard_metadata[p] for p in order]


def _structure(metadata: Mapping[str, Any]) -> list[Any]:
    """What must be the same on every rank: units, names, shapes, aliases, buffers."""
    units = [
        (
            unit["fsdp_path"],
            [
                (b, p["names"], [list(s) for s in p["shapes"]], p["numels"])
                for b, p in unit["params"].items()
            ],
            [list(pair) for pair in unit["shared_param_info"]],
        )
        for unit in metadata["param_metadata"]
    ]
    return [units, list(metadata["buffer_names"])]


def _check_same_wrapping(metadata: Sequence[Mapping[str, Any]]) -> None:
    reference = _structure(metadata[0])
    for rank, other in enumerate(metadata[1:], start=1):
        theirs = _structure(other)
        if theirs == reference:
            continue
        if theirs[1] != reference[1]:
            detail = f"buffers {theirs[1]} vs rank 0's {reference[1]}"
        else:
            paths = [u[0] for u in reference[0]], [u[0] for u in theirs[0]]
            diff = [a for a, b in zip(reference[0], theirs[0]) if a != b]
            detail = (
                f"units {paths[1]} vs rank 0's {paths[0]}"
                if paths[0] != paths[1]
                else f"unit `{diff[0][0]}` describes its parameters differently"
            )
        raise ValueError(
            f"rank {rank}'s metadata describe another model or wrapping than rank 0's: {detail}"
        )


def _buffer_keys(metadata: Mapping[str, Any]) -> dict[str, str]:
    """Output name -> local state dict key of each buffer."""
    names = list(metadata["buffer_names"])
    return dict(zip(names, metadata.get("buffer_keys", names)))


def _check_keys(
    weights: Sequence[Mapping[str, torch.Tensor]],
    units: Sequence[Mapping[str, Any]],
    buffers: Mapping[str, str],
    with_module_buffers: bool,
) -> None:
    unit_keys = {_join(u["fsdp_path"], backing) for u in units for backing in u["params"]}
    expected = unit_keys | set(buffers.values()) if with_module_buffers else unit_keys
    known = unit_keys | set(buffers.values())
    problems = []
    for rank, w in enumerate(weights):
        missing, unexpected = sorted(expected - set(w)), sorted(set(w) - known)
        if missing or unexpected:
            problems.append(f"rank {rank}: missing {missing}, unexpected {unexpected}")
    if problems:
        raise KeyError(
            "the shard weights do not match their metadata (strict=True): " + "; ".join(problems)
        )


def _unpad_cat(
    key: str, shards: Sequence[torch.Tensor], paddings: Sequence[int], unit: Mapping[str, Any]
) -> torch.Tensor:
    """The unit's flat parameters: each rank's shard without its padding, concatenated."""
    expected = unit.get("shard_numel")
    for rank, (shard, pad) in enumerate(zip(shards, paddings)):
        if shard.dim() != 1 or (expected is not None and shard.numel() != expected):
            raise ValueError(
                f"`{key}` of rank {rank} has shape {tuple(shard.shape)} but the metadata say "
                f"({expected},): the weights and metadata come from different runs or wrappings"
            )
        if not 0 <= pad <= shard.numel():
            raise ValueError(f"`{key}` of rank {rank}: padding {pad} outside [0, {shard.numel()}]")
    if unit.get("no_broadcast_optim_state"):  # FairScale's expert replicas: not sharded
        shards, paddings = shards[:1], paddings[:1]
    return torch.cat([shard[: shard.numel() - pad] for shard, pad in zip(shards, paddings)])


def _split(
    key: str, flat: torch.Tensor, params: Mapping[str, Any], path: str
) -> dict[str, torch.Tensor]:
    numels = [int(n) for n in params["numels"]]
    if sum(numels) != flat.numel():
        raise ValueError(
            f"`{key}`: the shards hold {flat.numel()} elements without padding, but the "
            f"parameters {params['names']} have {sum(numels)}"
        )
    return {
        _join(path, name): piece.view(tuple(shape))
        for name, piece, shape in zip(params["names"], flat.split(numels), params["shapes"])
    }
