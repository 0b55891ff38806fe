"""Verifying whole checkpoints: every file's header and every segment's checksum (see `chunk_reader`). Reads
bytes only, so the coordinator verifies bfloat16 checkpoints without MindSpore.
"""

from __future__ import annotations

import logging
from pathlib import Path

from trainer.checkpoint.chunk_reader import ChunkReader
from trainer.checkpoint.errors import CorruptCheckpoint
from trainer.checkpoint.manifest import Manifest
from trainer.checkpoint.step_dirs import check_complete, list_checkpoints

log = logging.getLogger(__name__)


def verify_checkpoint(step_dir: Path) -> Manifest:
    """The manifest, once the checkpoint is complete and every byte of every file verifies; else
    CorruptCheckpoint naming the file, and the key and segment, that is wrong.
    """
    manifest = check_complete(step_dir)
    files = {entry.name: entry for entry in manifest.files}
    with ChunkReader(step_dir, manifest.tensors, files) as reader:
        reader.verify(None)
    return manifest


def latest_verified(root: Path) -> tuple[Path, Manifest] | None:
    """The newest checkpoint that is complete and verifies, saying in the log why any newer one was passed
    over. Reads every byte of the checkpoints it tries.
    """
    for info in reversed(list_checkpoints(root)):
        try:
            return info.path, verify_checkpoint(info.path)
        except CorruptCheckpoint as exc:
            log.warning("Checkpoint %s is not usable (%s); falling back to the previous one.", info.path, exc)
    return None
