"""Goodput accounting: every second of a job's wall time in one phase.

The scenarios run the real Coordinator and JobController on the in-memory store with a fake clock
(tests/daemon/job_sim.py), so the phases come from the same observations the coordinator acts on;
the accountant's invariant (the phases sum to the wall time, none below zero) is also checked on
random event sequences.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from common.clock import FakeClock
from daemon.cli.status_json import status_to_json
from daemon.cli.trainerctl import print_status
from daemon.coordinator import STAND_DOWN_SAVE_S
from daemon.grpc_services import status_to_proto
from daemon.job.goodput import GoodputAccountant, GoodputSnapshot, JobMoment, Phase
from daemon.job.observation import RootCause
from daemon.job.state import FailureCause
from daemon.store import keys
from proto.vocabulary import JobState
from tests.daemon.job_sim import SESSION_GRACE_S, SimCluster, job_settings, take_over

START = 1000.0  # SimCluster's clock starts here


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def running_from(sim: SimCluster, *nodes: str, startup_s: float = 2.0) -> None:
    """Lead, connect `nodes`, launch at once; the first step comes `startup_s` later."""
    await sim.lead()
    for name in nodes:
        await sim.connect(name)
    await sim.tick()
    sim.started()
    await sim.tick(startup_s)
    sim.step(1)
    await sim.tick()
    assert sim.state is JobState.RUNNING


async def at_step_21() -> SimCluster:
    """Nodes a, b and c RUNNING from 2 s after the launch, a step a second, up to step 21."""
    sim = SimCluster(job_settings())
    await running_from(sim, "a", "b", "c")
    for step in range(2, 22):
        await sim.tick(1)
        sim.step(step)
    return sim


async def complete(sim: SimCluster, after_s: float) -> None:
    await sim.tick(after_s)
    sim.finish_all()
    await sim.tick()
    assert sim.state is JobState.COMPLETED
    await sim.tick(50)  # nothing accrues once COMPLETED


async def clean_run(sim: SimCluster) -> None:
    await sim.lead()
    await sim.tick(4)  # no node yet
    for name in ("a", "b", "c"):
        await sim.connect(name)
    await sim.tick()
    sim.started()
    await sim.tick(3)
    sim.step(1)
    await sim.tick(20)
    sim.step(100)
    await complete(sim, 10)


async def crash_with_lost_work(sim: SimCluster) -> None:
    await running_from(sim, "a", "b", "c")  # step 1 at 1002
    await sim.tick(10)
    sim.step(10)
    sim.checkpoint(10)
    await sim.tick(10)
    sim.step(30)  # the furthest the job gets before the fault
    await sim.tick(5)
    sim.crash("b", 1)  # at 1027: reported at once, detected at once
    await sim.tick()
    assert sim.state is JobState.RECOVERING
    sim.confirm_stop()
    await sim.tick(1.0)  # the crash backoff
    assert sim.job.inbox.generation.number == 2 and sim.job.inbox.generation.start_step == 10
    sim.started()
    await sim.tick(2)
    sim.step(11)  # steps 11-30 again: lost work
    await sim.tick(6)
    sim.step(30)  # back at the mark: productive from here
    await complete(sim, 4)


async def host_loss_with_waiting(sim: SimCluster) -> None:
    await running_from(sim, "a", "b")  # step 1 at 1002
    await sim.tick(10)
    sim.step(10)
    sim.checkpoint(10)
    await sim.tick(8)  # heartbeats at 1020: b's last
    sim.step(20)
    sim.disconnect("b")  # the host is gone; LOST after the session grace
    await sim.tick(SESSION_GRACE_S + 0.5)
    assert sim.state is JobState.RECOVERING
    sim.confirm_stop("a")
    await sim.tick(0.1)
    assert sim.state is JobState.WAITING
    await sim.tick(30)
    await sim.connect("b")  # it comes back
    await sim.tick()
    assert sim.job.inbox.generation.number == 2
    sim.started()
    await sim.tick(3)
    sim.step(11)
    await sim.tick(4)
    sim.step(20)
    await complete(sim, 5)


async def pause_and_resume(sim: SimCluster) -> None:
    await running_from(sim, "a")  # step 1 at 1002
    await sim.tick(10)
    sim.step(10)
    sim.checkpoint(10)
    await sim.tick(5)
    sim.step(15)
    await sim.coordinator.pause(now=True)  # the steps after 10 are redone
    sim.confirm_stop()
    await sim.tick(60)
    await sim.coordinator.resume(from_step=None)  # relaunched from step 10 at once
    assert sim.job.inbox.generation.number == 2
    sim.started()
    await sim.tick(2)
    sim.step(11)
    await sim.tick(3)
    sim.step(15)
    await complete(sim, 3)


async def hang(sim: SimCluster) -> None:
    await running_from(sim, "a")  # step 1 at 1002
    await sim.tick(8)
    sim.step(10)  # at 1010: the last step before the hang
    sim.checkpoint(10)
    await sim.tick(30)
    await sim.tick(31)  # 61 s silent > hang_timeout_s 60
    assert sim.state is JobState.RECOVERING
    sim.confirm_stop()
    await sim.tick(1.0)
    sim.started()
    await sim.tick(2)
    sim.step(11)  # past the mark at once: nothing to redo
    await complete(sim, 6)


async def fenced_by_its_agent(sim: SimCluster) -> None:
    """The agent heard no coordinator for the heartbeat timeout (its link, or every coordinator, down) and
    stopped its processes; it reports their exits when it is back. Nothing trained since the last step."""
    await running_from(sim, "a")  # step 1 at 1002
    await sim.tick(10)
    sim.step(10)  # at 1012: the last step
    await sim.tick(20)
    sim.crash("a", 0, exit_code=0, signal=15, cause=RootCause(
        "stopped by its agent: no coordinator answered for 5.1s (heartbeat timeout 5.0s)", "", "fenced"))
    await sim.tick()
    assert sim.state is JobState.RECOVERING
    sim.confirm_stop()
    await sim.tick(1.0)
    sim.started()
    await sim.tick(2)
    sim.step(11)
    await complete(sim, 6)


async def checkpoint_stalls(sim: SimCluster) -> None:
    await running_from(sim, "a")  # step 1 at 1002
    await sim.tick(10)
    sim.step(10, checkpoint_stall_s=0.5)
    await sim.tick(10)
    sim.step(20, checkpoint_stall_s=1.5)  # 1.0 s more, since the last report
    sim.step(20, checkpoint_stall_s=1.5)  # told again: nothing more
    await complete(sim, 0)


P = Phase
SCENARIOS: list[tuple[Callable[[SimCluster], Awaitable[None]], dict, dict[Phase, float]]] = [
    (clean_run, {}, {P.WAITING: 4, P.STARTUP: 3, P.PRODUCTIVE: 30}),
    (crash_with_lost_work, {}, {P.STARTUP: 4, P.PRODUCTIVE: 29, P.LOST_WORK: 6, P.RELAUNCH: 1}),
    (host_loss_with_waiting, {"min_nodes": 2, "max_nodes": 2},
     {P.STARTUP: 5, P.PRODUCTIVE: 23, P.DETECTION: SESSION_GRACE_S + 0.5, P.RELAUNCH: 0.1, P.WAITING: 30,
      P.LOST_WORK: 4}),
    (pause_and_resume, {"max_nodes": 1}, {P.STARTUP: 4, P.PRODUCTIVE: 18, P.PAUSED: 60, P.LOST_WORK: 3}),
    (hang, {"max_nodes": 1}, {P.STARTUP: 4, P.PRODUCTIVE: 14, P.DETECTION: 61, P.RELAUNCH: 1}),
    (checkpoint_stalls, {"max_nodes": 1}, {P.STARTUP: 2, P.PRODUCTIVE: 18.5, P.CHECKPOINT_STALL: 1.5}),
    (fenced_by_its_agent, {"max_nodes": 1}, {P.STARTUP: 4, P.PRODUCTIVE: 16, P.DETECTION: 20, P.RELAUNCH: 1}),
]


@pytest.mark.parametrize(("scenario", "overrides", "expected"), SCENARIOS, ids=[s[0].__name__ for s in SCENARIOS])
def test_every_second_of_the_job_goes_to_its_phase(scenario, overrides: dict, expected: dict[Phase, float]) -> None:
    async def go() -> None:
        sim = SimCluster(job_settings(**overrides))
        await scenario(sim)
        goodput = sim.job.view().goodput
        assert goodput is not None
        assert {phase: round(s, 6) for phase, s in goodput.seconds.items() if s} == expected
        assert goodput.wall_s == pytest.approx(sum(expected.values()))
        assert goodput.ratio == pytest.approx(expected[P.PRODUCTIVE] / sum(expected.values()))
        assert goodput.phase is None  # COMPLETED: the wall time is over
        assert REGISTRY.get_sample_value("trainerd_job_goodput_ratio", {"job_name": "job"}) == goodput.ratio
        assert REGISTRY.get_sample_value("trainerd_job_phase_seconds_total",
                                         {"job_name": "job", "phase": "productive"}) == goodput.seconds[P.PRODUCTIVE]
    run(go())


def test_status_shows_the_ratio_and_every_phase(capsys: pytest.CaptureFixture[str]) -> None:
    """What `trainerctl status` prints and `-o json` holds, from the coordinator's own view."""
    async def go() -> dict:
        sim = SimCluster(job_settings())
        await crash_with_lost_work(sim)
        return status_to_json(status_to_proto(await sim.coordinator.view()))
    data = run(go())
    goodput = data["job"]["goodput"]
    assert goodput["phases"] == {"productive_s": 29.0, "lost_work_s": 6.0, "detection_s": 0.0, "relaunch_s": 1.0,
                                 "startup_s": 4.0, "checkpoint_stall_s": 0.0, "waiting_s": 0.0, "paused_s": 0.0}
    assert goodput["wall_s"] == 40.0 and goodput["ratio"] == pytest.approx(29 / 40)
    json.dumps(data)  # plain JSON
    print_status(data)
    assert "goodput 72.5% of 40.0s: productive 29.0s  lost work 6.0s  relaunch 1.0s  startup 4.0s" in \
        capsys.readouterr().out


def test_a_new_leader_carries_the_totals_on_and_counts_the_takeover_in_the_phase_saved() -> None:
    async def go() -> None:
        sim = await at_step_21()  # startup 2 s
        standby = await take_over(sim)  # 3.5 s without a leader, the last save up to 5 s before
        assert standby.job.record.state is JobState.RUNNING
        await standby.tick(1)
        standby.step(22)
        await standby.tick(1)
        goodput = standby.job.view().goodput
        assert goodput is not None
        elapsed = sim.clock.now() - START
        assert goodput.wall_s == pytest.approx(elapsed)
        assert goodput.seconds == {**dict.fromkeys(Phase, 0.0), P.STARTUP: 2.0, P.PRODUCTIVE: pytest.approx(elapsed - 2)}
        assert goodput.high_water == (-1, 22)
        saved = standby.job.goodput._saved.get(keys.job_goodput("job"))
        assert saved is not None and saved.phase is P.PRODUCTIVE
    run(go())


def test_the_time_trainerd_was_down_with_its_local_agents_is_no_productive_time() -> None:
    """trainerd stopped and started again: its local agents and their processes died with it. Nothing
    trained from the last save of the totals on; those seconds, and the new leader's until it found the
    processes gone, are detection (they were productive, the phase saved)."""
    async def go() -> None:
        sim = await at_step_21()
        saved = sim.job.goodput._saved.get(keys.job_goodput("job"))
        assert saved is not None and saved.phase is P.PRODUCTIVE
        standby = await take_over(sim, agents_restarted=True)
        await standby.tick(0.1)
        await standby.tick(1.0)  # the second heartbeat naming no generation: processes_gone
        assert standby.state is JobState.RECOVERING
        goodput = standby.job.view().goodput
        assert goodput is not None
        assert goodput.wall_s == pytest.approx(sim.clock.now() - START)
        assert goodput.seconds[P.PRODUCTIVE] == pytest.approx(saved.seconds[P.PRODUCTIVE])
        assert goodput.seconds[P.DETECTION] == pytest.approx(sim.clock.wall() - saved.saved_wall)
    run(go())


def test_local_agents_slower_to_return_than_the_grace_were_lost_no_later_than_the_last_save() -> None:
    """trainerd started again on a busy host: its local agents came back later than their reconnect grace, so
    the new leader found the nodes lost before it saw their processes gone. They died with trainerd all the
    same: the seconds from the last save of the totals on are detection, not the moment it noticed."""
    async def go() -> None:
        sim = await at_step_21()
        saved = sim.job.goodput._saved.get(keys.job_goodput("job"))
        assert saved is not None
        standby = await take_over(sim, agents_restarted=True, returning=())
        for _ in range(10):
            await standby.tick(1.0)
        assert standby.state is not JobState.RUNNING
        assert standby.job.record.last_failure.cause is FailureCause.NODE_LOST
        goodput = standby.job.view().goodput
        assert goodput is not None
        assert goodput.seconds[P.PRODUCTIVE] == pytest.approx(saved.seconds[P.PRODUCTIVE])
        # at least the 3.5 s between the last save and the takeover (take_over), where it was ~0 s before
        assert goodput.seconds[P.DETECTION] >= 3.5
    run(go())


def test_a_leader_that_stops_saves_its_totals_as_of_its_stop() -> None:
    """Saved every few seconds, the totals a new leader took over were up to 5 s old: the steps reached since
    were not known to be redone (lost work, not productive), and the seconds since went to the phase saved."""
    async def go() -> None:
        sim = await at_step_21()
        await sim.tick(0.5)
        sim.step(25)  # reported after the last pass
        sim.clock.advance(0.5)
        await sim.coordinator._hand_over(sim.coordinator.leadership, shutting_down=True)
        sim.coordinator._leave_office()
        saved = sim.job.goodput._saved.get(keys.job_goodput("job"))
        assert saved is not None
        assert (saved.high_water, saved.saved_wall) == ((-1, 25), sim.clock.wall())
        assert saved.wall_s == pytest.approx(sim.clock.now() - START)
        standby = await take_over(sim, agents_restarted=True)
        await standby.tick(0.1)
        await standby.tick(1.0)  # processes_gone
        assert standby.state is JobState.RECOVERING
        goodput = standby.job.view().goodput
        assert goodput is not None
        assert goodput.seconds[P.PRODUCTIVE] == pytest.approx(saved.seconds[P.PRODUCTIVE])
        assert goodput.seconds[P.DETECTION] == pytest.approx(sim.clock.wall() - saved.saved_wall)
        assert goodput.high_water == (-1, 25)
    run(go())


def test_a_stopping_leader_whose_save_gets_no_answer_still_resigns(caplog: pytest.LogCaptureFixture) -> None:
    """The save before standing down is best effort: with etcd out of reach it must not hold the stop."""
    async def go() -> None:
        sim = await at_step_21()

        async def unanswered(fence) -> None:
            await asyncio.Event().wait()

        sim.job.goodput.stand_down = unanswered
        leadership = sim.coordinator.leadership
        await asyncio.wait_for(sim.coordinator._hand_over(leadership, shutting_down=True), STAND_DOWN_SAVE_S + 2)
        assert not leadership.lease.alive  # resigned all the same
    run(go())
    assert f"no answer within {STAND_DOWN_SAVE_S:g}s" in caplog.text


def test_unreadable_saved_totals_start_over_and_do_not_stop_the_leader(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        sim = SimCluster(job_settings())
        await sim.store.compare_and_swap(keys.job_goodput("job"), b'{"schema": 1, "seconds": {"warp": 3}}', 0)
        await sim.lead()
        await sim.tick(2)
        goodput = sim.job.view().goodput
        assert goodput is not None and goodput.seconds[P.WAITING] == 2.0 and goodput.wall_s == 2.0
    run(go())
    assert "cannot be read" in caplog.text


# ---------------------------------------------------------------- the accountant alone, on random histories

MOMENTS = st.builds(JobMoment, st.sampled_from(JobState), st.booleans(), st.booleans(), st.booleans(),
                    st.none() | st.tuples(st.just(-1), st.integers(0, 50)))
EVENTS = st.lists(st.one_of(
    st.tuples(st.just("advance"), st.floats(0, 100)),
    st.tuples(st.just("observe"), MOMENTS),
    st.tuples(st.just("fault"), st.floats(0, 200)),
    st.tuples(st.just("stall"), st.tuples(st.integers(1, 3), st.floats(0, 50))),
    st.tuples(st.just("takeover"), st.floats(0, 10)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_the_phases_always_sum_to_the_wall_time(events: list) -> None:
    """Wall time: every second while the job is not COMPLETED (a COMPLETED job counts no more)."""
    clock = FakeClock(start=START)
    accountant = GoodputAccountant(clock)
    wall = 0.0
    for kind, value in events:
        if kind == "advance":
            clock.advance(value)
            wall += value if accountant.phase is not None else 0.0
        elif kind == "observe":
            accountant.snapshot()  # accrue to now in the phase so far
            accountant.observe(value)
        elif kind == "fault":
            accountant.fault_detected(clock.now() - value)
        elif kind == "stall":
            accountant.checkpoint_stall(*value)
        else:  # the leader dies after a save; a new one takes over `value` seconds later
            saved = accountant.snapshot()
            clock.advance(value)
            wall += value if accountant.phase is not None else 0.0
            accountant = GoodputAccountant(clock, GoodputSnapshot.from_json(saved.to_json()))
        snapshot = accountant.snapshot()
        assert all(s >= 0 for s in snapshot.seconds.values())
        assert snapshot.wall_s == pytest.approx(wall, abs=1e-2)  # saved totals are rounded to the millisecond
        assert 0 <= snapshot.ratio <= 1 + 1e-9
