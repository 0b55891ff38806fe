"""Loading at any world size: carry out a read plan through `ChunkReader`, verifying as it reads.

Each read item's rows are read once, straight into the local tensor where they are contiguous there, by
tasks on a thread pool that also check each segment's checksum; nothing is handed back before every task
succeeded.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from trainer.checkpoint.chunk_reader import ChunkReader, touched_segments
from trainer.checkpoint.digest import segment_count
from trainer.checkpoint.direct_io import aligned_empty
from trainer.checkpoint.errors import CheckpointError, CorruptCheckpoint, NoCheckpoint
from trainer.checkpoint.layout import Region, TensorLayout, numpy_dtype
from trainer.checkpoint.manifest import Manifest
from trainer.checkpoint.read_plan import ReadItem, plan_reads
from trainer.checkpoint.sharding import local_region
from trainer.checkpoint.step_dirs import check_complete, list_checkpoints

log = logging.getLogger(__name__)

# Bytes read but not yet verified and placed; bounds the memory of the read-ahead.
_READ_AHEAD_BYTES = 256 << 20


class Assembly:
    """The local tensors being filled by read items; items that span whole rows are read straight into them."""

    def __init__(self, tensors: Mapping[str, TensorLayout], wanted: Mapping[str, Region]) -> None:
        self._wanted = wanted
        self.arrays = {name: _aligned_array(region.sizes, numpy_dtype(tensors[name].dtype))
                       for name, region in wanted.items()}

    def target(self, item: ReadItem) -> np.ndarray | None:
        """Where the item's rows go when they are contiguous in the local tensor (the item spans its width)."""
        if item.sizes[1:] != self._wanted[item.tensor].sizes[1:]:
            return None
        local = self.arrays[item.tensor]
        return local[item.local_offsets[0] : item.local_offsets[0] + item.sizes[0]] if item.sizes else local

    def place(self, item: ReadItem, data: np.ndarray) -> None:
        self.arrays[item.tensor][(Ellipsis, *item.local_slices())] = data


def _aligned_array(sizes: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A new array whose rows can be read into with O_DIRECT (see `direct_io`)."""
    return aligned_empty(math.prod(sizes) * dtype.itemsize).view(dtype).reshape(sizes)


def run_reads(items: Iterable[ReadItem], reader: ChunkReader, assembly: Assembly) -> None:
    """Reads every item into the assembly; data read aside is placed once its reads and checks succeeded, and
    all have when this returns.
    """
    pending: deque[tuple[ReadItem, np.ndarray | None, list[Future[None]]]] = deque()
    pending_bytes = 0
    for item in items:
        data, checks = reader.read(item, assembly.target(item))
        pending.append((item, data, checks))
        pending_bytes += 0 if data is None else data.nbytes
        while pending_bytes > _READ_AHEAD_BYTES:
            pending_bytes -= _settle(pending.popleft(), assembly)
    while pending:
        _settle(pending.popleft(), assembly)


def _settle(entry: tuple[ReadItem, np.ndarray | None, list[Future[None]]], assembly: Assembly) -> int:
    item, data, checks = entry
    for check in checks:
        check.result()
    if data is None:
        return 0
    assembly.place(item, data)
    return data.nbytes


def read_region(
    reader: ChunkReader, tensors: Mapping[str, TensorLayout], name: str, region: Region
) -> np.ndarray:
    """One region of one tensor, assembled from every chunk it touches."""
    wanted = {name: region}
    assembly = Assembly(tensors, wanted)
    run_reads(plan_reads(tensors, wanted), reader, assembly)
    return assembly.arrays[name]


def _wanted_regions(
    manifest: Manifest,
    rank: int,
    world_size: int,
    shard_dims: Mapping[str, int] | None,
    regions: Mapping[str, Region] | None,
) -> dict[str, Region]:
    shard_dims, regions = shard_dims or {}, regions or {}
    unknown = sorted((set(shard_dims) | set(regions)) - set(manifest.tensors))
    if unknown:
        raise CheckpointError(f"cannot shard tensors the checkpoint does not hold: {unknown[:5]}")
    both = sorted(set(shard_dims) & set(regions))
    if both:
        raise CheckpointError(f"tensors given both a shard dimension and a region: {both[:5]}")
    return {
        name: regions[name] if name in regions else local_region(layout.shape, rank, world_size, shard_dims.get(name))
        for name, layout in manifest.tensors.items()
    }


def _unread_segments(manifest: Manifest, items: tuple[ReadItem, ...]) -> dict[tuple[str, str], list[int]]:
    """Per (file, key), the checksum segments the read items did not touch."""
    chunks = {(c.file, c.key): c for layout in manifest.tensors.values() for c in layout.chunks}
    unread = {pair: set(range(segment_count(c.region.sizes, c.segment_rows))) for pair, c in chunks.items()}
    for item in items:
        first, end = (item.chunk_offsets[0], item.chunk_offsets[0] + item.sizes[0]) if item.sizes else (0, 1)
        unread[(item.file, item.key)] -= set(touched_segments(chunks[(item.file, item.key)], first, end))
    return {pair: sorted(segments) for pair, segments in unread.items() if segments}


def load_checkpoint(
    step_dir: Path | str,
    rank: int,
    world_size: int,
    shard_dims: Mapping[str, int] | None = None,
    *,
    regions: Mapping[str, Region] | None = None,
    verify_all: bool = False,
) -> tuple[dict[str, np.ndarray], Manifest]:
    """This rank's tensors from one checkpoint, whatever world size wrote it.

    Every tensor comes whole, except those named in `shard_dims`, which come as this rank's part of the
    given dimension, and those named in `regions`, which come as that region (the part a parallel layout
    gives this rank, see `parallel_layout`). Everything read is verified; `verify_all` also verifies what this
    rank does not need, so that all ranks judge the checkpoint alike. Raises CorruptCheckpoint, never returns
    unverified data.
    """
    step_dir = Path(step_dir)
    manifest = check_complete(step_dir)
    wanted = _wanted_regions(manifest, rank, world_size, shard_dims, regions)
    items = plan_reads(manifest.tensors, wanted)
    assembly = Assembly(manifest.tensors, wanted)
    files = {entry.name: entry for entry in manifest.files}
    with ChunkReader(step_dir, manifest.tensors, files) as reader:
        run_reads(items, reader, assembly)
        if verify_all:
            reader.verify(_unread_segments(manifest, items))
    return assembly.arrays, manifest


def load_latest(
    root: Path | str, rank: int, world_size: int, shard_dims: Mapping[str, int] | None = None
) -> tuple[dict[str, np.ndarray], Manifest]:
    """Like `load_checkpoint`, from the newest checkpoint under `root` that is complete and verifies in full.

    A newer checkpoint that is incomplete or damaged is passed over with a warning in the log naming it
    and the reason. Raises NoCheckpoint when none is usable.
    """
    root = Path(root)
    for info in reversed(list_checkpoints(root)):
        if not info.complete:
            log.warning("Rank %d passes over checkpoint %s: %s.", rank, info.path, info.problem)
            continue
        try:
            return load_checkpoint(info.path, rank, world_size, shard_dims, verify_all=True)
        except CorruptCheckpoint as exc:
            log.warning(
                "Rank %d passes over checkpoint %s: %s; falling back to the previous one.", rank, info.path, exc
            )
    raise NoCheckpoint(f"no complete checkpoint that verifies under {root}")
