"""The job's event log in etcd (`jobs/{job}/events/{seq}`): what happened, when, and why.

The log is bounded: the leader's periodic pass deletes the oldest events beyond the newest `keep`
and those older than `max_age_s` (never the newest, so sequence numbers never start over). Nothing
reads the whole prefix: events are read a page at a time, and the next sequence number comes from
the newest key alone. Keys are zero-padded, so they sort as the numbers do.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from common.clock import Clock
from daemon.leader import ensure_fence
from daemon.store import codec, keys
from daemon.store.interface import Fence, Store, prefix_end

log = logging.getLogger(__name__)

# The most events one read returns (each is at most a few KiB: far below gRPC's 4 MiB messages).
EVENTS_PAGE = 500
# Compaction deletes at most this many pages per pass; the next pass goes on.
COMPACTION_PAGES_PER_PASS = 20


@dataclass(frozen=True)
class Event:
    seq: int
    at: float  # wall-clock seconds
    kind: str  # e.g. node_joined, node_lost, generation_started
    message: str
    fields: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"seq": self.seq, "at": self.at, "kind": self.kind, "message": self.message,
                "fields": self.fields}

    @classmethod
    def from_json(cls, data: dict) -> "Event":
        return cls(int(data["seq"]), float(data["at"]), str(data["kind"]), str(data["message"]),
                   dict(data.get("fields", {})))


def _seq_of(key: str) -> int:
    return int(key.rsplit("/", 1)[1])


class EventLog:
    """Appends events with increasing sequence numbers; only the leader appends (fenced)."""

    def __init__(self, store: Store, job_name: str, clock: Clock) -> None:
        self._store = store
        self._job = job_name
        self._clock = clock
        self._prefix = keys.events(job_name)
        self._end = prefix_end(self._prefix)
        self._next_seq: int | None = None
        self._load_lock = asyncio.Lock()

    async def _newest_seq(self) -> int:
        """The newest event's sequence number (0: none), read from the last key alone."""
        kvs, _ = await self._store.get_range(self._prefix, self._end, limit=1, descending=True)
        return _seq_of(kvs[0].key) if kvs else 0

    async def append(self, kind: str, message: str, fence: Fence, **fields) -> Event:
        """Sequence numbers are handed out without awaiting, so concurrent appends (thousands of nodes
        joining at once) never race for the same number; a re-read happens only after a conflict."""
        while True:
            if self._next_seq is None:
                async with self._load_lock:
                    if self._next_seq is None:
                        self._next_seq = await self._newest_seq() + 1
            event = Event(self._next_seq, self._clock.wall(), kind, message, fields)
            self._next_seq += 1
            written = await self._store.compare_and_swap(
                keys.event(self._job, event.seq), codec.encode(event.to_json()), 0, fence=fence
            )
            if written is not None:
                log.info("event %s: %s", kind, message)
                return event
            # A previous leader wrote this sequence number, or our fence broke: re-read.
            await ensure_fence(self._store, fence)
            self._next_seq = None

    async def read(self, after_seq: int = 0, limit: int = EVENTS_PAGE) -> list[Event]:
        """The oldest `limit` (at most EVENTS_PAGE) events with a sequence number above `after_seq`."""
        start = keys.event(self._job, max(after_seq, 0) + 1)
        kvs, _ = await self._store.get_range(start, self._end, limit=max(1, min(limit, EVENTS_PAGE)))
        return [Event.from_json(codec.decode(kv.value, key=kv.key)) for kv in kvs]

    async def compact(self, keep: int, max_age_s: float, fence: Fence) -> int:
        """Delete the oldest events beyond the newest `keep`, and those older than `max_age_s`, a page
        at a time (at most COMPACTION_PAGES_PER_PASS pages: the next pass goes on). The newest event
        always stays. Returns how many were deleted.

        Raises:
            LeadershipLost: another coordinator leads.
            StoreError: etcd failed.
        """
        newest = await self._newest_seq()
        kept_from = newest - keep + 1  # by count, every older event goes
        deleted = 0
        for _ in range(COMPACTION_PAGES_PER_PASS):
            kvs, _ = await self._store.get_range(self._prefix, self._end, limit=EVENTS_PAGE)
            doomed = 0
            for kv in kvs:
                seq = _seq_of(kv.key)
                if seq >= newest:
                    break
                if seq >= kept_from and not self._older_than(kv.key, kv.value, max_age_s):
                    break
                doomed += 1
            if not doomed:
                break
            count = await self._store.delete_range(kvs[0].key, kvs[doomed - 1].key + "\0", fence=fence)
            if count is None:
                await ensure_fence(self._store, fence)
                break
            deleted += count
            if doomed < len(kvs):
                break
        if deleted:
            log.info("job %s: %d old event(s) deleted (keeping at most %d, none older than %.0f days)", self._job,
                     deleted, keep, max_age_s / 86400)
        return deleted

    def _older_than(self, key: str, value: bytes, max_age_s: float) -> bool:
        """False for an event this trainerd cannot read: its age is unknown, the count bounds it."""
        try:
            at = Event.from_json(codec.decode(value, key=key)).at
        except (codec.BadValue, KeyError, TypeError, ValueError):
            return False
        return at < self._clock.wall() - max_age_s
