"""No pass is fatal: a reconcile pass that raises anything but a store error or a lost leadership is
logged with its cause and traceback and tried again after a capped backoff; the coordinator keeps
running and keeps leading. Run through Coordinator.run on the in-memory store with a fake clock."""

from __future__ import annotations

import asyncio
import logging
import math

from daemon.job.reports import HeartbeatReport
from daemon.pass_guard import MAX_RETRY_S
from proto.vocabulary import JobState
from tests.daemon.job_sim import SimCluster, job_settings, running_cluster

TICK_S = 0.01


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def settle(seconds: float = 0.1) -> None:
    """Real time for the run loop's periodic passes (every TICK_S) to run."""
    await asyncio.sleep(seconds)


def test_an_infinite_rate_followed_by_a_drain_does_not_raise() -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b"))
        sim.step(12, samples_per_s=math.inf)  # straight to the coordinator, past the servicer's checks
        await sim.coordinator.set_drain("b", True)
        await sim.tick()
        requests = sim.agents["a"].checkpoint_requests()
        assert sim.state is JobState.RUNNING and requests and requests[-1].step > 12
    run(scenario())


def test_a_reconcile_pass_that_raises_is_logged_retried_with_backoff_and_the_leader_stays(caplog) -> None:
    async def scenario() -> None:
        sim = SimCluster(job_settings())
        running = asyncio.create_task(sim.coordinator.run(tick_s=TICK_S))
        while sim.coordinator.leadership is None:
            await asyncio.sleep(0)
        term = sim.coordinator.leadership
        agent = await sim.connect("a")
        await settle()
        assert sim.job.record.generation == 1

        calls = []
        real_reconcile = sim.job.reconcile

        async def broken(fence, facts):
            calls.append(sim.clock.now())
            raise OverflowError("cannot convert float infinity to integer")

        sim.job.reconcile = broken
        with caplog.at_level(logging.ERROR, logger="daemon.pass_guard"):
            await settle()
            assert len(calls) == 1  # the backoff (1 s on the fake clock) has not passed
            for _ in range(8):
                sim.clock.advance(MAX_RETRY_S)
                sim.coordinator.heartbeat(agent.session, HeartbeatReport(1))  # before any pass: the node stays READY
                before = len(calls)
                await settle()
                assert len(calls) == before + 1
        assert not running.done() and sim.coordinator.leadership is term
        failures = [r for r in caplog.records if "reconcile pass of job job failed" in r.getMessage()]
        assert len(failures) == 9 and failures[0].exc_info is not None
        assert "OverflowError: cannot convert float infinity to integer" in failures[0].getMessage()
        assert "trying again in 1s" in failures[0].getMessage()
        assert f"trying again in {MAX_RETRY_S:.0f}s" in failures[-1].getMessage()  # capped

        sim.job.reconcile = real_reconcile
        sim.clock.advance(MAX_RETRY_S)
        sim.coordinator.heartbeat(agent.session, HeartbeatReport(1))
        sim.started()
        sim.step(1)
        await settle()
        assert sim.state is JobState.RUNNING and sim.coordinator._reconcile_guard.failures == 0
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    run(scenario())


def test_a_periodic_pass_that_raises_elsewhere_does_not_end_the_coordinator(caplog) -> None:
    async def scenario() -> None:
        sim = SimCluster(job_settings())
        running = asyncio.create_task(sim.coordinator.run(tick_s=TICK_S))
        while sim.coordinator.leadership is None:
            await asyncio.sleep(0)
        term = sim.coordinator.leadership

        def broken_overdue(read_lag_s: float = 0.0):
            raise KeyError("a bug in the liveness bookkeeping")

        sim.coordinator._liveness.overdue = broken_overdue
        with caplog.at_level(logging.ERROR, logger="daemon.pass_guard"):
            await settle()
        assert not running.done() and sim.coordinator.leadership is term
        assert any("the periodic pass failed (KeyError" in r.getMessage() for r in caplog.records)
        status = await sim.coordinator.view()
        assert status.coordinator.is_leader
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    run(scenario())
