"""Offline resharding: rewrite a checkpoint (or an imported MindSpore one) for another world size.

The output is what `CheckpointWriter`s of the new world size would have written: one file per rank with
the pieces `sharding.write_assignment` gives it, then the manifest, written last. Each output file is
filled from the source through read plans, so only one rank file's data is in memory at a time. When
anything fails the output directory is removed; an output without its manifest never counts as complete.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

from trainer.checkpoint.chunk_reader import ChunkReader
from trainer.checkpoint.commit import commit_manifest
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.layout import Chunk, TensorLayout
from trainer.checkpoint.loader import read_region
from trainer.checkpoint.manifest import CheckpointMeta, FileEntry, Manifest, step_dir_name
from trainer.checkpoint.rank_file import write_rank_file
from trainer.checkpoint.sharding import TensorSpec, write_assignment
from trainer.checkpoint.step_dirs import check_complete


def write_resharded(
    source_dir: Path,
    tensors: Mapping[str, TensorLayout],
    meta: CheckpointMeta,
    out_root: Path,
    world_size: int,
    source_files: Mapping[str, FileEntry] | None = None,
) -> Path:
    """Writes `out_root/step_N` for `world_size` ranks from the chunks of `tensors` under `source_dir`,
    verifying what it reads against `source_files` (the source manifest's files) when given.
    Refuses an output directory that already exists.
    """
    step_dir = out_root / step_dir_name(meta.step)
    if step_dir.exists():
        raise CheckpointError(f"{step_dir} already exists")
    specs = {name: TensorSpec(layout.dtype, layout.shape) for name, layout in tensors.items()}
    assignment = write_assignment(specs, world_size)
    out_root.mkdir(parents=True, exist_ok=True)
    step_dir.mkdir()
    try:
        files: list[FileEntry] = []
        chunks: dict[str, list[Chunk]] = {name: [] for name in tensors}
        with ChunkReader(source_dir, tensors, source_files) as reader:
            for rank, pieces in enumerate(assignment):
                arrays = (read_region(reader, tensors, p.tensor, p.region) for p in pieces)
                entry, rank_chunks = write_rank_file(step_dir, rank, pieces, specs, arrays)
                files.append(entry)
                for name, held in rank_chunks.items():
                    chunks[name].extend(held)
        layouts = {name: TensorLayout(s.dtype, s.shape, tuple(chunks[name])) for name, s in specs.items()}
        commit_manifest(step_dir, Manifest(meta, world_size, 0, tuple(files), layouts))
    except BaseException:
        shutil.rmtree(step_dir, ignore_errors=True)
        raise
    return step_dir


def reshard_checkpoint(step_dir: Path, out_root: Path, world_size: int) -> Path:
    """Writes the checkpoint at `step_dir` for `world_size` ranks as `out_root/step_N`. Every byte of the
    source is read, and verified as it is read.
    """
    manifest = check_complete(step_dir)
    files = {entry.name: entry for entry in manifest.files}
    return write_resharded(step_dir, manifest.tensors, manifest.meta, out_root, world_size, files)
