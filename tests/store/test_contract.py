"""The Store contract, run against the in-memory fake and against a real etcd.

The coordinator is unit-tested on the fake, so every behaviour it relies on is asserted here
for both: a difference between them would make those unit tests lie.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from daemon.store.interface import Fence, Store, StoreError, WatchCompacted, WatchEvent, WatchEventKind, prefix_end
from tests.store.backends import Backend, run

PREFIX = "/trainerd/v1/test/"


def k(name: str) -> str:
    return PREFIX + name


async def take(events, count: int, timeout_s: float = 5) -> list[WatchEvent]:
    """The next `count` events of a watch, or a timeout error."""
    return [await asyncio.wait_for(anext(events), timeout_s) for _ in range(count)]


def test_get_of_a_missing_key_is_none(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        assert await store.get(k("missing")) is None

    run(backend, scenario)


def test_create_succeeds_once_then_conflicts(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        revision = await store.compare_and_swap(k("a"), b"first", 0)
        assert revision is not None
        assert await store.compare_and_swap(k("a"), b"second", 0) is None
        kv = await store.get(k("a"))
        assert (kv.key, kv.value, kv.mod_revision, kv.create_revision, kv.lease_id) == (
            k("a"), b"first", revision, revision, 0)

    run(backend, scenario)


def test_update_succeeds_at_the_current_revision_and_conflicts_at_a_stale_one(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        created = await store.compare_and_swap(k("a"), b"v1", 0)
        updated = await store.compare_and_swap(k("a"), b"v2", created)
        assert updated is not None and updated > created
        assert await store.compare_and_swap(k("a"), b"v3", created) is None  # stale
        kv = await store.get(k("a"))
        assert (kv.value, kv.mod_revision, kv.create_revision) == (b"v2", updated, created)

    run(backend, scenario)


def test_revisions_strictly_increase_with_every_write_and_delete(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        _, start = await store.get_prefix(PREFIX)
        first = await store.compare_and_swap(k("a"), b"1", 0)
        second = await store.compare_and_swap(k("b"), b"1", 0)
        third = await store.compare_and_swap(k("a"), b"2", first)
        assert start < first < second < third
        assert await store.compare_and_swap(k("a"), b"x", 0) is None  # a failed write...
        assert (await store.get_prefix(PREFIX))[1] == third  # ...does not move the revision
        assert await store.delete(k("b"))
        _, after_delete = await store.get_prefix(PREFIX)
        assert after_delete == third + 1
        assert await store.compare_and_swap(k("c"), b"1", 0) == after_delete + 1

    run(backend, scenario)


def test_a_fenced_write_is_refused_once_the_fence_key_changed(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        leader = await store.compare_and_swap(k("leader"), b"me", 0)
        fence = Fence(k("leader"), leader)
        written = await store.compare_and_swap(k("status"), b"mine", 0, fence=fence)
        assert written is not None

        await store.compare_and_swap(k("leader"), b"someone else", leader)
        assert await store.compare_and_swap(k("status"), b"stale", written, fence=fence) is None
        assert (await store.get(k("status"))).value == b"mine"

        assert await store.delete(k("leader"))
        assert await store.compare_and_swap(k("other"), b"x", 0, fence=fence) is None
        assert await store.get(k("other")) is None

    run(backend, scenario)


def test_delete_with_and_without_an_expected_revision(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        assert not await store.delete(k("missing"))
        revision = await store.compare_and_swap(k("a"), b"1", 0)
        assert not await store.delete(k("a"), expected_mod_revision=revision - 1)
        assert (await store.get(k("a"))).value == b"1"
        assert await store.delete(k("a"), expected_mod_revision=revision)
        assert await store.get(k("a")) is None

        await store.compare_and_swap(k("b"), b"1", 0)
        assert await store.delete(k("b"))
        assert await store.get(k("b")) is None
        assert not await store.delete(k("b"))

    run(backend, scenario)


def test_get_prefix_returns_only_that_prefix_sorted_with_the_read_revision(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        for name in ["jobs/b/spec", "jobs/a/status", "jobs/a/spec", "jobsx", "nodes/n1"]:
            last = await store.compare_and_swap(k(name), name.encode(), 0)
        kvs, revision = await store.get_prefix(k("jobs/"))
        assert [kv.key for kv in kvs] == [k("jobs/a/spec"), k("jobs/a/status"), k("jobs/b/spec")]
        assert [kv.value for kv in kvs] == [b"jobs/a/spec", b"jobs/a/status", b"jobs/b/spec"]
        assert revision == last
        assert await store.get_prefix(k("none/")) == ([], last)

    run(backend, scenario)


def test_get_prefix_reads_more_than_one_response_may_carry(backend: Backend) -> None:
    """1,100 records of 4 KiB: more keys than a page and more bytes (4.4 MB) than gRPC takes in one message
    by default; 20,000 node records once kept a leader from loading its cluster."""
    async def scenario(store: Store) -> None:
        names = [f"nodes/{i:05d}" for i in range(1100)]
        for name in names:
            last = await store.compare_and_swap(k(name), name.encode().ljust(4096, b"."), 0)
        kvs, revision = await store.get_prefix(k("nodes/"))
        assert [kv.key for kv in kvs] == [k(name) for name in names]
        assert all(kv.value == name.encode().ljust(4096, b".") for kv, name in zip(kvs, names))
        assert revision == last

    run(backend, scenario, timeout_s=120)


def test_get_range_reads_a_bounded_page_in_either_order(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        for name in ["events/03", "events/01", "events/02", "events/04", "eventsx", "nodes/n1"]:
            last = await store.compare_and_swap(k(name), name.encode(), 0)
        events, end = k("events/"), prefix_end(k("events/"))
        kvs, revision = await store.get_range(events, end, limit=2)
        assert [kv.key for kv in kvs] == [k("events/01"), k("events/02")] and revision == last
        assert [kv.value for kv in kvs] == [b"events/01", b"events/02"]
        kvs, _ = await store.get_range(k("events/02") + "\0", end, limit=10)  # the page after events/02
        assert [kv.key for kv in kvs] == [k("events/03"), k("events/04")]
        kvs, _ = await store.get_range(events, end, limit=1, descending=True)  # the newest alone
        assert [kv.key for kv in kvs] == [k("events/04")]
        kvs, _ = await store.get_range(events, k("events/03"), limit=5, descending=True)
        assert [kv.key for kv in kvs] == [k("events/02"), k("events/01")]
        assert await store.get_range(k("none/"), prefix_end(k("none/")), limit=5) == ([], last)

    run(backend, scenario)


def test_delete_range_deletes_the_range_at_one_revision_while_the_fence_holds(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        leader = await store.compare_and_swap(k("leader"), b"me", 0)
        fence = Fence(k("leader"), leader)
        for seq in range(1, 6):
            last = await store.compare_and_swap(k(f"events/{seq:02d}"), b"x", 0)
        assert await store.delete_range(k("events/01"), k("events/04"), fence=fence) == 3
        assert (await store.get_prefix(PREFIX))[1] == last + 1  # one revision for the three keys
        assert [kv.key for kv in (await store.get_prefix(k("events/")))[0]] == [k("events/04"), k("events/05")]
        assert await store.delete_range(k("events/01"), k("events/04"), fence=fence) == 0

        await store.compare_and_swap(k("leader"), b"someone else", leader)
        assert await store.delete_range(k("events/"), prefix_end(k("events/")), fence=fence) is None
        assert len((await store.get_prefix(k("events/")))[0]) == 2
        assert await store.delete_range(k("events/"), prefix_end(k("events/"))) == 2

    run(backend, scenario)


def test_a_fenced_delete_is_refused_once_the_fence_key_changed(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        leader = await store.compare_and_swap(k("leader"), b"me", 0)
        fence = Fence(k("leader"), leader)
        revision = await store.compare_and_swap(k("node"), b"n1", 0)
        await store.compare_and_swap(k("other"), b"n2", 0)
        assert await store.delete(k("other"), fence=fence)
        await store.compare_and_swap(k("leader"), b"someone else", leader)
        assert not await store.delete(k("node"), revision, fence=fence)
        assert not await store.delete(k("node"), fence=fence)
        assert (await store.get(k("node"))).value == b"n1"

    run(backend, scenario)


def test_revoking_a_lease_deletes_its_keys_at_one_revision(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        lease = await store.grant_lease(10)
        assert lease.alive
        await store.compare_and_swap(k("leased1"), b"x", 0, lease=lease)
        await store.compare_and_swap(k("leased2"), b"y", 0, lease=lease)
        await store.compare_and_swap(k("plain"), b"z", 0)
        assert (await store.get(k("leased1"))).lease_id == lease.id
        _, revision = await store.get_prefix(PREFIX)

        async with aclosing(store.watch_prefix(PREFIX, revision + 1)) as events:
            await lease.revoke()
            await asyncio.wait_for(lease.wait_lost(), 5)
            assert not lease.alive
            deleted = await take(events, 2)
        assert {(ev.kind, ev.key, ev.mod_revision) for ev in deleted} == {
            (WatchEventKind.DELETE, k("leased1"), revision + 1), (WatchEventKind.DELETE, k("leased2"), revision + 1)}
        assert [kv.key for kv in (await store.get_prefix(PREFIX))[0]] == [k("plain")]

        await lease.revoke()  # idempotent
        with pytest.raises(StoreError):
            await store.compare_and_swap(k("late"), b"x", 0, lease=lease)

    run(backend, scenario)


def test_a_lease_is_kept_alive_past_its_ttl(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        lease = await store.grant_lease(2)
        await store.compare_and_swap(k("leased"), b"x", 0, lease=lease)
        await backend.pass_time(store, 3)
        assert lease.alive
        assert (await store.get(k("leased"))).value == b"x"

    run(backend, scenario)


def test_a_lost_lease_wakes_its_waiters_and_its_keys_are_gone(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        lease = await store.grant_lease(2)
        await store.compare_and_swap(k("leased"), b"x", 0, lease=lease)
        waiter = asyncio.create_task(lease.wait_lost())
        await backend.lose_lease(store, lease)
        await asyncio.wait_for(waiter, 5)
        assert not lease.alive
        assert await store.get(k("leased")) is None

    run(backend, scenario)


def test_a_watch_replays_history_from_its_start_revision_then_follows_live_writes(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        _, start = await store.get_prefix(PREFIX)
        a1 = await store.compare_and_swap(k("a"), b"1", 0)
        await store.compare_and_swap("/trainerd/v1/elsewhere", b"ignored", 0)
        b1 = await store.compare_and_swap(k("b"), b"1", 0)
        a2 = await store.compare_and_swap(k("a"), b"2", a1)

        async with aclosing(store.watch_prefix(PREFIX, start + 1)) as events:
            history = await take(events, 3)
            assert await store.delete(k("b"))
            c1 = await store.compare_and_swap(k("c"), b"1", 0)
            live = await take(events, 2)
        assert history + live == [
            WatchEvent(WatchEventKind.PUT, k("a"), b"1", a1),
            WatchEvent(WatchEventKind.PUT, k("b"), b"1", b1),
            WatchEvent(WatchEventKind.PUT, k("a"), b"2", a2),
            WatchEvent(WatchEventKind.DELETE, k("b"), b"", c1 - 1),
            WatchEvent(WatchEventKind.PUT, k("c"), b"1", c1),
        ]

        async with aclosing(store.watch_prefix(PREFIX, a2)) as events:  # starts mid-history
            assert [ev.mod_revision for ev in await take(events, 3)] == [a2, c1 - 1, c1]

    run(backend, scenario)


def test_a_watch_from_a_compacted_revision_raises_watch_compacted(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        first = await store.compare_and_swap(k("a"), b"1", 0)
        await store.compare_and_swap(k("a"), b"2", first)
        latest = await store.compare_and_swap(k("a"), b"3", first + 1)
        await store.compact(latest)

        async with aclosing(store.watch_prefix(PREFIX, first)) as events:
            with pytest.raises(WatchCompacted):
                await asyncio.wait_for(anext(events), 5)
        async with aclosing(store.watch_prefix(PREFIX, latest)) as events:  # not compacted yet
            assert (await take(events, 1))[0].value == b"3"

    run(backend, scenario)
