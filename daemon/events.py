"""The job's event log in etcd (`jobs/{job}/events/{seq}`): what happened, when, and why."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from common.clock import Clock
from daemon.leader import ensure_fence
from daemon.store import codec, keys
from daemon.store.interface import Fence, Store

log = logging.getLogger(__name__)


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


class EventLog:
    """Appends events with increasing sequence numbers; only the leader appends (fenced)."""

    def __init__(self, store: Store, job_name: str, clock: Clock) -> None:
        self._store = store
        self._job = job_name
        self._clock = clock
        self._next_seq: int | None = None
        self._load_lock = asyncio.Lock()

    async def _load_next_seq(self) -> int:
        kvs, _ = await self._store.get_prefix(keys.events(self._job))
        return max((int(kv.key.rsplit("/", 1)[1]) for kv in kvs), default=0) + 1

    async def append(self, kind: str, message: str, fence: Fence, **fields) -> Event:
        """Sequence numbers are handed out without awaiting, so concurrent appends (thousands of nodes
        joining at once) never race for the same number; a re-read happens only after a conflict."""
        while True:
            if self._next_seq is None:
                async with self._load_lock:
                    if self._next_seq is None:
                        self._next_seq = await self._load_next_seq()
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

    async def read(self, after_seq: int = 0) -> list[Event]:
        kvs, _ = await self._store.get_prefix(keys.events(self._job))
        events = [Event.from_json(codec.decode(kv.value, key=kv.key)) for kv in kvs]
        return [e for e in events if e.seq > after_seq]
