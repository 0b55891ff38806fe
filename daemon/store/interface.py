"""The store contract every backend honours (etcd in production, memory in unit tests).

It is deliberately narrow, after torch elastic's rendezvous backend: read (a key, a small prefix,
or a bounded page of a range), compare-and-swap on a key's mod revision (optionally fenced by a
second key, so a deposed leader cannot write), delete (a key or a range, fenced the same way),
leases kept alive by the store, and a prefix watch that resumes by itself. One contract suite
(tests/store/test_contract.py) runs against every implementation.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

from daemon.errors import RetryableError, TrainerdError


class StoreError(TrainerdError):
    """Base of every error a store raises; adapters wrap foreign errors with `raise ... from`.

    The store refused or failed the call (closed store, revoked lease, a cancelled watch): the
    caller should give up what it was doing and start again from a fresh read."""


class StoreUnavailable(StoreError, RetryableError):
    """The store cannot be reached right now; the caller may retry after a delay."""


class WatchCompacted(StoreError):
    """A watch asked for a revision the store has compacted away; re-read and watch again."""


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease_id: int = 0


class WatchEventKind(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True)
class WatchEvent:
    kind: WatchEventKind
    key: str
    value: bytes  # empty for DELETE
    mod_revision: int


@dataclass(frozen=True)
class Fence:
    """A write is allowed only while `key` still has `mod_revision` (e.g. the leader key)."""

    key: str
    mod_revision: int


def prefix_end(prefix: str) -> str:
    """The smallest key after every key that starts with `prefix` (etcd's range end of a prefix)."""
    if not prefix or ord(prefix[-1]) >= 0x7F:
        raise ValueError(f"{prefix!r} must end with a printable ASCII character")
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class Lease(Protocol):
    id: int
    ttl_s: int

    @property
    def alive(self) -> bool:
        """False once the store has reported the lease expired or it was revoked."""

    async def wait_lost(self) -> None:
        """Return when the lease is gone (expired, revoked, or keepalive failed past its TTL)."""

    async def revoke(self) -> None:
        """Revoke the lease; keys attached to it are deleted. Idempotent."""


class Store(Protocol):
    async def get(self, key: str) -> KeyValue | None: ...

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys under `prefix` sorted by key, and the store revision they were read at.

        Only for prefixes that stay small (nodes, a job's records): a prefix that grows with time
        (the events) is read a page at a time with `get_range`."""

    async def get_range(self, start_key: str, end_key: str, *, limit: int,
                        descending: bool = False) -> tuple[list[KeyValue], int]:
        """At most `limit` (>= 1) keys from `start_key` (inclusive) to `end_key` (exclusive), sorted
        by key, the largest first when `descending`, and the store revision they were read at.
        `prefix_end(prefix)` is the end of every key under `prefix`."""

    async def compare_and_swap(
        self,
        key: str,
        value: bytes,
        expected_mod_revision: int,
        *,
        lease: Lease | None = None,
        fence: Fence | None = None,
    ) -> int | None:
        """Write `value` if `key`'s mod revision equals `expected_mod_revision` (0: must not exist)
        and the fence holds. Returns the new mod revision, or None when a condition failed."""

    async def delete(self, key: str, expected_mod_revision: int | None = None, *,
                     fence: Fence | None = None) -> bool:
        """Delete `key` (only at that revision when given, and only while the fence holds). True when a
        key was deleted."""

    async def delete_range(self, start_key: str, end_key: str, *, fence: Fence | None = None) -> int | None:
        """Delete every key from `start_key` (inclusive) to `end_key` (exclusive) at one revision, while
        the fence holds. Returns how many keys were deleted, or None when the fence did not hold."""

    async def grant_lease(self, ttl_s: int) -> Lease:
        """A lease the store keeps alive (one long-lived keepalive stream) until revoked or lost."""

    def watch_prefix(self, prefix: str, start_revision: int) -> AsyncGenerator[WatchEvent, None]:
        """Events under `prefix` from `start_revision` on. A dropped stream is re-opened from the
        last delivered revision + 1, so no event is lost or repeated; raises WatchCompacted."""

    async def close(self) -> None: ...


class LeadershipLost(RetryableError):
    """A fenced write was refused because another coordinator leads now (etcd itself is fine).

    The coordinator must stand down at once; a client should retry at the coordinator that leads now."""


async def ensure_fence(store: Store, fence: Fence) -> None:
    """Raise LeadershipLost unless the fence key is still at the fenced revision."""
    kv = await store.get(fence.key)
    if kv is None or kv.mod_revision != fence.mod_revision:
        raise LeadershipLost(f"{fence.key} changed: this coordinator no longer leads")
