"""A device that computes wrong, as the coordinator hears it: each device_suspected replay is an event, and a
node whose devices are suspected restart.quarantine_after times within the window is quarantined and left
out, spending no restart budget (the simulated cluster of job_sim: real coordinator, controller and servicer
on the in-memory store and a fake clock)."""

from __future__ import annotations

import asyncio

from daemon.grpc_services import CoordinatorService
from daemon.job.observation import DEVICE_SUSPICION_WINDOW_S, GenerationObservation
from daemon.job.state import FailureCause
from proto import trainerd_pb2 as pb
from proto.vocabulary import JobState
from tests.daemon.job_sim import SimCluster, running_cluster


def run(coro):
    return asyncio.run(coro)


def suspect(sim: SimCluster, node: str, step: int) -> None:
    rank = next(s.rank for s in sim.job.inbox.generation.placement.ranks if s.node == node)
    CoordinatorService(sim.coordinator)._dispatch(sim.agents[node].session, pb.AgentMessage(
        guard_notice=pb.GuardNotice(generation=sim.job.inbox.generation.number, rank=rank, step=step,
                                    notice="device_suspected", detail="grad_norm_spike: loss 0.3 grad norm 9e+03")))


def test_each_suspicion_is_an_event_and_the_third_within_the_window_quarantines_the_node() -> None:
    async def scenario() -> None:
        sim = await running_cluster(restart={"max": 0, "backoff_s": 0, "quarantine_after": 3})
        sim.step(11)
        for step in (20, 40):
            suspect(sim, "b", step)
            suspect(sim, "b", step)  # told again after a reconnect: one event
            await sim.tick(1.0)
        assert sim.state is JobState.RUNNING  # two are chance
        suspected = [e for e in await sim.coordinator.events(0) if e.kind == "device_suspected"]
        assert [e.fields["step"] for e in suspected] == [20, 40] and {e.fields["node"] for e in suspected} == {"b"}
        assert "no samples were skipped" in suspected[0].message
        suspect(sim, "b", 60)
        await sim.tick(1.0)
        assert sim.state is JobState.RECOVERING  # restart.max 0: a budget spent would have failed it
        assert sim.job.record.last_failure.cause is FailureCause.DEVICE_FAULT
        assert sim.job.view().quarantined == {"b"}
        [recovery] = [e for e in await sim.coordinator.events(0) if e.kind == "recovery_started"]
        assert "node b is quarantined (its devices are suspected)" in recovery.message
        sim.confirm_stop()
        await sim.tick(0.1)
        assert sim.world() == ["a", "c"]
    run(scenario())


def test_suspicions_older_than_the_window_are_forgotten() -> None:
    observation = GenerationObservation(1, started_at=0.0)
    observation.suspect_device("c", 10.0)
    observation.suspect_device("c", 20.0)
    assert observation.suspected_devices(30.0) == {"c": 2}
    assert observation.suspected_devices(10.0 + DEVICE_SUSPICION_WINDOW_S + 1) == {"c": 1}
    observation.suspect_device("c", 30.0 + DEVICE_SUSPICION_WINDOW_S)  # the old ones leave memory too
    assert list(observation.device_suspicions["c"]) == [30.0 + DEVICE_SUSPICION_WINDOW_S]
