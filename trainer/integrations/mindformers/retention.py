"""Retention of a MindFormers job's Checkpoint 2.0 iterations across generations.

MindFormers 2.0.0 keeps `save_max` iterations of those the running process saved itself (the list its
CheckpointMonitor keeps, `current_ckpt_step_list`): the iterations an earlier process left are never removed.
Under trainerd every restart is a new process, so each generation would leave up to `save_max` iterations
behind it, and a long job's checkpoint directory would grow without bound (a large model's iterations are
hundreds of gigabytes). Rank 0's callback therefore removes, after each commit, the iterations that this
process did not save (those up to the one it resumed from) once they are no longer among the newest `keep`
committed ones, which is what trainerd's own checkpoints keep. The iterations this process saves are left to
MindFormers: removing one of those would make its own removal of it fail ("Failed to find directory to
remove"), which ends the training process.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from trainer.checkpoint.mindformers_import import iteration_of

log = logging.getLogger(__name__)


def prune_earlier_iterations(root: Path, keep: int, committed: int, resumed_from: int) -> list[Path]:
    """Remove the iteration directories under `root` numbered at most `resumed_from` (an earlier process's)
    that are not among the `keep` newest numbered at most `committed`; returns what was removed. A symbolic
    link in an iteration's place is removed itself, never what it points to; anything else is left alone."""
    iterations = sorted((number, path) for path in _entries(root)
                        if (number := iteration_of(path)) is not None and (path.is_dir() or path.is_symlink()))
    kept = {number for number, _ in [item for item in iterations if item[0] <= committed][-keep:]}
    removed = []
    for number, path in iterations:
        if number > resumed_from or number in kept:
            continue
        try:
            if path.is_symlink():
                path.unlink()
            else:
                shutil.rmtree(path)
        except OSError as exc:
            log.warning("could not remove the checkpoint %s of an earlier generation: %s", path, exc)
            continue
        log.info("removed the checkpoint %s of an earlier generation (retention keeps %d)", path, keep)
        removed.append(path)
    return removed


def _entries(root: Path) -> list[Path]:
    try:
        return list(root.iterdir())
    except OSError:
        return []
