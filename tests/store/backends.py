"""The two Store backends the contract suite runs against, behind one small test harness.

Each backend opens its store inside the test's event loop and knows how to let time pass and
how to lose a lease the way that backend loses one in real life.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc
from aetcd import rpc

from common.clock import FakeClock
from daemon.etcd_process import EmbeddedEtcd
from daemon.store.etcd import EtcdStore
from daemon.store.interface import Lease, Store
from daemon.store.memory import InMemoryStore

Scenario = Callable[[Store], Awaitable[None]]


class Backend(Protocol):
    name: str

    async def open(self) -> Store: ...

    async def pass_time(self, store: Store, seconds: float) -> None:
        """Let `seconds` go by, with the store's keepalive running."""

    async def lose_lease(self, store: Store, lease: Lease) -> None:
        """Make the store lose `lease` as it would in production."""


class MemoryBackend:
    name = "memory"

    def __init__(self) -> None:
        self.clock = FakeClock()

    async def open(self) -> InMemoryStore:
        return InMemoryStore(self.clock)

    async def pass_time(self, store: InMemoryStore, seconds: float) -> None:
        self.clock.advance(seconds)
        store.expire_leases()

    async def lose_lease(self, store: InMemoryStore, lease: Lease) -> None:
        """The keepalive stops and the clock runs past the TTL."""
        store.stop_keepalive(lease)
        await self.pass_time(store, lease.ttl_s)


class EtcdBackend:
    name = "etcd"

    def __init__(self, server: EmbeddedEtcd) -> None:
        self.server = server

    async def open(self) -> EtcdStore:
        return await EtcdStore.connect([self.server.endpoint], timeout_s=5)

    async def pass_time(self, store: EtcdStore, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def lose_lease(self, store: EtcdStore, lease: Lease) -> None:
        """Revoke the lease behind the store's back: its next keepalive is answered TTL 0."""
        async with grpc.aio.insecure_channel(self.server.endpoint) as channel:
            await rpc.LeaseStub(channel).LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease.id), timeout=5)


def run(backend: Backend, scenario: Scenario, timeout_s: float = 20) -> None:
    """Open a store of `backend` in a fresh event loop, run `scenario` on it, close it."""

    async def main() -> None:
        store = await backend.open()
        try:
            await scenario(store)
        finally:
            await store.close()

    asyncio.run(asyncio.wait_for(main(), timeout_s))
