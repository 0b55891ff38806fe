"""Loading at any world size: carry out a read plan with `safe_open(...).get_slice(...)`, verifying digests.

Files are verified on a helper thread one after the other while the main thread copies the slices out of
the files already verified (the verification read leaves them in the page cache), so hashing overlaps
copying and only slices that passed their digest are ever handed back.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from trainer.checkpoint.catalog import check_complete, list_checkpoints, verify_file
from trainer.checkpoint.chunk_reader import ChunkReader
from trainer.checkpoint.errors import CheckpointError, CorruptCheckpoint, NoCheckpoint
from trainer.checkpoint.layout import Region, TensorLayout, numpy_dtype
from trainer.checkpoint.manifest import Manifest
from trainer.checkpoint.read_plan import ReadItem, plan_reads
from trainer.checkpoint.sharding import local_region

log = logging.getLogger(__name__)


class Assembly:
    """The local tensors being filled by read items: allocated on first use, or taken as is when one read
    item is the whole local tensor.
    """

    def __init__(self, tensors: Mapping[str, TensorLayout], wanted: Mapping[str, Region], items: tuple[ReadItem, ...]):
        self._wanted = wanted
        self._dtypes = {name: numpy_dtype(tensors[name].dtype) for name in wanted}
        self._counts = {name: 0 for name in wanted}
        for item in items:
            self._counts[item.tensor] += 1
        self._arrays: dict[str, np.ndarray] = {}

    def place(self, item: ReadItem, data: np.ndarray) -> None:
        region = self._wanted[item.tensor]
        if self._counts[item.tensor] == 1 and item.sizes == region.sizes:
            self._arrays[item.tensor] = data
            return
        target = self._arrays.get(item.tensor)
        if target is None:
            target = self._arrays[item.tensor] = np.empty(region.sizes, self._dtypes[item.tensor])
        target[(Ellipsis, *item.local_slices())] = data

    def result(self) -> dict[str, np.ndarray]:
        for name, region in self._wanted.items():
            if name not in self._arrays:
                self._arrays[name] = np.empty(region.sizes, self._dtypes[name])
        return self._arrays


def read_region(reader: ChunkReader, tensors: Mapping[str, TensorLayout], name: str, region: Region) -> np.ndarray:
    """One region of one tensor, assembled from every chunk it touches."""
    wanted = {name: region}
    items = plan_reads(tensors, wanted)
    assembly = Assembly(tensors, wanted, items)
    for item in items:
        assembly.place(item, reader.read(item))
    return assembly.result()[name]


def _wanted_regions(
    manifest: Manifest, rank: int, world_size: int, shard_dims: Mapping[str, int] | None
) -> dict[str, Region]:
    shard_dims = shard_dims or {}
    unknown = sorted(set(shard_dims) - set(manifest.tensors))
    if unknown:
        raise CheckpointError(f"cannot shard tensors the checkpoint does not hold: {unknown[:5]}")
    return {
        name: local_region(layout.shape, rank, world_size, shard_dims.get(name))
        for name, layout in manifest.tensors.items()
    }


def load_checkpoint(
    step_dir: Path | str,
    rank: int,
    world_size: int,
    shard_dims: Mapping[str, int] | None = None,
    *,
    verify_all: bool = False,
) -> tuple[dict[str, np.ndarray], Manifest]:
    """This rank's tensors from one checkpoint, whatever world size wrote it.

    Every tensor comes whole, except those named in `shard_dims`, which come as this rank's part of the
    given dimension. The files read are verified first (`verify_all`: every file of the checkpoint, so
    that all ranks judge the checkpoint alike). Raises CorruptCheckpoint, never returns unverified data.
    """
    step_dir = Path(step_dir)
    manifest = check_complete(step_dir)
    wanted = _wanted_regions(manifest, rank, world_size, shard_dims)
    items = plan_reads(manifest.tensors, wanted)
    assembly = Assembly(manifest.tensors, wanted, items)
    needed = list(dict.fromkeys(item.file for item in items))
    to_verify = needed + [f.name for f in manifest.files if verify_all and f.name not in needed]
    with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-verify") as verifier, ChunkReader(
        step_dir, manifest.tensors
    ) as reader:
        verified = {name: verifier.submit(verify_file, step_dir, manifest.file(name)) for name in to_verify}
        try:
            for file, group in itertools.groupby(items, key=lambda item: item.file):
                verified[file].result()
                for item in group:
                    assembly.place(item, reader.read(item))
            for future in verified.values():
                future.result()
        finally:
            for future in verified.values():
                future.cancel()
    return assembly.result(), manifest


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
            log.warning("Rank %d passes over checkpoint %s: %s; falling back to the previous one.", rank, info.path, exc)
    raise NoCheckpoint(f"no complete checkpoint that verifies under {root}")
