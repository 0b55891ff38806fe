"""Export: one plain safetensors file holding every tensor whole, under its own name, that
`mindspore.load_checkpoint(path, format="safetensors")` loads. Tensors stream through one at a time.
"""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint.chunk_reader import ChunkReader
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.layout import Region
from trainer.checkpoint.loader import read_region
from trainer.checkpoint.manifest import Manifest
from trainer.checkpoint.safetensors_file import write_safetensors
from trainer.checkpoint.sharding import TensorSpec
from trainer.checkpoint.step_dirs import check_complete


def export_safetensors(step_dir: Path, out_path: Path) -> Manifest:
    """Writes `out_path` (temporary name, fsync, rename), verifying every byte of the checkpoint as it is
    read; nothing is left at `out_path` when that fails. Refuses to overwrite.
    """
    if out_path.exists():
        raise CheckpointError(f"{out_path} already exists")
    if not out_path.parent.is_dir():
        raise CheckpointError(f"{out_path.parent} is not a directory")
    manifest = check_complete(step_dir)
    names = sorted(manifest.tensors)
    entries = [(n, TensorSpec(manifest.tensors[n].dtype, manifest.tensors[n].shape)) for n in names]
    files = {entry.name: entry for entry in manifest.files}
    with ChunkReader(step_dir, manifest.tensors, files) as reader:
        arrays = (read_region(reader, manifest.tensors, n, Region.full(manifest.tensors[n].shape)) for n in names)
        write_safetensors(out_path, entries, arrays)
    return manifest
