"""How a world size divides the tensors: which rank writes which piece, and which region each rank loads.

Writing: every tensor is held by every data-parallel rank, so it is written once, cut along dimension 0 into
pieces of at least MIN_PIECE_BYTES (at most one per rank) and each piece given to the rank that has the
fewest bytes so far, largest tensors first. All ranks compute the same assignment from the names, shapes
and dtypes alone, and every rank writes about 1/world_size of the bytes, in parallel.

Loading: a rank gets each tensor whole, or, for the tensors the caller names with a dimension, the part of
that dimension `numpy.array_split` would give it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.layout import Region, itemsize

MIN_PIECE_BYTES = 1 << 20


@dataclass(frozen=True)
class TensorSpec:
    """What every rank knows about a tensor before it is written: safetensors dtype name and global shape."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class Piece:
    """A region of a named tensor."""

    tensor: str
    region: Region


def split_extent(length: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` when `length` is cut into `parts` nearly equal parts, larger parts first."""
    base, extra = divmod(length, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


def _cut_dim0(spec: TensorSpec, world_size: int) -> list[Region]:
    if not spec.shape:
        return [Region.full(spec.shape)]
    parts = max(1, min(world_size, spec.shape[0], spec.nbytes // MIN_PIECE_BYTES))
    regions = []
    for index in range(parts):
        start, size = split_extent(spec.shape[0], parts, index)
        regions.append(Region((start,) + (0,) * (len(spec.shape) - 1), (size,) + spec.shape[1:]))
    return regions


def write_assignment(specs: Mapping[str, TensorSpec], world_size: int) -> tuple[tuple[Piece, ...], ...]:
    """For each rank, the pieces it writes. Deterministic: the same inputs give the same answer on every rank."""
    if world_size < 1:
        raise CheckpointError(f"world size must be at least 1, got {world_size}")
    per_rank: list[list[Piece]] = [[] for _ in range(world_size)]
    loads = [(0, rank) for rank in range(world_size)]
    for name in sorted(specs, key=lambda n: (-specs[n].nbytes, n)):
        spec = specs[name]
        for region in _cut_dim0(spec, world_size):
            load, rank = heapq.heappop(loads)
            per_rank[rank].append(Piece(name, region))
            heapq.heappush(loads, (load + region.volume * itemsize(spec.dtype), rank))
    return tuple(tuple(pieces) for pieces in per_rank)


def local_region(shape: tuple[int, ...], rank: int, world_size: int, shard_dim: int | None) -> Region:
    """The region rank `rank` of `world_size` holds: the whole tensor, or its part of `shard_dim`."""
    if not 0 <= rank < world_size:
        raise CheckpointError(f"rank {rank} is outside world size {world_size}")
    if shard_dim is None:
        return Region.full(shape)
    if not 0 <= shard_dim < len(shape):
        raise CheckpointError(f"cannot shard a tensor of shape {list(shape)} on dimension {shard_dim}")
    start, size = split_extent(shape[shard_dim], world_size, rank)
    offsets = tuple(start if d == shard_dim else 0 for d in range(len(shape)))
    sizes = tuple(size if d == shard_dim else n for d, n in enumerate(shape))
    return Region(offsets, sizes)
