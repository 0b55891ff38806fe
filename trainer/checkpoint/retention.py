"""Retention: after a commit, keep the newest `keep` complete checkpoints and remove older ones and leftovers."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from common.atomic_write import fsync_dir
from trainer.checkpoint.manifest import MANIFEST_NAME
from trainer.checkpoint.step_dirs import list_checkpoints

log = logging.getLogger(__name__)


def remove_checkpoint(step_dir: Path) -> None:
    """Removes the manifest first, durably, so a half-removed checkpoint never looks complete. A symbolic link
    in place of a step directory (never a complete checkpoint) is removed itself; what it points to is left alone.
    """
    if step_dir.is_symlink():
        step_dir.unlink()
        return
    manifest = step_dir / MANIFEST_NAME
    if manifest.exists():
        manifest.unlink()
        fsync_dir(step_dir)
    shutil.rmtree(step_dir)


def prune(root: Path, keep: int, committed_step: int) -> list[Path]:
    """Keeps the `keep` newest complete checkpoints; removes older complete ones and every incomplete
    directory older than `committed_step` (saves that never finished). Newer directories are left alone.
    """
    infos = list_checkpoints(root)
    kept = {info.step for info in [i for i in infos if i.complete][-keep:]}
    removed = []
    for info in infos:
        if info.step in kept or info.step >= committed_step:
            continue
        remove_checkpoint(info.path)
        removed.append(info.path)
        log.info("Removed checkpoint %s (%s).", info.path, "retention" if info.complete else info.problem)
    return removed
