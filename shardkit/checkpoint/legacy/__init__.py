"""The previous release's sharded formats, read only to convert them to the universal one.

Until this release FSDP, OSS and tensor parallelism each wrote a sharded format of
their own; now ``save_fsdp_sharded``, ``OSS.save_sharded`` and tensor-parallel
``save_sharded`` write universal checkpoints (:mod:`shardkit.checkpoint.universal`),
and the runtime reads nothing else. ``python -m shardkit.checkpoint convert OLD NEW``
(:func:`convert_legacy`) turns an old checkpoint into a universal one, which loads
into any strategy at any world size:

=============================  ===============================  ==================================
format                         files                            written until this release by
=============================  ===============================  ==================================
``shardkit.fsdp_sharded/1``    ``fsdp-shard-<r>-of-<N>.pt``     ``save_fsdp_sharded`` (:mod:`.fsdp`)
``shardkit.sharded_optim/1``   ``optim-shard-<r>-of-<N>.pt``    ``OSS.save_sharded`` (:mod:`.oss`)
``shardkit.tensor_parallel_files``  ``tp-<r>-of-<T>.pt``        ``tensor_parallel.save_sharded``
                                                                (:mod:`.tensor_parallel`)
=============================  ===============================  ==================================

This package is the one owner of those formats' tags and file names; the reader
(:mod:`shardkit.checkpoint.reader`) asks :func:`detect_format` only to tell the user
what to run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from shardkit.checkpoint.legacy import fsdp, oss, tensor_parallel
from shardkit.checkpoint.legacy.state import LegacyState, write_universal
from shardkit.checkpoint.manifest import MANIFEST_NAME, read_manifest, verify_checkpoint

__all__ = ["FORMATS", "LegacyState", "convert_legacy", "detect_format", "read_legacy"]

PathLike = str | os.PathLike[str]

FORMATS: dict[str, str] = {
    fsdp.FORMAT: "FSDP sharded of the previous release (save_fsdp_sharded: flat "
    "parameter shards per unit, one file per rank)",
    oss.FORMAT: "OSS sharded of the previous release (OSS.save_sharded: optimizer "
    "state only, one file per rank)",
    tensor_parallel.FORMAT: "tensor-parallel files of the previous release "
    "(tensor_parallel.save_sharded: one file per tensor-parallel rank)",
}
"""Each old format's tag, in words."""

_READERS: dict[str, Callable[[Path], LegacyState]] = {
    fsdp.FORMAT: fsdp.read,
    oss.FORMAT: oss.read,
    tensor_parallel.FORMAT: tensor_parallel.read,
}
_FILES = (
    (fsdp.FORMAT, fsdp.FILE),
    (oss.FORMAT, oss.FILE),
    (tensor_parallel.FORMAT, tensor_parallel.FILE),
)


def detect_format(ckpt: PathLike) -> str | None:
    """The old format of checkpoint directory ``ckpt`` (its manifest's tag, else its
    file names), or None when it is none of them."""
    path = Path(ckpt)
    if (path / MANIFEST_NAME).is_file():
        tag = read_manifest(path).layout.get("format")
        return tag if tag in FORMATS else None
    names = [entry.name for entry in path.iterdir()]
    return next((fmt for fmt, pattern in _FILES if any(pattern.fullmatch(n) for n in names)), None)


def read_legacy(ckpt: PathLike) -> tuple[LegacyState, int]:
    """The full state of the old-format checkpoint directory ``ckpt`` and its step (0
    without a manifest), after verifying its files against the manifest, if any.

    Raises:
        ValueError: not an old-format checkpoint, or its files do not form one save.
        CheckpointCorruptError: a file does not match the manifest.
        CheckpointUnsafeError: a file holds something other than tensors and plain
            containers.
    """
    path = Path(ckpt)
    fmt = detect_format(path)
    if fmt is None:
        raise ValueError(f"{path} is in none of the old formats {sorted(FORMATS)}")
    step = 0
    if (path / MANIFEST_NAME).is_file():
        verify_checkpoint(path)
        step = read_manifest(path).step
    state = _READERS[fmt](path)
    if not state.world_size and (path / MANIFEST_NAME).is_file():
        state.world_size = read_manifest(path).world_size
    return state, step


def convert_legacy(ckpt: PathLike, out: PathLike, optimizer_class: str | None = None) -> Path:
    """Write the old-format checkpoint directory ``ckpt`` as a universal checkpoint
    under root ``out`` (``out/ckpt-<step>``, ``out/latest``), in one process.

    Args:
        optimizer_class: the name of the optimizer class that stepped it; default None:
            the ``torch.optim`` class its hyperparameters match (see
            :func:`~shardkit.checkpoint.legacy.state.infer_optimizer_class`).

    Returns:
        The universal checkpoint directory written.

    Raises:
        ValueError, CheckpointCorruptError, CheckpointUnsafeError: see
            :func:`read_legacy`; an optimizer class that cannot be inferred.
    """
    state, step = read_legacy(ckpt)
    return write_universal(state, Path(out), step, optimizer_class)
