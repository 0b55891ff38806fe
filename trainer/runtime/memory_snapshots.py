"""In-memory snapshots: every N steps each rank copies its share of the state into the shared memory
its agent owns (TRAINERD_MEMORY_DIR, on tmpfs), so that a crashed worker loses at most N steps.

A snapshot is a checkpoint in every respect but where it lives: the same writer (`CheckpointWriter`),
the same shard ownership, the same commit (rank 0 writes the manifest last, once every rank's report
is there, so a snapshot torn by a crash is never complete), the same meta (data position, skip ledger)
and the same cells (the guard's state among them). tmpfs makes the writer's fsyncs free. Retention
keeps MEMORY_KEEP complete snapshots, so the memory holds at most two of a rank's state: the newest
complete snapshot and the one being written. The agent reports the newest complete one in its heartbeats; the
coordinator resumes from it when it is newer than the newest disk checkpoint (daemon/job/decide.py).

All ranks of a generation must share the directory: the coordinator asks for snapshots only when the
generation runs on one host (until agents copy snapshots to each other, issue 15 item 2).

A failed snapshot is logged and training goes on: the disk checkpoints remain the fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from trainer.checkpoint import CheckpointError, CheckpointMeta, CheckpointWriter
from trainer.checkpoint.sharding import ShardedTensor

log = logging.getLogger(__name__)

MEMORY_KEEP = 1
# Every rank writes into the same local memory: a rank that has not written its share this long after
# rank 0 has died (and the generation with it).
MEMORY_COMMIT_TIMEOUT_S = 60.0


class MemorySnapshots:
    """One rank's snapshots into `directory`, after every `every`-th step (global step numbers)."""

    def __init__(self, directory: Path, every: int, rank: int, world_size: int, generation: int,
                 where: str) -> None:
        if every < 1:
            raise ValueError(f"the snapshot interval must be at least 1, got {every}")
        self.every = every
        self._where = where
        self._writer = CheckpointWriter(directory, rank, world_size, generation=generation, keep=MEMORY_KEEP,
                                        commit_timeout_s=MEMORY_COMMIT_TIMEOUT_S)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, meta: CheckpointMeta, tensors: Mapping[str, np.ndarray],
             sharded: Mapping[str, ShardedTensor]) -> None:
        """Copy this rank's share and return; the file and the commit are written in the background.
        Waits for the previous snapshot first (a failed one is logged, not raised)."""
        self._settle()
        try:
            self._writer.save_async(meta, tensors, sharded)
        except (CheckpointError, OSError) as exc:
            log.warning("%s: could not snapshot step %d into memory: %s", self._where, meta.step, exc)

    def close(self) -> None:
        self._settle()
        self._writer.close()

    def _settle(self) -> None:
        try:
            self._writer.wait()
        except (CheckpointError, OSError) as exc:
            log.warning("%s: an in-memory snapshot failed: %s", self._where, exc)
