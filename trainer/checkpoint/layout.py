"""The layout model: for every tensor its dtype, global shape and the chunks (region, file, key) that hold it.

A layout is valid when every chunk lies inside the tensor, no two chunks overlap and together they cover
every element exactly once; `TensorLayout.validate` checks all three and the dtype, on save and on load.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.checkpoint.digest import segment_count
from trainer.checkpoint.errors import CheckpointError, CorruptCheckpoint
from trainer.checkpoint.json_fields import get_extents, get_int, get_list, get_object, get_str

# safetensors dtype name -> (bytes per element, numpy dtype name)
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "U16": (2, "uint16"),
    "I16": (2, "int16"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "U32": (4, "uint32"),
    "I32": (4, "int32"),
    "F32": (4, "float32"),
    "U64": (8, "uint64"),
    "I64": (8, "int64"),
    "F64": (8, "float64"),
}
_CHECKSUM = re.compile(r"[0-9a-f]{8}")
_BY_NUMPY_NAME = {numpy_name: name for name, (_, numpy_name) in DTYPES.items()}


def itemsize(dtype: str) -> int:
    return DTYPES[dtype][0]


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype for a safetensors dtype name. bfloat16 exists in numpy only once MindSpore is imported."""
    try:
        return np.dtype(DTYPES[dtype][1])
    except TypeError as exc:
        raise CheckpointError(
            f"dtype {dtype} has no numpy type in this process: import mindspore first (it registers bfloat16)"
        ) from exc


def dtype_name(dtype: np.dtype) -> str:
    """The safetensors dtype name of a numpy dtype; refuses dtypes safetensors cannot store."""
    name = _BY_NUMPY_NAME.get(dtype.name)
    if name is None or dtype != numpy_dtype(name):
        raise CheckpointError(f"numpy dtype {dtype.str} cannot be stored in a checkpoint")
    return name


@dataclass(frozen=True)
class Region:
    """A box inside a tensor: `offsets` where it starts, `sizes` how far it extends, per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @staticmethod
    def full(shape: tuple[int, ...]) -> Region:
        return Region((0,) * len(shape), tuple(shape))

    @property
    def volume(self) -> int:
        return math.prod(self.sizes)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def intersect(self, other: Region) -> Region | None:
        """The common box of two regions of the same tensor, or None when they share no element."""
        starts = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        ends = tuple(
            min(a + n, b + m) for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )
        if any(e <= s for s, e in zip(starts, ends)):
            return None
        return Region(starts, tuple(e - s for s, e in zip(starts, ends)))

    def relative_to(self, origin: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(o - base for o, base in zip(self.offsets, origin))


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: `region` of the global tensor, kept in `file` under safetensors `key`.

    `checksums` holds one checksum per segment of `segment_rows` rows of dimension 0 (see `digest`); chunks
    of a MindSpore-native checkpoint have none.
    """

    region: Region
    file: str
    key: str
    segment_rows: int = 1
    checksums: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "offsets": list(self.region.offsets),
            "sizes": list(self.region.sizes),
            "file": self.file,
            "key": self.key,
            "segment_rows": self.segment_rows,
            "checksums": list(self.checksums or ()),
        }

    @staticmethod
    def from_json(obj: Any, where: str) -> Chunk:
        if not isinstance(obj, dict):
            raise CorruptCheckpoint(f"{where} must be an object")
        region = Region(get_extents(obj, "offsets", where), get_extents(obj, "sizes", where))
        checksums = get_list(obj, "checksums", where)
        if not all(isinstance(c, str) and _CHECKSUM.fullmatch(c) for c in checksums):
            raise CorruptCheckpoint(f"{where}: 'checksums' must be CRC-32s of 8 hexadecimal digits")
        return Chunk(
            region,
            get_str(obj, "file", where),
            get_str(obj, "key", where),
            get_int(obj, "segment_rows", where, minimum=1),
            tuple(checksums),
        )


@dataclass(frozen=True)
class TensorLayout:
    """A tensor of the checkpoint: safetensors `dtype` name, global `shape`, and the chunks that hold it."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "chunks": [c.to_json() for c in self.chunks]}

    @staticmethod
    def from_json(obj: Any, where: str) -> TensorLayout:
        if not isinstance(obj, dict):
            raise CorruptCheckpoint(f"{where} must be an object")
        chunks = tuple(
            Chunk.from_json(c, f"{where} chunk {i}") for i, c in enumerate(get_list(obj, "chunks", where))
        )
        return TensorLayout(get_str(obj, "dtype", where), get_extents(obj, "shape", where), chunks)

    def validate(self, name: str) -> None:
        """Raises CorruptCheckpoint unless the dtype is known and the chunks cover the shape exactly once."""
        where = f"tensor '{name}'"
        if self.dtype not in DTYPES:
            raise CorruptCheckpoint(f"{where}: unknown dtype {self.dtype!r:.40}")
        ndim = len(self.shape)
        for i, chunk in enumerate(self.chunks):
            region = chunk.region
            if len(region.offsets) != ndim or len(region.sizes) != ndim:
                raise CorruptCheckpoint(f"{where}: chunk {i} has {len(region.offsets)} dimensions, the tensor {ndim}")
            if any(o + s > d for o, s, d in zip(region.offsets, region.sizes, self.shape)):
                raise CorruptCheckpoint(
                    f"{where}: chunk {i} (offsets {list(region.offsets)}, sizes {list(region.sizes)}) "
                    f"lies outside shape {list(self.shape)}"
                )
            segments = segment_count(region.sizes, chunk.segment_rows)
            if chunk.checksums is not None and len(chunk.checksums) != segments:
                raise CorruptCheckpoint(
                    f"{where}: chunk {i} lists {len(chunk.checksums)} checksums for {segments} segments"
                )
        _check_disjoint(where, self.chunks, ndim)
        covered = sum(c.region.volume for c in self.chunks)
        total = math.prod(self.shape)
        if covered != total:
            raise CorruptCheckpoint(f"{where}: chunks cover {covered} of its {total} elements")


def _check_disjoint(where: str, chunks: tuple[Chunk, ...], ndim: int) -> None:
    """Pairwise box overlap test, vectorised per chunk (extents are below 2**48, so int64 cannot overflow)."""
    if len(chunks) < 2:
        return
    lo = np.array([c.region.offsets for c in chunks], dtype=np.int64).reshape(len(chunks), ndim)
    hi = lo + np.array([c.region.sizes for c in chunks], dtype=np.int64).reshape(len(chunks), ndim)
    nonempty = (hi > lo).all(axis=1)
    for i in range(len(chunks) - 1):
        if not nonempty[i]:
            continue
        shared = (np.maximum(lo[i], lo[i + 1 :]) < np.minimum(hi[i], hi[i + 1 :])).all(axis=1) & nonempty[i + 1 :]
        if shared.any():
            j = i + 1 + int(np.argmax(shared))
            raise CorruptCheckpoint(f"{where}: chunk {i} overlaps chunk {j}")


def layouts_from_json(obj: dict[str, Any], where: str) -> dict[str, TensorLayout]:
    tensors = get_object(obj, "tensors", where)
    return {name: TensorLayout.from_json(t, f"{where}: tensor '{name}'") for name, t in tensors.items()}
