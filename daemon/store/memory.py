"""An in-memory Store with etcd's revision semantics, for unit tests of the coordinator.

Like etcd: one global revision (1 when empty) that every successful write or delete raises by
one; each key carries its create and mod revision; a lease revoked or expired deletes all its
keys at a single revision; watches replay history from any revision not yet compacted.

Leases follow the production adapter, which keeps every lease alive until it is revoked or its
keepalive fails: a fake lease lives until `revoke()`, or until a test calls `stop_keepalive`
and the injected clock passes the last refresh + TTL. Expiry is checked at the start of every
operation and by `expire_leases()`.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import AsyncGenerator

from common.clock import Clock
from daemon.store.interface import (
    Fence,
    KeyValue,
    Lease,
    StoreError,
    WatchCompacted,
    WatchEvent,
    WatchEventKind,
)


class MemoryLease:
    def __init__(self, store: InMemoryStore, lease_id: int, ttl_s: int) -> None:
        self.id = lease_id
        self.ttl_s = ttl_s
        self._store = store
        self._lost = asyncio.Event()
        self.deadline: float | None = None  # set once the keepalive stops

    @property
    def alive(self) -> bool:
        return not self._lost.is_set()

    async def wait_lost(self) -> None:
        await self._lost.wait()

    async def revoke(self) -> None:
        self._store._revoke(self.id)

    def mark_lost(self) -> None:
        self._lost.set()


class InMemoryStore:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._revision = 1
        self._compacted = 0  # watches must start at or after this revision
        self._data: dict[str, KeyValue] = {}
        self._history: list[WatchEvent] = []  # in revision order
        self._history_revisions: list[int] = []  # parallel to _history, for bisect
        self._leases: dict[int, MemoryLease] = {}
        self._lease_ids = itertools.count(0x7E57_0001)
        self._changed = asyncio.Event()  # replaced after every commit; set to wake watchers
        self._closed = False

    # -- reads -------------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        self._begin()
        return self._data.get(key)

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        self._begin()
        kvs = sorted((kv for key, kv in self._data.items() if key.startswith(prefix)),
                     key=lambda kv: kv.key)
        return kvs, self._revision

    async def get_range(self, start_key: str, end_key: str, *, limit: int,
                        descending: bool = False) -> tuple[list[KeyValue], int]:
        self._begin()
        if limit < 1:
            raise ValueError(f"a ranged read needs a limit of at least 1, got {limit}")
        keys = sorted((key for key in self._data if start_key <= key < end_key), reverse=descending)
        return [self._data[key] for key in keys[:limit]], self._revision

    # -- writes ------------------------------------------------------------------------------

    async def compare_and_swap(
        self,
        key: str,
        value: bytes,
        expected_mod_revision: int,
        *,
        lease: Lease | None = None,
        fence: Fence | None = None,
    ) -> int | None:
        self._begin()
        if lease is not None and lease.id not in self._leases:
            raise StoreError(f"cannot write {key}: lease {lease.id:x} was revoked or expired")
        if self._mod_revision(key) != expected_mod_revision or not self._fence_holds(fence):
            return None
        revision = self._revision + 1
        previous = self._data.get(key)
        created = previous.create_revision if previous is not None else revision
        self._data[key] = KeyValue(key, value, revision, created, lease.id if lease else 0)
        self._commit([WatchEvent(WatchEventKind.PUT, key, value, revision)])
        return revision

    async def delete(self, key: str, expected_mod_revision: int | None = None, *,
                     fence: Fence | None = None) -> bool:
        self._begin()
        if key not in self._data or not self._fence_holds(fence):
            return False
        if expected_mod_revision is not None and self._data[key].mod_revision != expected_mod_revision:
            return False
        self._delete_keys([key])
        return True

    async def delete_range(self, start_key: str, end_key: str, *, fence: Fence | None = None) -> int | None:
        self._begin()
        if not self._fence_holds(fence):
            return None
        keys = sorted(key for key in self._data if start_key <= key < end_key)
        self._delete_keys(keys)
        return len(keys)

    # -- leases ------------------------------------------------------------------------------

    async def grant_lease(self, ttl_s: int) -> MemoryLease:
        self._begin()
        if ttl_s < 1:
            raise ValueError(f"a lease needs a TTL of at least 1 s, got {ttl_s}")
        lease = MemoryLease(self, next(self._lease_ids), ttl_s)
        self._leases[lease.id] = lease
        return lease

    def _revoke(self, lease_id: int) -> None:
        """Revoke a lease now: its keys go at one revision. Unknown or gone leases are ignored."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        self._delete_keys([kv.key for kv in self._data.values() if kv.lease_id == lease_id])
        lease.mark_lost()

    def stop_keepalive(self, lease: Lease) -> None:
        """Test hook: the keepalive of `lease` stops now, so it expires TTL seconds from now."""
        self._leases[lease.id].deadline = self._clock.now() + lease.ttl_s

    def expire_leases(self) -> None:
        """Expire every lease whose keepalive stopped and whose deadline the clock has passed."""
        now = self._clock.now()
        for lease in list(self._leases.values()):
            if lease.deadline is not None and now >= lease.deadline:
                self._revoke(lease.id)

    # -- watches and history -----------------------------------------------------------------

    def watch_prefix(self, prefix: str, start_revision: int) -> AsyncGenerator[WatchEvent, None]:
        if start_revision < 1:
            raise ValueError(f"a watch starts at revision 1 or later, got {start_revision}")
        return self._watch(prefix, start_revision)

    async def _watch(self, prefix: str, next_revision: int) -> AsyncGenerator[WatchEvent, None]:
        while not self._closed:
            if next_revision < self._compacted:
                raise WatchCompacted(
                    f"watch of {prefix} from revision {next_revision}: history before "
                    f"{self._compacted} is compacted")
            changed = self._changed
            start = bisect.bisect_left(self._history_revisions, next_revision)
            batch = [ev for ev in self._history[start:] if ev.key.startswith(prefix)]
            next_revision = max(next_revision, self._revision + 1)
            for event in batch:
                yield event
            if not batch:
                await changed.wait()

    async def compact(self, revision: int) -> None:
        """Forget history before `revision`, as etcd's compaction does."""
        self._begin()
        if revision > self._revision:
            raise StoreError(f"cannot compact at {revision}: the store is at {self._revision}")
        if revision <= self._compacted:
            raise StoreError(f"cannot compact at {revision}: already compacted at {self._compacted}")
        self._compacted = revision
        keep = bisect.bisect_left(self._history_revisions, revision)
        del self._history[:keep]
        del self._history_revisions[:keep]

    async def close(self) -> None:
        self._closed = True
        self._changed.set()

    # -- internals ---------------------------------------------------------------------------

    def _begin(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")
        self.expire_leases()

    def _mod_revision(self, key: str) -> int:
        kv = self._data.get(key)
        return 0 if kv is None else kv.mod_revision

    def _fence_holds(self, fence: Fence | None) -> bool:
        return fence is None or self._mod_revision(fence.key) == fence.mod_revision

    def _delete_keys(self, keys: list[str]) -> None:
        if not keys:
            return
        revision = self._revision + 1
        for key in keys:
            del self._data[key]
        self._commit([WatchEvent(WatchEventKind.DELETE, key, b"", revision) for key in keys])

    def _commit(self, events: list[WatchEvent]) -> None:
        self._revision += 1
        self._history.extend(events)
        self._history_revisions.extend(ev.mod_revision for ev in events)
        self._changed.set()
        self._changed = asyncio.Event()
