"""An in-memory copy of an etcd prefix, written through with fenced compare-and-swap.

The leader keeps the nodes, the job's status record, its checkpoint catalog and its skip ledger
in memory and decides from that copy. Each key's mod revision is kept next to its decoded value,
and every write is a compare-and-swap on that revision, fenced on the leader key: it lands only
if etcd still holds what the copy holds and this coordinator still leads.

A lost compare-and-swap has one policy, after torch elastic's rendezvous (re-read, decide again):
the key is re-read so the copy mirrors etcd, then the write raises. Retrying the write at the
fresh revision would be wrong: the caller decided from a value etcd no longer holds. Keeping the
value as if the write had landed would be wrong too: the copy would state a decision etcd never took.
The raise tells the caller its decision was not committed; the next reconcile pass decides again
from the corrected copy. The error says which of the two causes it was:

- LeadershipLost: the fence key moved. Another coordinator leads and wrote, or may write, here.
- WriteConflict: the fence holds, so no other leader wrote; the key changed behind the copy all
  the same. Every trainerd writer of these keys is fenced, so it was a write this copy never
  heard the answer to (etcd may apply a write whose reply is lost: StoreUnavailable), or one
  from outside trainerd (an operator's etcdctl).

Both are StoreErrors, which callers already handle: the coordinator stands down on one in its
periodic pass, and an operator command answers UNAVAILABLE.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, NoReturn, Protocol, TypeVar

from daemon.store import codec
from daemon.store.interface import Fence, Store, StoreError, ensure_fence


class WriteConflict(StoreError):
    """A fenced write lost its compare-and-swap while the fence held; the copy was re-read."""


class Stored(Protocol):
    def to_json(self) -> dict: ...


V = TypeVar("V", bound=Stored)


class FencedCache(Generic[V]):
    """The keys under `prefix` as decoded values with their mod revisions.

    `prefix` may be a whole key (the job's status record is one). Reads are served from memory;
    `load` replaces the copy with what etcd holds.
    """

    def __init__(self, store: Store, prefix: str, from_json: Callable[[dict], V]) -> None:
        self._store = store
        self._prefix = prefix
        self._from_json = from_json
        self._entries: dict[str, tuple[V, int]] = {}  # key -> (value, mod revision)

    async def load(self) -> None:
        """Read every key under the prefix.

        Raises:
            StoreError: etcd failed, or a stored value is not a known schema (codec.BadValue).
        """
        kvs, _ = await self._store.get_prefix(self._prefix)
        self._entries = {kv.key: (self._decode(kv.key, kv.value), kv.mod_revision) for kv in kvs}

    def get(self, key: str) -> V | None:
        found = self._entries.get(key)
        return None if found is None else found[0]

    def values(self) -> list[V]:
        """Sorted by key."""
        return [self._entries[key][0] for key in sorted(self._entries)]

    async def put(self, key: str, value: V, fence: Fence) -> None:
        """Write `value` over what the copy holds at `key` (create it when the copy has none).

        Raises:
            LeadershipLost: the fence moved; the key was re-read.
            WriteConflict: etcd's key was not what the copy held; the key was re-read.
            StoreError: etcd failed.
        """
        found = self._entries.get(key)
        await self._write(key, value, 0 if found is None else found[1], fence)

    async def create(self, key: str, value: V, fence: Fence) -> bool:
        """Write `value` only where there is no key: False, and nothing written, when the copy has one.

        Raises:
            LeadershipLost: the fence moved; the key was re-read.
            WriteConflict: etcd had the key although the copy did not; it was re-read.
            StoreError: etcd failed.
        """
        if key in self._entries:
            return False
        await self._write(key, value, 0, fence)
        return True

    async def delete(self, key: str, fence: Fence) -> bool:
        """Delete `key` as the copy holds it: False, and nothing deleted, when the copy has none.

        Raises:
            LeadershipLost: the fence moved; the key was re-read.
            WriteConflict: etcd's key was not what the copy held; the key was re-read.
            StoreError: etcd failed.
        """
        found = self._entries.get(key)
        if found is None:
            return False
        if not await self._store.delete(key, found[1], fence=fence):
            await self._lost_compare_and_swap(key, fence)
        del self._entries[key]
        return True

    async def _write(self, key: str, value: V, expected_mod_revision: int, fence: Fence) -> None:
        if not key.startswith(self._prefix):
            raise ValueError(f"{key} is not under {self._prefix}")
        revision = await self._store.compare_and_swap(key, codec.encode(value.to_json()), expected_mod_revision,
                                                      fence=fence)
        if revision is None:
            await self._lost_compare_and_swap(key, fence)
        self._entries[key] = (value, revision)

    async def _lost_compare_and_swap(self, key: str, fence: Fence) -> NoReturn:
        """The one policy (module docstring): mirror etcd's key again, then say why the write failed."""
        kv = await self._store.get(key)
        if kv is None:
            self._entries.pop(key, None)
        else:
            self._entries[key] = (self._decode(key, kv.value), kv.mod_revision)
        await ensure_fence(self._store, fence)
        raise WriteConflict(f"{key} changed behind this coordinator's copy; it was re-read, the write was not made")

    def _decode(self, key: str, value: bytes) -> V:
        return self._from_json(codec.decode(value, key=key))
