"""Byte-level text data for the main job: loading, a held-out split, per-rank batches.

- :func:`load_bytes` reads ``--data`` (a text file, or a directory whose ``.txt`` files
  are concatenated in sorted path order) or, by default, the language-reference topics
  in ``pydoc_data.topics`` that ship with every CPython (about 465 KB of English).
- :func:`split_tokens` keeps the last ``val_fraction`` of the tokens as a held-out
  validation split (a contiguous tail, so no training window overlaps it).
- :class:`BatchSampler` draws training windows at random offsets. The global batch of
  step ``i`` (all ranks' rows together) is a pure function of ``(seed, global batch,
  i)``, and data-parallel rank ``r`` of ``W`` takes its ``r``-th contiguous ``1/W`` of
  the rows: the same global batches at any world size, so an elastic resume at
  another size trains on exactly the batches an uninterrupted run would have drawn.
  The sampler's whole state is the number of samples consumed globally.
- :func:`eval_windows` picks fixed, evenly spaced validation windows, so every
  evaluation scores the same text and uses no random numbers (evaluation never
  perturbs the training trajectory).

Tokens are bytes (vocabulary 256). Shapes: batches are ``(batch, seq_len)`` int64.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = [
    "VOCAB_SIZE",
    "BatchSampler",
    "InputError",
    "default_text",
    "eval_windows",
    "load_bytes",
    "split_tokens",
]

VOCAB_SIZE = 256


class InputError(ValueError):
    """Bad user input (a path, a size): reported as one line on stderr, exit code 2."""


def default_text() -> bytes:
    """The ``pydoc_data.topics`` texts, joined in sorted topic order, as UTF-8 bytes."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def _text_files(directory: Path) -> list[Path]:
    files = sorted(p for p in directory.rglob("*.txt") if p.is_file())
    if not files:
        raise InputError(f"--data {directory}: the directory has no .txt files")
    return files


def load_bytes(path: str | None) -> tuple[bytes, str]:
    """The training text as bytes, and a short description of where it came from.

    Args:
        path: a text file, a directory (all ``*.txt`` below it, sorted by path), or
            None for :func:`default_text`.

    Raises:
        InputError: the path does not exist, the directory holds no ``.txt`` file, or
            the text is empty.
    """
    if path is None:
        return default_text(), "pydoc_data.topics"
    where = Path(path)
    if not where.exists():
        raise InputError(f"--data {path}: no such file or directory")
    files = _text_files(where) if where.is_dir() else [where]
    data = b"\n".join(f.read_bytes() for f in files)
    if not data.strip():
        raise InputError(f"--data {path}: the text is empty ({len(files)} file(s), no content)")
    return data, f"{path} ({len(files)} file(s))"


def split_tokens(
    data: bytes, seq_len: int, val_fraction: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte tokens split into ``(train, val)`` 1-D int64 tensors (val is the tail).

    Raises:
        InputError: a split is too short for one window of ``seq_len + 1`` tokens
            (input plus the next-token target); the message names the sizes.
    """
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    n_val = int(len(tokens) * val_fraction)
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
    for name, split in (("training", train), ("validation", val)):
        if len(split) < seq_len + 1:
            raise InputError(
                f"--seq-len {seq_len} needs at least {seq_len + 1} tokens in each split, but "
                f"the {name} split has {len(split)} (of {len(tokens)} bytes, "
                f"{val_fraction:.0%} held out); use a shorter --seq-len or more --data"
            )
    return train, val


def _windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, ...]:
    """Inputs and next-token targets, both ``(len(starts), seq_len)``."""
    offsets = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    chunk = tokens[offsets]
    return chunk[:, :-1], chunk[:, 1:]


class BatchSampler:
    """Random training windows of the global batch; this data-parallel rank's rows.

    Step ``i``'s global batch is ``global_batch`` windows at offsets drawn by a generator
    seeded with ``(seed, i)``: independent of the world size. Data-parallel rank ``r``
    of ``world`` takes rows ``[r * global_batch / world, (r + 1) * global_batch / world)``.
    The state is the number of samples consumed globally (``position * global_batch``).

    Args:
        tokens: the training split, 1-D int64.
        global_batch: windows per step over all data-parallel ranks.
        seq_len: tokens per window.
        seed: the run's seed.
        rank: this data-parallel rank.
        world: the data-parallel size; it must divide ``global_batch``.

    Raises:
        ValueError: ``world`` does not divide ``global_batch``, or ``rank`` is not in
            ``[0, world)``.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        global_batch: int,
        seq_len: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        if global_batch % world or not 0 <= rank < world:
            raise ValueError(
                f"global batch {global_batch} over {world} data-parallel ranks (rank {rank}): "
                f"the size must divide the global batch and 0 <= rank < {world}"
            )
        self.tokens, self.global_batch, self.seq_len = tokens, global_batch, seq_len
        self.seed, self.rank, self.world = seed, rank, world
        self.position = 0  # steps drawn

    @property
    def rows(self) -> int:
        """This rank's rows per step: ``global_batch / world``."""
        return self.global_batch // self.world

    @property
    def samples(self) -> int:
        """Samples (windows) consumed globally: ``position * global_batch``."""
        return self.position * self.global_batch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the current step, ``(x, y)`` each ``(rows, seq_len)``; advances."""
        key = (self.seed * 1_000_003 * 1_000_033 + self.position) % 2**63
        gen = torch.Generator().manual_seed(key)
        high = len(self.tokens) - self.seq_len  # last valid start + 1
        starts = torch.randint(0, high, (self.global_batch,), generator=gen)
        self.position += 1
        mine = starts[self.rank * self.rows : (self.rank + 1) * self.rows]
        x, y = _windows(self.tokens, mine, self.seq_len)
        return x, y

    def state_dict(self) -> dict[str, Any]:
        """``{"samples": consumed globally, "global_batch": ..., "seed": ...}`` (the same
        on every rank)."""
        return {"samples": self.samples, "global_batch": self.global_batch, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after ``state["samples"]`` samples.

        Raises:
            ValueError: the samples are not a whole number of this sampler's global
                batches (the global batch changed).
        """
        samples = int(state["samples"])
        if samples % self.global_batch:
            raise ValueError(
                f"{samples} samples consumed is not a whole number of global batches of "
                f"{self.global_batch}; resume with the global batch the run was trained with"
            )
        self.position = samples // self.global_batch


def eval_windows(
    tokens: torch.Tensor, n_windows: int, seq_len: int, rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of ``n_windows`` evenly spaced validation windows.

    Window ``j`` goes to rank ``j % world_size``; a rank may get none (shape ``(0, T)``).
    """
    high = len(tokens) - seq_len
    starts = torch.linspace(0, high - 1, n_windows).round().to(torch.int64)
    x, y = _windows(tokens, starts[rank::world_size], seq_len)
    return x, y
