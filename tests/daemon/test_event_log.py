"""The job's event log stays bounded and is never read whole: pages, the next sequence number from
the newest key alone, and compaction by count and age, on the in-memory store with a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from common.clock import FakeClock
from daemon.coordinator import EVENT_COMPACTION_INTERVAL_S, AgentHello
from daemon.events import COMPACTION_PAGES_PER_PASS, EVENTS_PAGE, NODE_EVENT_KINDS, EventKind, EventLog
from daemon.leader import LeaderElection, LeaderRecord
from daemon.membership import DeviceInfo
from daemon.store import keys
from daemon.store.interface import LeadershipLost
from daemon.store.memory import InMemoryStore
from tests.daemon.job_sim import SimCluster, job_settings


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


class NoPrefixReads:
    """A store that refuses to read the events prefix whole, as a store with 4 MiB replies would."""

    def __init__(self, store: InMemoryStore) -> None:
        self._store = store

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    async def get_prefix(self, prefix: str):
        if prefix.startswith(keys.JOBS):
            raise AssertionError(f"{prefix} was read whole")
        return await self._store.get_prefix(prefix)


async def leader_fence(store: InMemoryStore, name: str = "a"):
    leadership = await LeaderElection(store, LeaderRecord(name, f"{name}:1"), 3).try_acquire()
    assert leadership is not None
    return leadership


async def fill(log: EventLog, fence, count: int, clock: FakeClock | None = None, every_s: float = 0.0) -> None:
    for i in range(count):
        await log.append(EventKind.JOB_WARNING, f"thing {i}", fence)
        if clock is not None:
            clock.advance(every_s)


def test_events_are_read_a_page_at_a_time_and_the_next_number_comes_from_the_newest_key() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        memory = InMemoryStore(clock)
        store = NoPrefixReads(memory)
        fence = (await leader_fence(memory)).fence
        await fill(EventLog(store, "job", clock), fence, 1200)

        log = EventLog(store, "job", clock)  # a new leader: it knows no sequence number yet
        assert [e.seq for e in await log.read()] == list(range(1, EVENTS_PAGE + 1))
        assert [e.seq for e in await log.read(EVENTS_PAGE)] == list(range(EVENTS_PAGE + 1, 2 * EVENTS_PAGE + 1))
        assert [e.seq for e in await log.read(1190, limit=5)] == [1191, 1192, 1193, 1194, 1195]
        assert [e.seq for e in await log.read(1198, limit=10_000)] == [1199, 1200]
        assert await log.read(5000) == [] and len(await log.read(-7, limit=1)) == 1
        assert (await log.append(EventKind.JOB_WARNING, "after a restart", fence)).seq == 1201
    run(scenario())


def test_compaction_keeps_the_newest_by_count_and_the_numbers_go_on() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        store = InMemoryStore(clock)
        fence = (await leader_fence(store)).fence
        log = EventLog(store, "job", clock)
        await fill(log, fence, 250)
        assert await log.compact(keep=100, max_age_s=1e9, fence=fence) == 150
        assert [e.seq for e in await log.read(limit=EVENTS_PAGE)] == list(range(151, 251))
        assert await log.compact(keep=100, max_age_s=1e9, fence=fence) == 0
        assert (await EventLog(store, "job", clock).append(EventKind.JOB_WARNING, "x", fence)).seq == 251
    run(scenario())


def test_compaction_by_age_never_deletes_the_newest_event() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        store = InMemoryStore(clock)
        fence = (await leader_fence(store)).fence
        log = EventLog(store, "job", clock)
        await fill(log, fence, 10, clock, every_s=3600)  # one an hour; the newest is an hour old
        assert await log.compact(keep=1000, max_age_s=4.5 * 3600, fence=fence) == 6
        assert [e.seq for e in await log.read()] == [7, 8, 9, 10]
        clock.advance(30 * 86400)  # all of them are old now
        assert await log.compact(keep=1000, max_age_s=86400, fence=fence) == 3
        assert [e.seq for e in await log.read()] == [10]
        assert (await EventLog(store, "job", clock).append(EventKind.JOB_WARNING, "x", fence)).seq == 11
    run(scenario())


def test_a_large_backlog_is_compacted_a_bounded_number_of_pages_per_pass() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        store = InMemoryStore(clock)
        fence = (await leader_fence(store)).fence
        log = EventLog(store, "job", clock)
        per_pass = COMPACTION_PAGES_PER_PASS * EVENTS_PAGE
        await fill(log, fence, per_pass + 600)
        assert await log.compact(keep=100, max_age_s=1e9, fence=fence) == per_pass
        assert await log.compact(keep=100, max_age_s=1e9, fence=fence) == 500
        assert [e.seq for e in await log.read()][0] == per_pass + 501
    run(scenario())


def test_a_deposed_leader_deletes_no_event() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        store = InMemoryStore(clock)
        old = await leader_fence(store)
        log = EventLog(store, "job", clock)
        await fill(log, old.fence, 300)
        await old.lease.revoke()
        await leader_fence(store, "b")
        with pytest.raises(LeadershipLost):
            await log.compact(keep=100, max_age_s=1e9, fence=old.fence)
        assert len(await log.read()) == 300
    run(scenario())


def test_the_leader_compacts_when_it_takes_office_and_then_once_a_minute() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        store = InMemoryStore(clock)
        fence = (await leader_fence(store, "old")).fence
        await fill(EventLog(store, "job", clock), fence, 400)
        await store.delete(keys.LEADER)

        sim = SimCluster(job_settings(), store=store, clock=clock, events_keep=100)
        await sim.lead()
        await sim.tick()
        events = await sim.coordinator.events(0)
        assert (events[0].seq, events[-1].seq, events[-1].kind) == (302, 401, "coordinator_leads")  # its own, kept
        for i in range(150):
            await sim.connect(f"n{i}")  # 150 node_joined events
        await sim.tick(30)
        assert [e.seq for e in await sim.coordinator.events(0)][0] == 302
        await sim.tick(31)
        events = await sim.coordinator.events(0)
        job_events = [e.seq for e in events if e.kind not in NODE_EVENT_KINDS]
        node_events = [e.seq for e in events if e.kind in NODE_EVENT_KINDS]
        assert len(job_events) == 100 and job_events[-1] == 400 + 1 + 150 + 1  # and generation 1 started
        assert node_events == list(range(402 + 50, 402 + 150))  # the newest 100 of their own
    run(scenario())


def test_node_churn_never_erases_the_jobs_newest_events() -> None:
    """Issue 47: one node certificate's 150 Hello/close cycles, each with a new host, wrote 150 node_ready events,
    and the next compaction (keep 100) left no job event. Node events are now bounded apart from the job's."""
    async def scenario() -> None:
        sim = SimCluster(job_settings(min_nodes=2, max_nodes=2), events_keep=100)
        await sim.lead()
        await sim.connect("a")
        await sim.tick()
        job_kinds = [e.kind for e in await sim.coordinator.events(0) if e.kind not in NODE_EVENT_KINDS]
        assert job_kinds == ["coordinator_leads"]
        for cycle in range(150):
            hello = AgentHello("x", f"10.1.{cycle // 250}.{cycle % 250}", (DeviceInfo(0, "", "cpu"),), "t", "", 0)
            session, _ = await sim.coordinator.open_session(hello, lambda command: None)
            sim.coordinator.close_session(session)
        await sim.tick(EVENT_COMPACTION_INTERVAL_S + 1)
        events = await sim.coordinator.events(0)
        assert [e.kind for e in events if e.kind not in NODE_EVENT_KINDS] == job_kinds
        assert [e.kind for e in events].count("node_ready") == 99  # and x's node_joined, the newest 100 of them
    run(scenario())
