"""Leader election in the store: a leased key created with compare-and-swap.

Whoever creates `/trainerd/v1/leader` under its lease leads until the lease is lost. Every write
that decides something is fenced on that key's revision, so a leader that lost its lease (paused
process, partition) cannot overwrite its successor's decisions.
"""

from __future__ import annotations

import logging
from contextlib import aclosing
from dataclasses import dataclass

from daemon.store import codec, keys
from daemon.store.interface import Fence, Lease, Store, WatchEventKind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaderRecord:
    id: str
    address: str

    def to_json(self) -> dict:
        return {"id": self.id, "address": self.address}

    @classmethod
    def from_json(cls, data: dict) -> "LeaderRecord":
        return cls(id=str(data["id"]), address=str(data["address"]))


@dataclass(frozen=True)
class Leadership:
    """Held while `lease` is alive; `fence` guards every decisive write."""

    record: LeaderRecord
    lease: Lease
    fence: Fence


class LeaderElection:
    def __init__(self, store: Store, me: LeaderRecord, lease_ttl_s: int) -> None:
        self._store = store
        self._me = me
        self._lease_ttl_s = lease_ttl_s

    async def current(self) -> LeaderRecord | None:
        kv = await self._store.get(keys.LEADER)
        return None if kv is None else LeaderRecord.from_json(codec.decode(kv.value, key=keys.LEADER))

    async def try_acquire(self) -> Leadership | None:
        """One attempt: lead now if nobody does; None when someone else holds the key."""
        lease = await self._store.grant_lease(self._lease_ttl_s)
        revision = await self._store.compare_and_swap(
            keys.LEADER, codec.encode(self._me.to_json()), 0, lease=lease
        )
        if revision is None:
            await lease.revoke()
            return None
        return Leadership(self._me, lease, Fence(keys.LEADER, revision))

    async def campaign(self) -> Leadership:
        """Wait until this process leads. Wakes on the leader key's deletion, not by polling."""
        while True:
            leadership = await self.try_acquire()
            if leadership is not None:
                log.info("%s is now the leader at %s", self._me.id, self._me.address)
                return leadership
            held = await self._store.get(keys.LEADER)
            if held is None:
                continue
            log.info("standing by: %s leads", codec.decode(held.value, key=keys.LEADER).get("id"))
            async with aclosing(self._store.watch_prefix(keys.LEADER, held.mod_revision + 1)) as events:
                async for event in events:
                    if event.key == keys.LEADER and event.kind is WatchEventKind.DELETE:
                        break

    async def resign(self, leadership: Leadership) -> None:
        await leadership.lease.revoke()
