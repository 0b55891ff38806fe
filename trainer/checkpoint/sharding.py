"""How a world size divides the tensors: which rank writes which piece, and which region each rank loads.

Writing: a tensor is held whole by every data-parallel rank, or, when it is sharded (`ShardedTensor`, from a
tensor- or optimizer-parallel layout), each rank holds one region of it and several ranks may hold the same
region. Every distinct region is written once: cut along dimension 0 into pieces of at least MIN_PIECE_BYTES
(at most one per rank holding it) and each piece given to the rank holding it that has the fewest bytes so
far, largest tensors first. All ranks compute the same assignment from the names, shapes, dtypes and regions
alone, and every rank writes about 1/world_size of the bytes, in parallel.

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


@dataclass(frozen=True)
class ShardedTensor:
    """A tensor no rank holds whole: its global `shape`, and `regions[r]`, the part rank r holds."""

    shape: tuple[int, ...]
    regions: tuple[Region, ...]


def split_extent(length: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` when `length` is cut into `parts` nearly equal parts, larger parts first."""
    base, extra = divmod(length, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


def _cut_dim0(region: Region, dtype: str, holders: int) -> list[Region]:
    if not region.sizes:
        return [region]
    nbytes = region.volume * itemsize(dtype)
    parts = max(1, min(holders, region.sizes[0], nbytes // MIN_PIECE_BYTES))
    pieces = []
    for index in range(parts):
        start, size = split_extent(region.sizes[0], parts, index)
        pieces.append(Region((region.offsets[0] + start, *region.offsets[1:]), (size, *region.sizes[1:])))
    return pieces


def _holders(
    name: str, spec: TensorSpec, sharded: ShardedTensor | None, world_size: int
) -> list[tuple[Region, list[int]]]:
    """Each distinct region of the tensor with the ranks holding it (in rank order), by offsets."""
    if sharded is None:
        return [(Region.full(spec.shape), list(range(world_size)))]
    if len(sharded.regions) != world_size or sharded.shape != spec.shape:
        raise CheckpointError(
            f"tensor '{name}' of shape {list(spec.shape)} is sharded as shape {list(sharded.shape)} "
            f"over {len(sharded.regions)} ranks, not {world_size}"
        )
    holders: dict[Region, list[int]] = {}
    for rank, region in enumerate(sharded.regions):
        holders.setdefault(region, []).append(rank)
    return sorted(holders.items(), key=lambda item: item[0].offsets)


def write_assignment(
    specs: Mapping[str, TensorSpec], world_size: int, sharded: Mapping[str, ShardedTensor] | None = None
) -> tuple[tuple[Piece, ...], ...]:
    """For each rank, the pieces it writes: regions of the global tensors. A tensor named in `sharded` is
    written from the regions the ranks hold (`specs` gives its global shape), every other one is held whole
    by every rank. Deterministic: the same inputs give the same answer on every rank.
    """
    if world_size < 1:
        raise CheckpointError(f"world size must be at least 1, got {world_size}")
    sharded = sharded or {}
    per_rank: list[list[Piece]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for name in sorted(specs, key=lambda n: (-specs[n].nbytes, n)):
        spec = specs[name]
        for region, ranks in _holders(name, spec, sharded.get(name), world_size):
            least_loaded = [(loads[r], r) for r in ranks]
            heapq.heapify(least_loaded)
            for piece in _cut_dim0(region, spec.dtype, len(ranks)):
                _, rank = heapq.heappop(least_loaded)
                per_rank[rank].append(Piece(name, piece))
                loads[rank] += piece.volume * itemsize(spec.dtype)
                heapq.heappush(least_loaded, (loads[rank], rank))
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
