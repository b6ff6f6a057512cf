"""Saving and loading training state: atomic files, sharded and consolidated states."""

from shardkit.checkpoint.atomic import atomic_save, atomic_write, atomic_write_bytes

__all__ = ["atomic_save", "atomic_write", "atomic_write_bytes"]
