"""The skip ledger in etcd (`jobs/{job}/skips/{id}`): sample ranges every later generation leaves out.

Ranges are half-open [start, end) in sample positions of the job's global sample stream, which
depends only on the data seed (docs/concepts/bad-batches.md), so an entry means the same samples at
every world size. Entries come from the workers' guard (a batch skipped in the step), from the
coordinator (a step that keeps crashing workers, a run of spikes rolled back) and from operators
(`trainerctl skips add`). An entry is never rewritten: its id is its range, so the same report
twice adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.errors import PermanentError
from daemon.store import keys
from daemon.store.fenced_cache import FencedCache
from daemon.store.interface import Fence, Store

MAX_REASON_CHARS = 500


class BadRange(PermanentError, ValueError):
    """A range that cannot be a ledger entry; the message says why in one line."""


@dataclass(frozen=True)
class SkipEntry:
    start: int
    end: int
    reason: str
    step: int  # the step that met it (0 when an operator added it)
    generation: int

    @property
    def id(self) -> str:
        return f"{self.start:015d}-{self.end:015d}"

    def to_json(self) -> dict:
        return {"start": self.start, "end": self.end, "reason": self.reason, "step": self.step,
                "generation": self.generation}

    @classmethod
    def from_json(cls, data: dict) -> "SkipEntry":
        return checked(int(data["start"]), int(data["end"]), str(data["reason"]), int(data["step"]),
                       int(data["generation"]))


def checked(start: int, end: int, reason: str, step: int = 0, generation: int = 0) -> SkipEntry:
    if start < 0 or end <= start:
        raise BadRange(f"sample range {start}:{end} is empty or negative (START:END, 0 <= START < END)")
    if end >= 10**15:
        raise BadRange(f"sample range {start}:{end} is beyond any dataset (END < 10**15)")
    reason = " ".join(reason.split())
    if not reason or len(reason) > MAX_REASON_CHARS:
        raise BadRange(f"a skip needs a reason of 1 to {MAX_REASON_CHARS} characters")
    return SkipEntry(start, end, reason, step, generation)


def samples_not_skipped(start: int, end: int, ranges: tuple[tuple[int, int], ...]) -> int:
    """How many positions of [start, end) no range covers (ranges may overlap)."""
    covered, position = 0, start
    for skip_start, skip_end in sorted(ranges):
        low, high = max(skip_start, position), min(skip_end, end)
        if high > low:
            covered += high - low
            position = high
    return (end - start) - covered


class SkipLedger:
    """In-memory mirror of the ledger, written through with fenced create-only writes."""

    def __init__(self, store: Store, job_name: str) -> None:
        self._job = job_name
        self._entries = FencedCache(store, keys.skips(job_name), SkipEntry.from_json)

    async def load(self) -> None:
        await self._entries.load()

    def entries(self) -> tuple[SkipEntry, ...]:
        """By start."""
        return tuple(sorted(self._entries.values(), key=lambda e: (e.start, e.end)))

    def ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple((e.start, e.end) for e in self.entries())

    def found_bad(self) -> tuple[tuple[int, int], ...]:
        """The ranges a worker or the coordinator found bad (an operator's own entries have step 0)."""
        return tuple((e.start, e.end) for e in self.entries() if e.step > 0)

    async def add(self, entry: SkipEntry, fence: Fence) -> bool:
        """True when the entry is new (an identical range already recorded adds nothing)."""
        return await self._entries.create(keys.skip(self._job, entry.id), entry, fence)
