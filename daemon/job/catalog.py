"""The job's checkpoint catalog in etcd (`jobs/{job}/checkpoints/{step}`).

Rank 0 of a generation reports each checkpoint it commits; the coordinator records it here, so
choosing where to restart needs neither the checkpoint storage nor MindSpore. The workers verify
every byte they load: one that cannot load the chosen checkpoint exits with
EXIT_CHECKPOINT_UNREADABLE, and the entry is marked bad so the next launch falls back to an older
one. A rollback makes newer entries stale: they describe a future that was abandoned (a later
generation writes those steps again), so they are marked superseded.

A checkpoint's path comes from a worker's report: it is confined to the job's checkpoint root when it
is recorded, and again before a worker is told to resume from it (`inside_root`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from daemon.store import keys
from daemon.store.fenced_cache import FencedCache
from daemon.store.interface import Fence, Store


def inside_root(root: str | None, path: str) -> bool:
    """`path`, normalised (os.path.normpath: `..` and `.` parts), is an absolute path of printable
    characters strictly inside `root`. Symbolic links are not resolved here (the coordinator does not
    mount the storage); the workers resolve them when they load (trainer.checkpoint.step_dirs)."""
    if root is None or not path.isprintable() or not os.path.isabs(path) or not os.path.isabs(root):
        return False
    normal, base = os.path.normpath(path), os.path.normpath(root)
    return normal != base and normal.startswith(base.rstrip("/") + "/")


@dataclass(frozen=True)
class CheckpointEntry:
    step: int
    consumed_samples: int
    path: str
    generation: int
    world_size: int
    problem: str = ""  # why a worker could not load it; empty when it loaded (or was never tried)
    superseded: bool = False  # the job rolled back to an older checkpoint
    # When the leader heard of the commit (wall seconds); None in an entry an older trainerd recorded.
    committed_at: float | None = None

    @property
    def good(self) -> bool:
        return not self.problem and not self.superseded

    def to_json(self) -> dict:
        return {"step": self.step, "consumed_samples": self.consumed_samples, "path": self.path,
                "generation": self.generation, "world_size": self.world_size, "problem": self.problem,
                "superseded": self.superseded, "committed_at": self.committed_at}

    @classmethod
    def from_json(cls, data: dict) -> "CheckpointEntry":
        return cls(int(data["step"]), int(data["consumed_samples"]), str(data["path"]), int(data["generation"]),
                   int(data["world_size"]), str(data.get("problem", "")), bool(data.get("superseded", False)),
                   None if data.get("committed_at") is None else float(data["committed_at"]))


class CheckpointCatalog:
    """In-memory mirror of the catalog, written through with fenced compare-and-swap."""

    def __init__(self, store: Store, job_name: str) -> None:
        self._job = job_name
        self._entries = FencedCache(store, keys.checkpoints(job_name), CheckpointEntry.from_json)

    async def load(self) -> None:
        await self._entries.load()

    def entries(self) -> tuple[CheckpointEntry, ...]:
        """Oldest first."""
        return tuple(sorted(self._entries.values(), key=lambda entry: entry.step))

    def get(self, step: int) -> CheckpointEntry | None:
        return self._entries.get(keys.checkpoint(self._job, step))

    async def record(self, entry: CheckpointEntry, fence: Fence) -> None:
        """A committed checkpoint; one at the same step from an abandoned timeline is replaced."""
        await self._put(entry, fence)

    async def forget_all_but_newest(self, count: int, fence: Fence) -> int:
        """Delete the entries older than the newest `count` (returns how many): the workers keep only the
        newest `checkpoint.keep` checkpoints on disk, so an older entry names files that are gone, and a
        job that saves for weeks must not grow etcd without end."""
        doomed = self.entries()[:max(0, len(self._entries.values()) - count)]
        for entry in doomed:
            await self._entries.delete(keys.checkpoint(self._job, entry.step), fence)
        return len(doomed)

    async def mark_bad(self, step: int, problem: str, fence: Fence) -> None:
        entry = self.get(step)
        if entry is not None and entry.good:
            await self._put(replace(entry, problem=problem), fence)

    async def supersede_after(self, step: int, fence: Fence) -> None:
        """The job rolled back to `step`: newer checkpoints are no longer candidates."""
        for entry in self.entries():
            if entry.step > step and not entry.superseded:
                await self._put(replace(entry, superseded=True), fence)

    async def _put(self, entry: CheckpointEntry, fence: Fence) -> None:
        await self._entries.put(keys.checkpoint(self._job, entry.step), entry, fence)
