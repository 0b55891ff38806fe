"""Export: one plain safetensors file holding every tensor whole, under its own name, that
`mindspore.load_checkpoint(path, format="safetensors")` loads. Tensors stream through one at a time.
"""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint.catalog import verify_checkpoint
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.layout import Region
from trainer.checkpoint.chunk_reader import ChunkReader
from trainer.checkpoint.loader import read_region
from trainer.checkpoint.manifest import Manifest
from trainer.checkpoint.safetensors_file import write_safetensors
from trainer.checkpoint.sharding import TensorSpec


def export_safetensors(step_dir: Path, out_path: Path) -> Manifest:
    """Verifies the checkpoint, then writes `out_path` (temporary name, fsync, rename). Refuses to overwrite."""
    if out_path.exists():
        raise CheckpointError(f"{out_path} already exists")
    if not out_path.parent.is_dir():
        raise CheckpointError(f"{out_path.parent} is not a directory")
    manifest = verify_checkpoint(step_dir)
    names = sorted(manifest.tensors)
    entries = [(n, TensorSpec(manifest.tensors[n].dtype, manifest.tensors[n].shape)) for n in names]
    with ChunkReader(step_dir, manifest.tensors) as reader:
        arrays = (read_region(reader, manifest.tensors, n, Region.full(manifest.tensors[n].shape)) for n in names)
        write_safetensors(out_path, entries, arrays)
    return manifest
