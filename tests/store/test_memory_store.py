"""What only the fake has: lease expiry driven by the injected clock, with no sleeping."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from common.clock import FakeClock
from daemon.store.interface import WatchEvent, WatchEventKind
from daemon.store.memory import InMemoryStore
from tests.store.test_contract import PREFIX, k, take


def test_a_lease_whose_keepalive_stopped_expires_exactly_at_its_ttl() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        store = InMemoryStore(clock)
        lease = await store.grant_lease(5)
        await store.compare_and_swap(k("leased"), b"x", 0, lease=lease)
        clock.advance(100)  # kept alive: time alone does nothing
        store.expire_leases()
        assert lease.alive

        store.stop_keepalive(lease)
        clock.advance(4.9)
        assert (await store.get(k("leased"))).value == b"x"
        assert lease.alive
        _, revision = await store.get_prefix(PREFIX)
        async with aclosing(store.watch_prefix(PREFIX, revision + 1)) as events:
            clock.advance(0.1)
            assert await store.get(k("leased")) is None  # any operation notices the expiry
            assert not lease.alive
            await asyncio.wait_for(lease.wait_lost(), 1)
            assert await take(events, 1) == [WatchEvent(WatchEventKind.DELETE, k("leased"), b"", revision + 1)]

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_closing_the_store_ends_its_watches() -> None:
    async def scenario() -> None:
        store = InMemoryStore(FakeClock())
        events = store.watch_prefix(PREFIX, 1)
        waiting = asyncio.create_task(anext(events, None))
        await asyncio.sleep(0)  # let the watch start waiting
        await store.close()
        assert await asyncio.wait_for(waiting, 1) is None

    asyncio.run(asyncio.wait_for(scenario(), 5))
