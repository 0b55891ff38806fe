"""The job's event log in etcd (`jobs/{job}/events/{seq}`): what happened, when, and why.

The log is bounded: the leader's periodic pass deletes the oldest events beyond the newest `keep`
and those older than `max_age_s` (never the newest, so sequence numbers never start over). Nothing
reads the whole prefix: events are read a page at a time, and the next sequence number comes from
the newest key alone. Keys are zero-padded, so they sort as the numbers do.

Events about nodes (NODE_EVENT_KINDS: joined, ready, lost, drained, checked) are kept under their own
prefix (`jobs/{job}/node_events/{seq}`), numbered with the others and read merged with them, and bounded
apart: each kind of history keeps its newest `keep`. A node comes and goes as often as its agent dials, and
one certificate's 150 Hello/close cycles, each with a new host, left no job event after the next compaction
(issue 47): the newest job events now survive any amount of node churn.
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
# Compaction deletes at most this many pages per pass (of each kind of history); the next pass goes on.
COMPACTION_PAGES_PER_PASS = 20
# The events about a node rather than the job, kept and bounded apart from the job's.
NODE_EVENT_KINDS = frozenset({
    "node_joined", "node_ready", "node_lost", "node_forgotten", "node_drained", "node_undrained",
    "node_check_started", "node_check_passed", "node_check_failed",
})


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


def _ordinal_of(key: str, value: bytes) -> int:
    """An event's place among its prefix's events. An event written before node events were kept apart has
    none: they were all numbered in one run then, so its sequence number is its place (and an unreadable
    one's, which the count bounds)."""
    try:
        return int(codec.decode(value, key=key).get("ordinal", _seq_of(key)))
    except (codec.BadValue, AttributeError, TypeError, ValueError):
        return _seq_of(key)


class EventLog:
    """Appends events with increasing sequence numbers; only the leader appends (fenced)."""

    def __init__(self, store: Store, job_name: str, clock: Clock) -> None:
        self._store = store
        self._job = job_name
        self._clock = clock
        self._prefixes = (keys.events(job_name), keys.node_events(job_name))  # the job's, the nodes'
        self._next_seq: int | None = None
        # Per prefix, the next event's ordinal: its place among that prefix's events, stored with it, by which
        # compaction counts what it keeps of each (the sequence numbers of either have gaps: the other's).
        self._next_ordinal: dict[str, int] = {}
        self._load_lock = asyncio.Lock()

    async def _newest(self, prefix: str) -> tuple[int, int]:
        """The sequence number and ordinal of the newest event under `prefix` ((0, 0): none), from its key alone."""
        kvs, _ = await self._store.get_range(prefix, prefix_end(prefix), limit=1, descending=True)
        return (_seq_of(kvs[0].key), _ordinal_of(kvs[0].key, kvs[0].value)) if kvs else (0, 0)

    def _prefix(self, kind: str) -> str:
        return self._prefixes[1] if kind in NODE_EVENT_KINDS else self._prefixes[0]

    async def append(self, kind: str, message: str, fence: Fence, **fields) -> Event:
        """Sequence numbers are handed out without awaiting, so concurrent appends (thousands of nodes
        joining at once) never race for the same number; a re-read happens only after a conflict."""
        while True:
            if self._next_seq is None:
                async with self._load_lock:
                    if self._next_seq is None:
                        newest = [await self._newest(prefix) for prefix in self._prefixes]
                        self._next_ordinal = {p: ordinal + 1 for p, (_, ordinal) in zip(self._prefixes, newest)}
                        self._next_seq = max(seq for seq, _ in newest) + 1
            prefix = self._prefix(kind)
            event = Event(self._next_seq, self._clock.wall(), kind, message, fields)
            ordinal = self._next_ordinal[prefix]
            self._next_seq += 1
            self._next_ordinal[prefix] += 1
            written = await self._store.compare_and_swap(
                prefix + f"{event.seq:012d}", codec.encode({**event.to_json(), "ordinal": ordinal}), 0, fence=fence
            )
            if written is not None:
                log.info("event %s: %s", kind, message)
                return event
            # A previous leader wrote this sequence number, or our fence broke: re-read.
            await ensure_fence(self._store, fence)
            self._next_seq = None

    async def read(self, after_seq: int = 0, limit: int = EVENTS_PAGE) -> list[Event]:
        """The oldest `limit` (at most EVENTS_PAGE) events with a sequence number above `after_seq`, of both
        kinds (a page of each, merged: the oldest `limit` of the two are among them)."""
        limit = max(1, min(limit, EVENTS_PAGE))
        kvs = []
        for prefix in self._prefixes:
            page, _ = await self._store.get_range(prefix + f"{max(after_seq, 0) + 1:012d}", prefix_end(prefix),
                                                  limit=limit)
            kvs.extend(page)
        kvs.sort(key=lambda kv: _seq_of(kv.key))
        return [Event.from_json(codec.decode(kv.value, key=kv.key)) for kv in kvs[:limit]]

    async def compact(self, keep: int, max_age_s: float, fence: Fence) -> int:
        """Delete the oldest events beyond the newest `keep` of each kind (the job's, the nodes'), and those
        older than `max_age_s`, a page at a time (at most COMPACTION_PAGES_PER_PASS pages of each: the next
        pass goes on). The newest event of each kind always stays. Returns how many were deleted.

        Raises:
            LeadershipLost: another coordinator leads.
            StoreError: etcd failed.
        """
        deleted = 0
        for prefix in self._prefixes:
            deleted += await self._compact(prefix, keep, max_age_s, fence)
        if deleted:
            log.info("job %s: %d old event(s) deleted (keeping at most %d of the job's and %d of its nodes', none "
                     "older than %.0f days)", self._job, deleted, keep, keep, max_age_s / 86400)
        return deleted

    async def _compact(self, prefix: str, keep: int, max_age_s: float, fence: Fence) -> int:
        """`compact` of the events under `prefix`, counted among themselves (by their ordinals)."""
        newest, newest_ordinal = await self._newest(prefix)
        kept_from = newest_ordinal - keep + 1  # by count, every older event goes
        deleted = 0
        for _ in range(COMPACTION_PAGES_PER_PASS):
            kvs, _ = await self._store.get_range(prefix, prefix_end(prefix), limit=EVENTS_PAGE)
            doomed = 0
            for kv in kvs:
                seq = _seq_of(kv.key)
                if seq >= newest:
                    break
                if _ordinal_of(kv.key, kv.value) >= kept_from and not self._older_than(kv.key, kv.value, max_age_s):
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
        return deleted

    def _older_than(self, key: str, value: bytes, max_age_s: float) -> bool:
        """False for an event this trainerd cannot read: its age is unknown, the count bounds it."""
        try:
            at = Event.from_json(codec.decode(value, key=key)).at
        except (codec.BadValue, KeyError, TypeError, ValueError):
            return False
        return at < self._clock.wall() - max_age_s
