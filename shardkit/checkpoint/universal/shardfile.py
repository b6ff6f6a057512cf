"""One rank's shard file: safetensors (tensors only, no pickle) with the piece index.

[Note: the shard file]
``shard-<rank>-of-<N>.safetensors`` is a standard safetensors file (8-byte header
length, JSON header, raw little-endian bytes), written tensor by tensor from the
rank's own storage (no copy of the rank's state is made; a CUDA tensor is copied to
the CPU one at a time). Every tensor is 1-D: one piece, elements ``[start, stop)`` of
the flattened local tensor. The header's ``__metadata__`` holds, under
:data:`INDEX_KEY`, the JSON list of :class:`SavedPiece` records (and scalar optimizer
state as numbers), so a reader learns what every file holds from the headers alone
and then reads only the byte ranges it needs (``safe_open(...).get_slice(name)[a:b]``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from shardkit.distributed.shard_descriptor import Split, TensorView
from shardkit.distributed.shard_elements import check_view

__all__ = [
    "INDEX_KEY",
    "SavedPiece",
    "SavedScalar",
    "ShardFile",
    "dtype_from_name",
    "dtype_name",
    "read_index",
    "shard_file_name",
]

INDEX_KEY = "shardkit.universal.index"
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; ``ValueError`` for a name that is no torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def shard_file_name(rank: int, world_size: int) -> str:
    """``shard-<rank>-of-<world size>.safetensors``."""
    return f"shard-{rank}-of-{world_size}.safetensors"


@dataclass(frozen=True)
class SavedPiece:
    """One saved piece: elements ``[start, stop)`` of the flattened local tensor
    ``view`` of ``key``'s value (``state == ""``) or optimizer state ``state``;
    tensor ``name`` of ``file``, dtype ``dtype`` (a :func:`dtype_name`)."""

    key: str
    state: str
    view: TensorView
    start: int
    stop: int
    dtype: str
    file: str
    name: str

    def to_json(self) -> dict[str, Any]:
        v = self.view
        view: list[Any] = [list(v.global_shape), v.split_dim, v.part, v.parts, v.stride]
        if v.inner_splits:  # see [Note: several splits] in the shard descriptor
            view.append([[s.dim, s.part, s.parts, s.stride] for s in v.inner_splits])
        return {
            "key": self.key,
            "state": self.state,
            "view": view,
            "start": self.start,
            "stop": self.stop,
            "dtype": self.dtype,
            "name": self.name,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any], file: str) -> SavedPiece:
        shape, split_dim, part, parts, stride, *more = raw["view"]
        inner = tuple(
            Split(int(d), int(p), int(n), int(st)) for d, p, n, st in (more[0] if more else ())
        )
        view = TensorView(
            tuple(int(d) for d in shape), split_dim, part, parts, stride, inner_splits=inner
        )
        return cls(
            str(raw["key"]),
            str(raw["state"]),
            view,
            int(raw["start"]),
            int(raw["stop"]),
            str(raw["dtype"]),
            file,
            str(raw["name"]),
        )


@dataclass(frozen=True)
class SavedScalar:
    """A scalar optimizer state ``state`` of ``key`` (Adam's ``step``): ``value``;
    ``dtype`` the 0-dim tensor's dtype name, or None for a Python number."""

    key: str
    state: str
    value: float | int | bool
    dtype: str | None

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "state": self.state, "value": self.value, "dtype": self.dtype}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> SavedScalar:
        value = raw["value"]
        if not isinstance(value, (bool, int, float)):
            raise ValueError(f"scalar state {raw.get('state')!r} is not a number: {value!r}")
        return cls(str(raw["key"]), str(raw["state"]), value, raw["dtype"])

    def restore(self) -> torch.Tensor | float | int | bool:
        """The value as saved: a 0-dim tensor of ``dtype``, or the number."""
        if self.dtype is None:
            return self.value
        return torch.tensor(self.value, dtype=dtype_from_name(self.dtype))


class ShardFile:
    """The content of one rank's shard file, written by :meth:`write_to` (see [Note: the
    shard file]). ``pieces``: ``(record, tensor)``, each tensor with the record's
    ``stop - start`` elements; ``scalars``: scalar optimizer state."""

    def __init__(
        self, pieces: list[tuple[SavedPiece, torch.Tensor]], scalars: list[SavedScalar]
    ) -> None:
        self.pieces = pieces
        self.scalars = scalars

    def _header(self) -> tuple[bytes, list[torch.Tensor]]:
        header: dict[str, Any] = {}
        flats, offset = [], 0
        for record, tensor in self.pieces:
            flat = tensor.detach().reshape(-1)
            if flat.dtype not in _ST_DTYPES:
                raise ValueError(f"{record.key!r}: dtype {flat.dtype} has no safetensors code")
            nbytes = flat.numel() * flat.element_size()
            header[record.name] = {
                "dtype": _ST_DTYPES[flat.dtype],
                "shape": [flat.numel()],
                "data_offsets": [offset, offset + nbytes],
            }
            flats.append(flat)
            offset += nbytes
        index = {
            "pieces": [r.to_json() for r, _ in self.pieces],
            "scalars": [s.to_json() for s in self.scalars],
        }
        header["__metadata__"] = {INDEX_KEY: json.dumps(index, separators=(",", ":"))}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        return raw, flats

    def write_to(self, handle: IO[bytes]) -> None:
        """Write the safetensors bytes to ``handle``, one tensor at a time."""
        raw, flats = self._header()
        handle.write(len(raw).to_bytes(8, "little"))
        handle.write(raw)
        for flat in flats:
            if flat.numel():
                data = flat.to("cpu").contiguous().view(torch.uint8)
                handle.write(data.numpy().data)


def read_index(path: str | os.PathLike[str]) -> tuple[list[SavedPiece], list[SavedScalar]]:
    """The piece index in the header of the shard file ``path`` (the header only is read).

    Raises:
        ValueError: the header has no index or a malformed one (the file is not a
            universal shard file).
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
        if INDEX_KEY not in meta:
            raise ValueError(f"{path} has no {INDEX_KEY!r} in its safetensors metadata")
        try:
            index = json.loads(meta[INDEX_KEY])
            name = Path(path).name
            pieces = [SavedPiece.from_json(r, name) for r in index["pieces"]]
            scalars = [SavedScalar.from_json(r) for r in index["scalars"]]
            names: list[str] = handle.keys()  # a safe_open handle is no mapping
            stored = {n: handle.get_slice(n) for n in names}
            for piece in pieces:
                _check_piece(piece, stored)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: malformed piece index: {err}") from err
    return pieces, scalars


def _check_piece(piece: SavedPiece, stored: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless ``piece`` is a valid range of a valid view and its
    tensor in the file has exactly ``stop - start`` elements of its dtype (an index
    that says otherwise would read past the tensor or write past the assembled one)."""
    check_view(piece.view)
    if not 0 <= piece.start <= piece.stop <= piece.view.local_numel:
        raise ValueError(
            f"{piece.key!r}: piece [{piece.start}, {piece.stop}) outside the local tensor of "
            f"{piece.view.local_numel} elements"
        )
    tensor = stored.get(piece.name)
    if tensor is None:
        raise ValueError(f"{piece.key!r}: no tensor {piece.name!r} in the file")
    shape, code = list(tensor.get_shape()), tensor.get_dtype()
    want = _ST_DTYPES.get(dtype_from_name(piece.dtype))
    if shape != [piece.stop - piece.start] or code != want:
        raise ValueError(
            f"{piece.key!r}: tensor {piece.name!r} is {code} {shape}, the index says "
            f"{want} [{piece.stop - piece.start}]"
        )
