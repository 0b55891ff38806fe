"""The heartbeat pace (daemon/heartbeat_pace.py): the configured interval and timeout while the agents held
send at most heartbeat.max_per_s, both stretched together beyond; what the Coordinator tells agents
(Welcome) and how long it lets a node be silent. Pure logic with a FakeClock, and the Coordinator on the
in-memory store."""

from __future__ import annotations

import asyncio
import math

from hypothesis import given
from hypothesis import strategies as st

from common.clock import FakeClock
from daemon.heartbeat_pace import HeartbeatPacer, Pace
from proto.vocabulary import NodeState
from tests.daemon.job_sim import HEARTBEAT_TIMEOUT_S, SESSION_GRACE_S, SimCluster, job_settings


def test_the_configured_pace_holds_within_the_rate_and_stretches_beyond() -> None:
    pacer = HeartbeatPacer(FakeClock(), 1.0, 5.0, max_per_s=2000)
    assert pacer.update(2000) == Pace(1.0, 5.0)
    assert pacer.update(2001).interval_s == math.sqrt(2)
    ten_thousand = pacer.update(10_000)
    assert math.isclose(ten_thousand.interval_s, 2 ** 2.5) and math.isclose(ten_thousand.timeout_s, 5 * 2 ** 2.5)
    assert 10_000 / ten_thousand.interval_s <= 2000  # 1768 a second
    assert math.isclose(pacer.update(20_000).interval_s, 2 ** 3.5)


@given(sessions=st.integers(0, 1_000_000), max_per_s=st.floats(1, 100_000))
def test_the_pace_fits_the_rate_and_stretches_no_more_than_a_step_past_it(sessions: int, max_per_s: float) -> None:
    pace = HeartbeatPacer(FakeClock(), 1.0, 5.0, max_per_s).update(sessions)
    assert sessions / pace.interval_s <= max_per_s * (1 + 1e-9)
    assert pace.interval_s == 1.0 or sessions / (pace.interval_s / math.sqrt(2)) > max_per_s
    assert math.isclose(pace.timeout_s, 5 * pace.interval_s)


def test_a_faster_pace_needs_headroom_and_the_slower_timeout_holds_until_agents_have_heard() -> None:
    clock = FakeClock()
    pacer = HeartbeatPacer(clock, 1.0, 5.0, max_per_s=1000)
    slow = pacer.update(1900)  # 1900 / sqrt(2) a second is still too many: two steps
    assert slow.interval_s == 2.0 and pacer.liveness_timeout_s() == 10.0
    assert pacer.update(1300) == slow  # fits at sqrt(2) s, but not with a quarter to spare: it stays
    faster = pacer.update(1100)
    assert math.isclose(faster.interval_s, math.sqrt(2))
    assert pacer.liveness_timeout_s() == 10.0  # agents at 2 s hear of the faster pace within one interval
    clock.advance(9.9)
    assert pacer.liveness_timeout_s() == 10.0
    clock.advance(0.2)
    assert math.isclose(pacer.liveness_timeout_s(), 5 * math.sqrt(2))
    assert pacer.update(10) == Pace(1.0, 5.0)
    assert math.isclose(pacer.liveness_timeout_s(), 5 * math.sqrt(2))  # the previous pace's, a while longer


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_a_coordinator_holding_more_agents_than_its_rate_slows_them_and_waits_longer_before_lost() -> None:
    async def scenario() -> None:
        sim = SimCluster(job_settings(), heartbeat_max_per_s=2.0)  # 1 s interval: 2 agents at the base pace
        await sim.lead()
        for name in ("a", "b"):
            await sim.connect(name)
        assert sim.coordinator.pace.interval_s == 1.0
        await sim.connect("c")
        assert sim.coordinator.pace.interval_s == 2.0  # 3 a second are too many, and 3 / sqrt(2) too
        for name in ("d", "e"):
            await sim.connect(name)
        pace = sim.coordinator.pace
        assert math.isclose(pace.interval_s, 2 * math.sqrt(2)) and 5 / pace.interval_s <= 2
        assert pace.timeout_s > HEARTBEAT_TIMEOUT_S

        sim.agents["e"].session.send = lambda command: None
        silent = sim.agents.pop("e")  # no more heartbeats from e
        await sim.tick(HEARTBEAT_TIMEOUT_S + 1)
        assert sim.coordinator._membership.get("e").state is NodeState.READY  # silent, but not past its pace
        await sim.tick(pace.timeout_s)
        assert sim.coordinator._membership.get("e").state is NodeState.LOST
        assert silent.session is not None
    run(scenario())


def test_a_new_leader_paces_for_the_nodes_it_knows_before_they_are_back() -> None:
    async def scenario() -> None:
        sim = SimCluster(job_settings(), heartbeat_max_per_s=2.0)
        await sim.lead()
        for name in ("a", "b", "c", "d", "e"):
            await sim.connect(name)
        await sim.tick()
        paced = sim.coordinator.pace
        standby = SimCluster(sim.spec, store=sim.store, clock=sim.clock, name="c2", heartbeat_max_per_s=2.0)
        sim.store.stop_keepalive(sim.coordinator.leadership.lease)
        sim.clock.advance(3.5)
        sim.store.expire_leases()
        await standby.lead()
        assert standby.coordinator.pace == paced  # no agent is back yet
        standby.agents = {name: agent for name, agent in sim.agents.items()}
        for name in standby.agents:
            await standby.connect(name)
        await standby.tick(HEARTBEAT_TIMEOUT_S + 1)  # the five came back within the stretched window
        assert [standby.coordinator._membership.get(n).state for n in "abcde"] == [NodeState.READY] * 5
    run(scenario())


def test_the_session_grace_stretches_with_the_pace_as_an_agents_reconnect_backs_off_up_to_its_interval(
        ) -> None:
    async def scenario() -> None:
        sim = SimCluster(job_settings(), heartbeat_max_per_s=2.0)
        await sim.lead()
        for name in ("a", "b", "c", "d", "e"):
            await sim.connect(name)
        await sim.tick()
        factor = sim.coordinator.pace.interval_s  # the base interval is 1 s
        assert math.isclose(factor, 2 * math.sqrt(2))
        sim.disconnect("e")  # its session broke; the agent redials after a backoff of up to its interval
        await sim.tick(SESSION_GRACE_S + 0.5)
        assert sim.coordinator._membership.get("e").state is NodeState.READY
        await sim.tick(SESSION_GRACE_S * factor - SESSION_GRACE_S)
        assert sim.coordinator._membership.get("e").state is NodeState.LOST
    run(scenario())


def test_the_first_agents_of_a_burst_are_paced_for_those_still_at_the_door() -> None:
    async def scenario() -> None:
        at_the_door = 0
        sim = SimCluster(job_settings(), heartbeat_max_per_s=2.0, agents_at_the_door=lambda: at_the_door)
        await sim.lead()
        await sim.connect("a")
        assert sim.coordinator.pace.interval_s == 1.0  # one agent, nobody waiting: the configured pace
        at_the_door = 3  # three turned away, their turns to come: four agents, more than 2 a second at 1 s
        sim.disconnect("a")
        await sim.connect("a")
        # What its Welcome names: 2 s for four agents, and a reserve of two steps while the burst is on.
        assert sim.coordinator.pace.interval_s == 4.0
        at_the_door = 0  # the door empties: the reserve holds a timeout longer, in case it fills again
        await sim.tick(HEARTBEAT_TIMEOUT_S - 0.1)
        assert sim.coordinator.pace.interval_s == 2.0  # one agent's 1 s, and the reserve
        await sim.tick(0.2)  # the burst is over: the pace one agent needs
        assert sim.coordinator.pace.interval_s == 1.0
        # ... while the slowest pace an agent was told still sets how long a node may be silent
        assert sim.coordinator._liveness.timeout_s == HEARTBEAT_TIMEOUT_S * 4
    run(scenario())


def test_a_burst_holds_a_reserve_that_the_pace_drops_once_it_is_over() -> None:
    clock = FakeClock()
    pacer = HeartbeatPacer(clock, 1.0, 5.0, max_per_s=2000)
    assert pacer.update(1000, burst=True) == Pace(2.0, 10.0)  # 1000 fit at 1 s; two steps slower
    assert math.isclose(pacer.update(10_000, burst=True).interval_s, 2 ** 3.5)  # 10,000 need 5.66 s
    clock.advance(4.9)
    assert math.isclose(pacer.update(10_000).interval_s, 2 ** 3.5)  # held for the configured timeout
    clock.advance(0.2)
    after = pacer.update(10_000)
    # Back to what 10,000 need, though a faster pace needs a quarter to spare: the reserve is not a level
    # the headroom rule holds on to (it would have kept 11.3 s, a LOST after 56.6 s instead of 28.3).
    assert math.isclose(after.interval_s, 2 ** 2.5)
    assert math.isclose(pacer.liveness_timeout_s(), 5 * 2 ** 3.5)  # agents hear of it within an interval
    clock.advance(5 * 2 ** 3.5 + 0.1)
    assert math.isclose(pacer.liveness_timeout_s(), 5 * 2 ** 2.5)
