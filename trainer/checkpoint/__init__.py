"""Sharded safetensors checkpoints that load at any world size (docs/concepts/checkpoints.md).

numpy and the safetensors file format (read and written here, with per-segment CRC-32 checks; see
`digest`, `chunk_reader`, `direct_io`, `direct_writer`); MindSpore only in `trainer.checkpoint.mindspore_io`,
which this package does not import, so the coordinator can use everything here without MindSpore.

Layout on disk, under a root directory::

    step_00000100/rank_0.safetensors ... rank_{W-1}.safetensors   one file per writing rank
    step_00000100/manifest.json                                    written last: its rename is the commit

Worker runtime (every rank of a data-parallel job)::

    writer = CheckpointWriter(root, rank, world_size, generation=g, keep=3)
    state = parameters_to_numpy(net, optimizer)            # trainer.checkpoint.mindspore_io
    writer.save_async(CheckpointMeta(step, consumed_samples, data_seed, grad_accumulation,
                                     rng_state, skip_ledger), state)
    ...                                                    # training goes on while it writes
    writer.wait()                                          # or let the next save_async wait
    writer.close()

    tensors, manifest = load_checkpoint(step_dir, rank, world_size)  # the one the coordinator chose
    tensors, manifest = load_latest(root, rank, world_size)          # or: newest that verifies, fallback
    load_numpy_into(tensors, net, optimizer)                         # trainer.checkpoint.mindspore_io

`save_async` blocks only while this rank's share is copied to host buffers. Every rank must pass the same
tensor names, shapes and dtypes; rank 0 commits once every rank's file is on disk. Under tensor or optimizer
parallel, ranks pass their own slices of the cut tensors and `sharded={name: ShardedTensor}` (from
`parallel_layout`, which translates MindSpore's layouts), and load them back with `regions=`. Errors surface from
`wait()` or the next `save_async` as CheckpointError. Loads return each tensor whole; pass
`shard_dims={name: dim}` to get only this rank's `numpy.array_split` part of that dimension. Everything
loaded is verified. `load_checkpoint` raises CorruptCheckpoint rather than fall back, so ranks launched
with the same checkpoint never end up on different steps; `load_latest` verifies every byte of the
checkpoint it picks (not only what the rank needs), so all ranks judge it alike.

Coordinator (no MindSpore, no tensor data)::

    list_checkpoints(root)  -> [CheckpointInfo(path, step, manifest | None, problem | None)], oldest first;
                               cheap: manifest and file sizes, no data read
    latest_verified(root)   -> (path, Manifest) | None: newest checkpoint whose every byte verifies
    verify_checkpoint(path) -> Manifest, or CorruptCheckpoint naming what is wrong
    manifest.step, manifest.meta.consumed_samples, manifest.meta.skip_ledger, manifest.world_size

Offline: `reshard_checkpoint`, `export_safetensors`, `import_native` + `write_resharded` (also as
`trainerctl checkpoint ...`).
"""

from trainer.checkpoint.errors import CheckpointError, CorruptCheckpoint, NoCheckpoint
from trainer.checkpoint.export import export_safetensors
from trainer.checkpoint.loader import load_checkpoint, load_latest
from trainer.checkpoint.manifest import CheckpointMeta, Manifest
from trainer.checkpoint.native_import import import_native
from trainer.checkpoint.reshard import reshard_checkpoint, write_resharded
from trainer.checkpoint.step_dirs import CheckpointInfo, list_checkpoints
from trainer.checkpoint.verify import latest_verified, verify_checkpoint
from trainer.checkpoint.writer import CheckpointWriter

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointMeta",
    "CheckpointWriter",
    "CorruptCheckpoint",
    "Manifest",
    "NoCheckpoint",
    "export_safetensors",
    "import_native",
    "latest_verified",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest",
    "reshard_checkpoint",
    "verify_checkpoint",
    "write_resharded",
]
