"""`trainerctl pause` under the simulated cluster: a running generation saves first (a checkpoint of
trainerd's runtime, or the script's graceful exit) and the job is PAUSED once it has, so that the
resume loses no steps; `--now`, a script that can do neither, a save that does not come, a failure
meanwhile, a resume that calls the pause off and a new leader all end where an operator expects."""

from __future__ import annotations

import asyncio
import logging

from daemon.cli.status_json import status_to_json
from daemon.grpc_services import job_to_proto
from daemon.job.decide import PAUSE_SAVE_WAIT_S
from proto import trainerd_pb2 as pb
from proto.vocabulary import JobState
from tests.daemon.job_sim import SimCluster, launched_cluster, running_cluster, take_over

NO_BATCH = {"global_batch": None, "micro_batch": None}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def shown(sim: SimCluster) -> dict:
    """The job as `trainerctl status -o json` shows it."""
    return status_to_json(pb.StatusReply(job=job_to_proto(sim.job.view())))["job"]


async def last_event(sim: SimCluster) -> str:
    return (await sim.coordinator.events(0))[-1].message


async def pausing_cluster() -> tuple[SimCluster, int]:
    """A job of trainerd's runtime at step 25 (checkpoint 20) asked to pause; the step it asked its checkpoint at."""
    sim = await running_cluster()
    sim.step(20)
    sim.checkpoint(20)
    sim.step(25)
    await sim.tick()
    reply = await sim.coordinator.pause()
    assert "is pausing: generation 1 saves a checkpoint first" in reply and "pause --now" in reply
    assert sim.state is JobState.RUNNING and shown(sim)["pausing"] is True
    await sim.tick(0.1)
    [request] = sim.agents["a"].checkpoint_requests()
    assert request.step > 25 and not any(agent.stops() for agent in sim.agents.values())
    return sim, request.step


def test_a_paused_generation_saves_first_and_the_resume_starts_at_that_checkpoint() -> None:
    async def scenario() -> None:
        sim, asked = await pausing_cluster()
        assert "already pausing" in await sim.coordinator.pause()
        sim.checkpoint(asked - 1)  # a periodic checkpoint before the asked step does not answer it
        await sim.tick(0.1)
        assert sim.state is JobState.RUNNING
        sim.checkpoint(asked)
        await sim.tick(0.1)
        assert sim.state is JobState.PAUSED and shown(sim)["pausing"] is False
        assert all(agent.stops() for agent in sim.agents.values())
        assert await last_event(sim) == f"job job is PAUSED by the operator: stopped after the checkpoint at step {asked}"
        sim.confirm_stop()
        await sim.tick(30)  # paused for a while
        answer = await sim.coordinator.resume(from_step=None)
        assert answer == (f"job job is RECOVERING: restarting from the newest checkpoint, step {asked} (or a newer "
                          f"in-memory snapshot)")
        await sim.tick(0.1)
        assert sim.job.record.generation == 2
        assert sim.agents["a"].launches()[-1].checkpoint_path == f"/ckpt/step_{asked:08d}"
        sim.started()
        sim.step(asked + 1)
        await sim.tick(2)
        recovery = shown(sim)["last_recovery"]
        assert recovery["cause"] == "resume" and recovery["resumed_from_step"] == asked
        # The processes were stopped before the resume: no stop phase (it was negative, the pause's length).
        assert recovery["stop_s"] == 0 and 0 <= recovery["relaunch_s"] < 1
    run(scenario())


def test_a_save_that_does_not_come_is_given_up_after_the_wait_and_the_job_paused_as_it_was() -> None:
    async def scenario() -> None:
        sim, asked = await pausing_cluster()
        for tick in range(int(PAUSE_SAVE_WAIT_S // 10) - 1):
            sim.step(asked + tick)  # training goes on, but the requested checkpoint never comes
            await sim.tick(10)
        assert sim.state is JobState.RUNNING
        assert len(sim.agents["a"].checkpoint_requests()) > 1  # asked again, as for a reshape
        await sim.tick(10)
        assert sim.state is JobState.PAUSED and all(agent.stops() for agent in sim.agents.values())
        assert await last_event(sim) == (f"job job is PAUSED by the operator: nothing was saved within "
                                         f"{PAUSE_SAVE_WAIT_S:g}s; stopped as it was")
    run(scenario())


def test_pause_now_stops_at_once_also_while_a_pause_waits_for_its_checkpoint() -> None:
    async def scenario() -> None:
        sim = await running_cluster()
        assert "is PAUSED; generation 1 is being stopped" in await sim.coordinator.pause(now=True)
        assert sim.state is JobState.PAUSED and all(agent.stops() for agent in sim.agents.values())
        sim.confirm_stop()
        await sim.coordinator.resume(from_step=None)
        await sim.tick(0.1)
        sim.started()
        sim.step(12)
        await sim.tick(0.1)
        assert sim.state is JobState.RUNNING
        await sim.coordinator.pause()
        await sim.coordinator.pause(now=True)
        assert sim.state is JobState.PAUSED and sim.job.record.pause_requested_generation == 0
    run(scenario())


def test_resume_calls_a_pause_off_and_the_checkpoint_it_asked_for_pauses_nothing() -> None:
    async def scenario() -> None:
        sim, asked = await pausing_cluster()
        assert "the pause asked for is called off" in await sim.coordinator.resume(from_step=None)
        assert sim.state is JobState.RUNNING and shown(sim)["pausing"] is False
        sim.checkpoint(asked)
        await sim.tick(10)
        assert sim.state is JobState.RUNNING and not any(agent.stops() for agent in sim.agents.values())
        assert "pause_cancelled" in await sim.event_kinds()
    run(scenario())


def test_a_generation_that_fails_while_it_saves_for_a_pause_is_paused_not_relaunched() -> None:
    async def scenario() -> None:
        sim, _ = await pausing_cluster()
        sim.crash("b", 1, exit_code=1)
        await sim.tick()
        assert sim.state is JobState.PAUSED and sim.job.record.generation == 1
        assert await last_event(sim) == "job job is PAUSED by the operator: generation 1 ended before it saved"
        assert "recovery_started" in await sim.event_kinds()  # the failure is on record
        sim.confirm_stop()
        await sim.tick(5)
        assert sim.job.record.generation == 1  # nothing relaunched
        await sim.coordinator.resume(from_step=None)
        await sim.tick(0.1)
        assert sim.job.record.generation == 2
        assert sim.agents["a"].launches()[-1].checkpoint_path == "/ckpt/step_00000020"
    run(scenario())


def test_a_new_leader_carries_a_pause_on_and_pauses_once_the_checkpoint_comes() -> None:
    async def scenario() -> None:
        sim, asked = await pausing_cluster()
        standby = await take_over(sim)
        assert standby.job.record.pausing and shown(standby)["pausing"] is True
        standby.step(asked - 2)  # the runtime reports again to the new leader
        await standby.tick(0.1)
        assert standby.state is JobState.RUNNING
        [request] = standby.agents["a"].checkpoint_requests()
        standby.checkpoint(request.step)
        await standby.tick(0.1)
        assert standby.state is JobState.PAUSED
        assert await last_event(standby) == (f"job job is PAUSED by the operator: stopped after the checkpoint at "
                                             f"step {request.step}")
    run(scenario())


def test_a_script_without_graceful_exit_is_paused_at_once() -> None:
    async def scenario() -> None:
        sim = await launched_cluster(nodes=("a", "b"), **NO_BATCH)
        sim.step(2, from_output=True)
        await sim.tick()
        assert sim.state is JobState.RUNNING
        assert "is PAUSED" in await sim.coordinator.pause()
        assert sim.state is JobState.PAUSED and not sim.agents["a"].checkpoint_requests()
    run(scenario())


def test_a_paused_script_is_resumed_from_its_own_checkpoint_also_by_a_new_leader() -> None:
    """It has no checkpoint of trainerd's: the resume says where it does start, and so does the recovery."""
    async def scenario() -> None:
        sim = await launched_cluster(nodes=("a", "b"), **NO_BATCH)
        sim.step(2, from_output=True)
        await sim.tick()
        await sim.coordinator.pause()
        sim.confirm_stop()
        await sim.tick(1.0)
        standby = await take_over(sim)  # trainerd restarted while the job was PAUSED: no step heard since
        await standby.tick(1.0)
        assert standby.state is JobState.PAUSED
        assert (await standby.coordinator.resume(None)).endswith(
            "restarting from the script's own newest checkpoint, if it keeps one")
        await standby.tick(1.0)
        assert standby.job.record.generation == 2
        assert shown(standby)["last_recovery"]["resumed_from_step"] is None  # not "from step 0"
    run(scenario())


def test_a_script_with_graceful_exit_leaves_through_it_and_is_then_paused() -> None:
    async def scenario() -> None:
        sim = await launched_cluster(nodes=("a", "b"), graceful_exit_file="exit.json", **NO_BATCH)
        sim.step(2, from_output=True)
        await sim.tick()
        reply = await sim.coordinator.pause()
        assert "leaves through the script's graceful exit first" in reply
        await sim.tick()
        assert [r.generation for n in ("a", "b") for r in sim.agents[n].exit_requests()] == [1, 1]
        assert sim.state is JobState.RUNNING and not sim.agents["a"].stops()
        sim.finish_all()  # every rank leaves at the same step boundary: not COMPLETED
        await sim.tick()
        assert sim.state is JobState.PAUSED
        assert await last_event(sim) == "job job is PAUSED by the operator: every rank left at the graceful exit"
    run(scenario())


def test_the_log_names_the_nodes_a_stop_went_to_once_each(caplog) -> None:
    caplog.set_level(logging.INFO, "daemon.job.controller")

    async def scenario() -> None:
        sim = await running_cluster()
        sim.disconnect("b")  # within its reconnect grace: still placed, but nothing can be sent to it
        await sim.coordinator.pause(now=True)
        await sim.tick(0.1)
        (await sim.connect("b")).generation = 1  # it still runs generation 1
        await sim.tick(0.1)
        await sim.tick(0.1)
        stops = [r.getMessage() for r in caplog.records if "stopping generation" in r.getMessage()]
        assert stops == ["job job: stopping generation 1 on a, c: paused by the operator",
                         "job job: stopping generation 1 on b: job is PAUSED"], stops
    run(scenario())
