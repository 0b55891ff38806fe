"""Leadership, sessions and liveness decisions on the in-memory store with a fake clock."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from prometheus_client import REGISTRY

from common.clock import FakeClock
from daemon.coordinator import AgentHello, Coordinator, NotLeader, SessionRefused
from daemon.events import EventKind, EventLog
from daemon.job.reports import HeartbeatReport
from daemon.leader import LeaderElection, LeaderRecord
from daemon.membership import DeviceInfo
from daemon.store import codec, keys
from daemon.store.fenced_cache import WriteConflict
from daemon.store.interface import LeadershipLost, StoreUnavailable
from daemon.store.memory import InMemoryStore
from proto.vocabulary import MAX_RETRY_AFTER_S, RETRY_AFTER_SPREAD, NodeState

TIMEOUT_S = 5.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def make_coordinator(store: InMemoryStore, clock: FakeClock, name: str) -> Coordinator:
    return Coordinator(store=store, clock=clock, me=LeaderRecord(name, f"{name}:7420"), job_name="job", job=None,
                       heartbeat_interval_s=1.0, heartbeat_timeout_s=TIMEOUT_S, leader_lease_s=3)


def hello(name: str, token: str = "", devices: int = 1) -> AgentHello:
    return AgentHello(name, "10.0.0.1", tuple(DeviceInfo(i, "", "cpu") for i in range(devices)), "t", token)


async def lead(coordinator: Coordinator) -> None:
    leadership = await coordinator._election.campaign()
    await coordinator._take_office(leadership)


async def running_leader(store: InMemoryStore, clock: FakeClock, tick_s: float) -> tuple[Coordinator, asyncio.Task]:
    """Coordinator "a" running its passes every `tick_s`, once it leads."""
    coordinator = make_coordinator(store, clock, "a")
    running = asyncio.create_task(coordinator.run(tick_s=tick_s))
    while coordinator.leadership is None:
        await asyncio.sleep(0)
    return coordinator, running


async def leading_coordinator() -> tuple[FakeClock, InMemoryStore, Coordinator]:
    """Coordinator "a", leading on a new in-memory store with a fake clock."""
    clock = FakeClock()
    store = InMemoryStore(clock)
    coordinator = make_coordinator(store, clock, "a")
    await lead(coordinator)
    return clock, store, coordinator


async def is_lost_only_after(seconds: float, clock: FakeClock, store: InMemoryStore, coordinator: Coordinator,
                             node: str = "n1") -> None:
    """`node` is READY through the passes until `seconds` from now, and LOST at the first pass after."""
    clock.advance(seconds - 0.1)
    await coordinator.tick()
    assert await stored_node_state(store, node) == "READY"
    clock.advance(0.2)
    await coordinator.tick()
    assert await stored_node_state(store, node) == "LOST"


async def stored_node_state(store: InMemoryStore, name: str) -> str:
    kv = await store.get(keys.node(name))
    return codec.decode(kv.value, key=kv.key)["state"]


def test_one_leader_and_the_standby_takes_over_when_the_lease_expires() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        store = InMemoryStore(clock)
        first = LeaderElection(store, LeaderRecord("a", "a:1"), 3)
        second = LeaderElection(store, LeaderRecord("b", "b:1"), 3)
        leadership = await first.campaign()
        waiting = asyncio.create_task(second.campaign())
        await asyncio.sleep(0)
        assert not waiting.done()
        assert (await second.current()) == LeaderRecord("a", "a:1")

        store.stop_keepalive(leadership.lease)  # the leader process froze
        clock.advance(2.9)
        store.expire_leases()
        await asyncio.sleep(0)
        assert not waiting.done()
        clock.advance(0.2)
        store.expire_leases()
        taken = await asyncio.wait_for(waiting, 1)
        assert taken.record.id == "b"
        assert not leadership.lease.alive
        assert (await first.current()) == LeaderRecord("b", "b:1")

    run(scenario())


def test_a_deposed_leader_cannot_write() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        store = InMemoryStore(clock)
        old = await LeaderElection(store, LeaderRecord("a", "a:1"), 3).try_acquire()
        await old.lease.revoke()
        new = await LeaderElection(store, LeaderRecord("b", "b:1"), 3).try_acquire()
        assert new is not None
        with pytest.raises(LeadershipLost):
            await EventLog(store, "job", clock).append(EventKind.JOB_WARNING, "stale write", old.fence)
        event = await EventLog(store, "job", clock).append(EventKind.JOB_WARNING, "fresh write", new.fence)
        assert (event.seq, event.at) == (1, clock.wall())

    run(scenario())


def test_standby_refuses_sessions_and_names_the_leader() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        store = InMemoryStore(clock)
        leader, standby = make_coordinator(store, clock, "a"), make_coordinator(store, clock, "b")
        await lead(leader)
        with pytest.raises(NotLeader) as info:
            await standby.open_session(hello("n1"), lambda m: None)
        assert info.value.leader_address == "a:7420"

    run(scenario())


def test_standby_refuses_operator_commands_and_names_the_leader() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        store = InMemoryStore(clock)
        leader, standby = make_coordinator(store, clock, "a"), make_coordinator(store, clock, "b")
        await lead(leader)
        for command in (standby.pause(), standby.resume(None), standby.set_drain("n1", True),
                        standby.add_skip(1, 2, "x"), standby.skips()):
            with pytest.raises(NotLeader) as info:
                await command
            assert info.value.leader_address == "a:7420"

    run(scenario())


def test_node_joins_goes_lost_after_timeout_and_returns() -> None:
    async def scenario() -> None:
        clock, store, coordinator = await leading_coordinator()
        session, welcome = await coordinator.open_session(hello("n1", devices=2), lambda m: None)
        assert welcome.resume_token and welcome.heartbeat_interval_s == 1.0
        assert await stored_node_state(store, "n1") == "READY"

        for _ in range(20):  # heartbeats keep it READY, and cost no etcd write
            clock.advance(1.0)
            revision_before = (await store.get_prefix(keys.ROOT))[1]
            coordinator.heartbeat(session, HeartbeatReport(0))
            await coordinator.tick()
            assert (await store.get_prefix(keys.ROOT))[1] == revision_before
        assert await stored_node_state(store, "n1") == "READY"

        clock.advance(TIMEOUT_S + 0.1)
        await coordinator.tick()
        assert await stored_node_state(store, "n1") == "LOST"
        assert session.closed.is_set()
        events = await EventLog(store, "job", clock).read()
        assert [e.kind for e in events] == ["coordinator_leads", "node_joined", "node_lost"]

        await coordinator.open_session(hello("n1", devices=2), lambda m: None)
        assert await stored_node_state(store, "n1") == "READY"
        view = await coordinator.view()
        assert [(n.name, n.state, len(n.devices)) for n in view.nodes] == [("n1", NodeState.READY, 2)]

    run(scenario())


def test_a_live_node_name_is_not_taken_without_its_token() -> None:
    async def scenario() -> None:
        clock, store, coordinator = await leading_coordinator()
        first, welcome = await coordinator.open_session(hello("n1"), lambda m: None)
        with pytest.raises(SessionRefused, match="held by a live session"):
            await coordinator.open_session(hello("n1", token="guess"), lambda m: None)
        second, _ = await coordinator.open_session(hello("n1", token=welcome.resume_token), lambda m: None)
        assert first.closed.is_set() and not second.closed.is_set()
        coordinator.close_session(first)  # the old stream's late cleanup must not drop the new one
        clock.advance(TIMEOUT_S - 1)
        coordinator.heartbeat(second, HeartbeatReport(0))
        clock.advance(TIMEOUT_S - 1)
        await coordinator.tick()
        assert await stored_node_state(store, "n1") == "READY"

    run(scenario())


def test_a_session_that_ends_records_how_long_before_its_node_was_last_heard() -> None:
    """An agent that redials because no ack came: how recently the coordinator had heard it tells the operator
    which way the stream stalled (heard just before: the acks never reached it). A replaced session counts too."""
    def observed() -> tuple[float, float]:
        name = "trainerd_session_end_heard_seconds"
        return (REGISTRY.get_sample_value(f"{name}_count") or 0.0, REGISTRY.get_sample_value(f"{name}_sum") or 0.0)

    async def scenario() -> None:
        clock, store, coordinator = await leading_coordinator()
        first, welcome = await coordinator.open_session(hello("n1"), lambda m: None)
        clock.advance(2.0)
        coordinator.heartbeat(first, HeartbeatReport(0))
        clock.advance(3.5)
        count, total = observed()
        second, _ = await coordinator.open_session(hello("n1", token=welcome.resume_token), lambda m: None)
        assert observed() == (count + 1, pytest.approx(total + 3.5))
        coordinator.close_session(first)  # the replaced stream's own end is not counted twice
        other, _ = await coordinator.open_session(hello("n2"), lambda m: None)  # a first session replaces nothing
        assert observed()[0] == count + 1
        clock.advance(1.25)
        coordinator.heartbeat(other, HeartbeatReport(0))
        clock.advance(0.5)
        coordinator.close_session(other)
        assert observed() == (count + 2, pytest.approx(total + 3.5 + 0.5))

    run(scenario())


@pytest.mark.parametrize("bad", [
    hello("bad name"), hello("-x"), hello("n1\n"), hello("n1", devices=0),
    AgentHello("n1", "h", (DeviceInfo(0, "", "cpu"), DeviceInfo(0, "", "cpu")), "t", ""),
    AgentHello("n1", "", (DeviceInfo(0, "", "cpu"),), "t", ""),
])
def test_hostile_hellos_are_refused(bad: AgentHello) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        coordinator = make_coordinator(InMemoryStore(clock), clock, "a")
        await lead(coordinator)
        with pytest.raises(SessionRefused):
            await coordinator.open_session(bad, lambda m: None)

    run(scenario())


def test_new_leader_adopts_known_nodes_for_one_window_and_the_events_say_from_when_it_leads() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        store = InMemoryStore(clock)
        old, running = await running_leader(store, clock, tick_s=3600)
        await old.open_session(hello("n1"), lambda m: None)
        await old.open_session(hello("n2"), lambda m: None)
        running.cancel()  # a clean shutdown hands leadership over at once
        await asyncio.gather(running, return_exceptions=True)
        assert await store.get(keys.LEADER) is None
        assert old.leadership is None

        new = make_coordinator(store, clock, "b")
        await lead(new)
        clock.advance(TIMEOUT_S - 1)
        await new.open_session(hello("n1"), lambda m: None)  # n1 reconnects in time, n2 does not
        await new.tick()
        assert await stored_node_state(store, "n2") == "READY"
        clock.advance(2)
        await new.tick()
        assert await stored_node_state(store, "n1") == "READY"
        assert await stored_node_state(store, "n2") == "LOST"
        # The events say from when each coordinator led: an operator reading them after a failover (or a
        # restart of trainerd) sees why they went on after a gap.
        events = await new.events(0)
        assert [(e.kind, e.fields.get("coordinator") or e.fields.get("node")) for e in events] == [
            ("coordinator_leads", "a"), ("node_joined", "n1"), ("node_joined", "n2"), ("coordinator_leads", "b"),
            ("node_lost", "n2")]
        assert events[3].message == "coordinator b at b:7420 leads"

    run(scenario())



def test_a_leader_whose_fenced_write_is_refused_stands_down_and_campaigns_again() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        store = InMemoryStore(clock)
        coordinator, running = await running_leader(store, clock, tick_s=0.01)
        term = coordinator.leadership
        await coordinator.open_session(hello("n1"), lambda m: None)
        held = await store.get(keys.LEADER)
        # The leader key moves on while our lease lives: every fenced write now raises LeadershipLost.
        await store.compare_and_swap(keys.LEADER, held.value, held.mod_revision, lease=term.lease)
        clock.advance(TIMEOUT_S + 0.1)  # n1 is overdue: the next pass writes it LOST, fenced
        while coordinator.leadership is term:
            await asyncio.sleep(0.01)
        assert not term.lease.alive  # it resigned rather than keep the key alive
        while coordinator.leadership is None:  # and leads again once the key is free
            assert not running.done(), running.exception()
            await asyncio.sleep(0.05)
        assert coordinator.leadership.fence != term.fence
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

    run(scenario())


def test_a_node_lost_for_longer_than_forget_lost_after_s_leaves_the_records_but_not_the_events() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        store = InMemoryStore(clock)
        coordinator = Coordinator(store=store, clock=clock, me=LeaderRecord("a", "a:7420"), job_name="job", job=None,
                                  heartbeat_interval_s=1.0, heartbeat_timeout_s=TIMEOUT_S, leader_lease_s=3,
                                  forget_lost_after_s=3600)
        await lead(coordinator)
        await coordinator.open_session(hello("gone"), lambda m: None)
        stays, _ = await coordinator.open_session(hello("stays"), lambda m: None)
        await coordinator.set_drain("gone", True)
        for _ in range(2):
            clock.advance(TIMEOUT_S / 2 + 0.1)
            coordinator.heartbeat(stays, HeartbeatReport(0))
            await coordinator.tick()
        assert await stored_node_state(store, "gone") == "LOST"

        for _ in range(36):  # an hour, heartbeats from the node that stays
            clock.advance(100)
            coordinator.heartbeat(stays, HeartbeatReport(0))
            await coordinator.tick()
        assert await stored_node_state(store, "gone") == "LOST"  # LOST for 3600 s, not longer
        clock.advance(1)
        coordinator.heartbeat(stays, HeartbeatReport(0))
        await coordinator.tick()
        assert await store.get(keys.node("gone")) is None
        assert [n.name for n in (await coordinator.view()).nodes] == ["stays"]
        events = await coordinator.events(0)
        assert [e.kind for e in events if e.fields.get("node") == "gone"] == [
            "node_joined", "node_drained", "node_lost", "node_forgotten"]
        assert "LOST for 1.0h (forget_lost_after_s 3600)" in events[-1].message

        await coordinator.open_session(hello("gone"), lambda m: None)  # back: a new node, not drained
        view = {n.name: n for n in (await coordinator.view()).nodes}
        assert view["gone"].state is NodeState.READY and not view["gone"].drained
        assert (await coordinator.events(0))[-1].kind == "node_joined"

    run(scenario())


@pytest.mark.parametrize("devices_next_time", [1, 2])
def test_a_hello_cancelled_while_its_node_is_recorded_still_records_it_and_its_event_once(
        devices_next_time: int) -> None:
    """In a burst an agent gives up its Hello (its Welcome timeout) while the coordinator is recording the node.
    The etcd write lands anyway; the recording finishes, so the copy hears it and the node's `node_joined`
    event is written, once. The agent's next Hello is welcomed as a READY node's (or with its other devices
    recorded), where it used to fail with "changed behind this coordinator's copy"."""
    async def scenario() -> None:
        clock, store, coordinator = await leading_coordinator()
        write, answered = store.compare_and_swap, asyncio.Event()

        async def lands_but_answers_late(*args, **kwargs):
            revision = await write(*args, **kwargs)
            await answered.wait()
            return revision

        store.compare_and_swap = lands_but_answers_late  # type: ignore[method-assign]
        first = asyncio.create_task(coordinator.open_session(hello("n1"), lambda m: None))
        await asyncio.sleep(0.01)
        first.cancel()  # the agent gave up: the servicer's task is cancelled mid-write
        with pytest.raises(asyncio.CancelledError):
            await first
        assert coordinator.session_count == 0
        store.compare_and_swap = write  # type: ignore[method-assign]
        answered.set()
        for _ in range(100):
            if [e.kind for e in await coordinator.events(0)] == ["coordinator_leads", "node_joined"]:
                break
            await asyncio.sleep(0.01)
        assert [e.kind for e in await coordinator.events(0)] == ["coordinator_leads", "node_joined"]
        assert await stored_node_state(store, "n1") == "READY"
        await coordinator.open_session(hello("n1", devices=devices_next_time), lambda m: None)
        view = {n.name: n for n in (await coordinator.view()).nodes}
        assert view["n1"].state is NodeState.READY and len(view["n1"].devices) == devices_next_time
        assert coordinator.session_count == 1
        kinds = [e.kind for e in await coordinator.events(0)][1:]  # after the coordinator's own
        assert kinds == (["node_joined"] if devices_next_time == 1 else ["node_joined", "node_ready"])

    run(scenario())


@pytest.mark.parametrize("devices_next_time", [1, 2])
def test_a_write_that_landed_unheard_is_recorded_by_the_next_hello_that_wants_it(devices_next_time: int) -> None:
    """etcd failed after the write landed: the Hello fails, the copy never heard. The next Hello wanting the
    same meets the conflict, finds etcd holding it, and is welcomed with the node's event; one wanting other
    devices fails on the conflict, and the one after it is recorded."""
    async def scenario() -> None:
        clock, store, coordinator = await leading_coordinator()
        write = store.compare_and_swap

        async def lands_then_fails(*args, **kwargs):
            await write(*args, **kwargs)
            raise StoreUnavailable("etcd went away after the write")

        store.compare_and_swap = lands_then_fails  # type: ignore[method-assign]
        with pytest.raises(StoreUnavailable):
            await coordinator.open_session(hello("n1"), lambda m: None)
        store.compare_and_swap = write  # type: ignore[method-assign]
        assert await stored_node_state(store, "n1") == "READY" and coordinator.session_count == 0
        assert [e.kind for e in await coordinator.events(0)] == ["coordinator_leads"]
        if devices_next_time == 2:
            with pytest.raises(WriteConflict):
                await coordinator.open_session(hello("n1", devices=2), lambda m: None)
        await coordinator.open_session(hello("n1", devices=devices_next_time), lambda m: None)
        assert len({n.name: n for n in (await coordinator.view()).nodes}["n1"].devices) == devices_next_time
        # One event for the node either way; after the conflict the re-read copy knows the node, so a
        # Hello with other devices announces it as a known node's.
        kinds = [e.kind for e in await coordinator.events(0)][1:]  # after the coordinator's own
        assert kinds == (["node_joined"] if devices_next_time == 1 else ["node_ready"])

    run(scenario())


def test_a_node_back_while_the_lost_before_it_are_written_is_not_declared_lost() -> None:
    """A pass writes its LOST one node at a time; in a collapse that is thousands of etcd writes, and a node
    named overdue at the start may be back before its turn. It is asked again before its LOST is written."""
    async def scenario() -> None:
        clock, store, coordinator = await leading_coordinator()
        await coordinator.open_session(hello("a"), lambda m: None)
        old_b, welcome_b = await coordinator.open_session(hello("b"), lambda m: None)
        clock.advance(TIMEOUT_S + 1)  # both silent: both overdue
        write, released = store.compare_and_swap, asyncio.Event()

        async def slow_write(*args, **kwargs):
            await released.wait()
            return await write(*args, **kwargs)

        store.compare_and_swap = slow_write  # type: ignore[method-assign]
        ticking = asyncio.create_task(coordinator.tick())
        await asyncio.sleep(0.01)  # the pass is writing a's LOST
        new_b, _ = await coordinator.open_session(hello("b", token=welcome_b.resume_token), lambda m: None)
        released.set()
        await ticking
        assert await stored_node_state(store, "a") == "LOST"
        assert await stored_node_state(store, "b") == "READY"
        assert old_b.closed.is_set() and not new_b.closed.is_set()

    run(scenario())


def test_a_node_is_not_lost_while_etcd_is_still_recording_its_hello() -> None:
    async def scenario() -> None:
        clock, store, coordinator = await leading_coordinator()
        first, _ = await coordinator.open_session(hello("n1"), lambda m: None)
        coordinator.close_session(first)  # it comes back with another device: etcd must record that
        etcd_answers = asyncio.Event()
        write = store.compare_and_swap

        async def slow_write(*args, **kwargs):
            await etcd_answers.wait()
            return await write(*args, **kwargs)

        store.compare_and_swap = slow_write  # type: ignore[method-assign]
        opening = asyncio.create_task(coordinator.open_session(hello("n1", devices=2), lambda m: None))
        await asyncio.sleep(0.01)
        clock.advance(TIMEOUT_S + 1)  # etcd is slow (a connect burst): longer than the timeout
        await coordinator.tick()
        etcd_answers.set()
        session, _ = await opening
        await coordinator.tick()
        assert await stored_node_state(store, "n1") == "READY"
        assert not session.closed.is_set()
        await is_lost_only_after(TIMEOUT_S, clock, store, coordinator)  # its heartbeats are due from its Welcome on

    run(scenario())


def test_a_turn_at_the_door_counts_for_no_more_than_an_agent_honours() -> None:
    """The admission of Hellos names whatever wait its queue would take; an agent comes back after at most
    MAX_RETRY_AFTER_S of it (times its jitter), so the node is held no longer than that."""
    async def scenario() -> None:
        clock, store, coordinator = await leading_coordinator()
        session, _ = await coordinator.open_session(hello("n1"), lambda m: None)
        coordinator.heartbeat(session, HeartbeatReport(0))  # confirmed: the grace alone would apply
        coordinator.close_session(session)
        grace_s = coordinator._liveness.grace_s
        turned_away = dataclasses.replace(hello("n1"), next_welcome_wait_s=20.0)
        coordinator.at_the_door(turned_away, 10_000.0)
        await is_lost_only_after(RETRY_AFTER_SPREAD * MAX_RETRY_AFTER_S + 20.0 + grace_s, clock, store, coordinator)

    run(scenario())


def test_a_pass_that_blocks_on_etcd_shows_in_the_pass_durations() -> None:
    """The stall is measured while the leader waits between passes; a pass held up by a slow etcd write is
    not one, and the pass histogram is where an operator sees it."""
    def passes_over_half_a_second() -> float:
        count = REGISTRY.get_sample_value("trainerd_coordinator_pass_seconds_count") or 0.0
        return count - (REGISTRY.get_sample_value("trainerd_coordinator_pass_seconds_bucket", {"le": "0.5"}) or 0.0)

    async def scenario() -> None:
        clock = FakeClock()
        store = InMemoryStore(clock)
        coordinator, running = await running_leader(store, clock, tick_s=0.01)
        await coordinator.open_session(hello("n1"), lambda m: None)
        before = passes_over_half_a_second()
        write = store.compare_and_swap

        async def slow_write(*args, **kwargs):
            await asyncio.sleep(0.6)
            return await write(*args, **kwargs)

        store.compare_and_swap = slow_write  # type: ignore[method-assign]
        clock.advance(TIMEOUT_S + 0.1)  # n1 is overdue: the next pass writes it LOST, slowly
        while await stored_node_state(store, "n1") != "LOST":
            await asyncio.sleep(0.05)
        while passes_over_half_a_second() == before:  # the pass ends once its event is written too
            assert not running.done(), running.exception()
            await asyncio.sleep(0.05)
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

    run(scenario())
