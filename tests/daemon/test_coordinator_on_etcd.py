"""Coordinator behaviour that only shows with a store whose calls really wait (a real etcd)."""

from __future__ import annotations

import asyncio
import time

import grpc
from aetcd import rpc

from common.clock import FakeClock
from daemon.events import EventLog
from daemon.store.etcd import EtcdStore
from tests.daemon.test_coordinator_logic import hello, lead, make_coordinator


class CountingStore:
    """Passes every call to a real store and counts the compare-and-swap attempts."""

    def __init__(self, store: EtcdStore) -> None:
        self._store = store
        self.swaps = 0

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    async def compare_and_swap(self, *args, **kwargs):
        self.swaps += 1
        return await self._store.compare_and_swap(*args, **kwargs)


def test_a_burst_of_joins_gets_distinct_event_numbers_without_retries(etcd_server) -> None:
    async def scenario() -> None:
        etcd = await EtcdStore.connect([etcd_server.endpoint])
        store = CountingStore(etcd)
        try:
            clock = FakeClock()
            coordinator = make_coordinator(store, clock, "a")
            await lead(coordinator)
            swaps_before = store.swaps
            await asyncio.gather(*(coordinator.open_session(hello(f"n{i}"), lambda m: None) for i in range(200)))
            events = await EventLog(store, "job", clock).read()
            assert events[0].kind == "coordinator_leads"  # 1: its own
            assert sorted(e.seq for e in events) == list(range(1, 202))
            # One node record and one event per join: no conflicting writes, no retries.
            assert store.swaps - swaps_before == 400
        finally:
            await etcd.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_leader_blocked_longer_than_its_lease_still_leads_and_one_that_loses_its_lease_stands_down(
        etcd_server) -> None:
    async def scenario() -> None:
        store = await EtcdStore.connect([etcd_server.endpoint])
        try:
            coordinator = make_coordinator(store, FakeClock(), "a")  # leader_lease_s=3
            running = asyncio.create_task(coordinator.run(tick_s=0.05))
            while coordinator.leadership is None:
                await asyncio.sleep(0.01)
            first = coordinator.leadership
            time.sleep(5)  # noqa: ASYNC251 - a pass that holds the event loop for longer than the lease TTL
            await asyncio.sleep(0.2)
            assert coordinator.leadership is first and first.lease.alive

            async with grpc.aio.insecure_channel(etcd_server.endpoint) as channel:
                await rpc.LeaseStub(channel).LeaseRevoke(rpc.LeaseRevokeRequest(ID=first.lease.id), timeout=5)
            while coordinator.leadership is first:  # the keeper hears TTL <= 0 within a refresh (1 s)
                await asyncio.sleep(0.01)
            assert not first.lease.alive
            while coordinator.leadership is None:  # nobody else campaigns: it leads again, on a new lease
                await asyncio.sleep(0.01)
            assert coordinator.leadership.lease.id != first.lease.id
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
        finally:
            await store.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
