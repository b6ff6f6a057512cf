"""Saving and loading training state: atomic files, sharded and consolidated states."""

from shardkit.checkpoint.atomic import atomic_save, atomic_write, atomic_write_bytes
from shardkit.checkpoint.manifest import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFallbackWarning,
    CheckpointMismatchError,
    CheckpointUnsafeError,
    find_valid_checkpoint,
    load_checkpoint_file,
    load_tensors_only,
    save_checkpoint,
    verify_checkpoint,
)

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFallbackWarning",
    "CheckpointMismatchError",
    "CheckpointUnsafeError",
    "atomic_save",
    "atomic_write",
    "atomic_write_bytes",
    "find_valid_checkpoint",
    "load_checkpoint_file",
    "load_tensors_only",
    "save_checkpoint",
    "verify_checkpoint",
]
