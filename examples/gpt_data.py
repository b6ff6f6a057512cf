"""Byte-level text data for the main job: loading, a held-out split, per-rank batches.

- :func:`load_bytes` reads ``--data`` (a text file, or a directory whose ``.txt`` files
  are concatenated in sorted path order) or, by default, the language-reference topics
  in ``pydoc_data.topics`` that ship with every CPython (about 465 KB of English).
- :func:`split_tokens` keeps the last ``val_fraction`` of the tokens as a held-out
  validation split (a contiguous tail, so no training window overlaps it).
- :class:`BatchSampler` draws training windows at random offsets. Batch ``i`` of rank
  ``r`` is a pure function of ``(seed, r, i)``, so the sampler's whole state is its
  position ``i``: a checkpoint stores that integer and a resumed run draws exactly
  the batches an uninterrupted run would have drawn.
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
    """Random training windows for one rank; the state is the batch position.

    Args:
        tokens: the training split, 1-D int64.
        batch_size: windows per batch (per rank).
        seq_len: tokens per window.
        seed: the run's seed.
        rank: this rank (ranks draw different windows).
    """

    def __init__(
        self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int, rank: int
    ) -> None:
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.seed, self.rank = seed, rank
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch at the current position, ``(x, y)`` each ``(batch, seq_len)``; advances."""
        key = ((self.seed * 1_000_003 + self.rank) * 1_000_033 + self.position) % 2**63
        gen = torch.Generator().manual_seed(key)
        high = len(self.tokens) - self.seq_len  # last valid start + 1
        starts = torch.randint(0, high, (self.batch_size,), generator=gen)
        self.position += 1
        x, y = _windows(self.tokens, starts, self.seq_len)
        return x, y

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, "rank": self.rank}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


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
