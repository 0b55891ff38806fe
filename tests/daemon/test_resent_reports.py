"""An agent sends its newest checkpoint commit and each rank's newest progress again on every new
session (agent/supervisor.py `resend_reports`): the leader that had them may have lost office before
it recorded them. The leader takes such reports as they come: one it already has changes nothing
and writes no second event, one it never heard of is recorded like a fresh one, one of an older
generation is refused. Through the Coordinator and the JobController on the in-memory store with a
fake clock."""

from __future__ import annotations

import asyncio

from daemon.job.observation import GenerationObservation, ProgressReport
from daemon.job.reports import CheckpointCommitted, RankProgressed
from tests.daemon.job_sim import GLOBAL_BATCH, SimCluster, running_cluster, take_over


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def commit_events(sim: SimCluster) -> int:
    return (await sim.event_kinds()).count("checkpoint_saved")


def resend(sim: SimCluster, generation: int, step: int) -> None:
    """What every agent and rank 0's agent send again on reconnecting: each rank's progress at `step`, then
    the commit of `step` (a commit beyond the steps reported is not believed)."""
    for slot in sim.job.inbox.generation.placement.ranks:
        sim.coordinator.report(sim.agents[slot.node].session, RankProgressed(generation, ProgressReport(
            slot.rank, step, 0.5, 1.0, 120.0, step * GLOBAL_BATCH)))
    first = sim.agents[sim.job.inbox.generation.placement.nodes[0]].session
    sim.coordinator.report(first, CheckpointCommitted(generation, step, step * GLOBAL_BATCH, f"/ckpt/step_{step:08d}"))


def test_a_new_leader_records_a_resent_commit_it_never_had_once_and_shows_the_resent_step() -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b"))
        assert await commit_events(sim) == 1  # step 10
        sim.step(20)
        sim.checkpoint(20)  # heard by the leader, which loses office before its next pass records it
        standby = await take_over(sim)
        await standby.tick()
        assert [c.step for c in standby.job.catalog.entries()] == [10]
        assert standby.job.view().step is None

        resend(standby, 1, 10)  # a commit the catalog already holds: nothing new
        await standby.tick()
        assert await commit_events(standby) == 1
        assert standby.job.view().step == 10

        resend(standby, 1, 20)  # the one lost with the old leader: recorded like a fresh one
        await standby.tick()
        entry = standby.job.catalog.get(20)
        assert entry is not None and (entry.generation, entry.consumed_samples, entry.path) == (
            1, 20 * GLOBAL_BATCH, "/ckpt/step_00000020")
        assert await commit_events(standby) == 2
        assert standby.job.view().step == 20 and standby.job.view().last_checkpoint_step == 20

        for _ in range(2):  # the agents reconnect again (to this leader, or after another takeover)
            resend(standby, 1, 20)
            await standby.tick()
        again = await take_over(standby)
        resend(again, 1, 20)
        await again.tick()
        assert [c.step for c in again.job.catalog.entries()] == [10, 20]
        assert await commit_events(again) == 2
        assert again.job.view().step == 20
    run(scenario())


def test_reports_resent_from_a_generation_the_new_leader_moved_past_are_refused() -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b"))
        sim.crash("b", 1)
        await sim.tick()
        sim.confirm_stop()
        await sim.tick(1.0)
        assert sim.job.record.generation == 2
        standby = await take_over(sim)
        await standby.tick()
        resend(standby, 1, 30)
        await standby.tick()
        assert [c.step for c in standby.job.catalog.entries()] == [10]
        assert await commit_events(standby) == 1
        assert all(r.step != 30 for r in standby.job.view().ranks)
    run(scenario())


def test_progress_resent_at_a_known_step_is_no_news_for_hangs_or_the_step_rate() -> None:
    observation = GenerationObservation(1, started_at=0.0)
    for at, step in ((0.0, 10), (10.0, 20)):
        observation.record_progress(ProgressReport(0, step, 0.5, 1.0, 12.0, step * GLOBAL_BATCH), at)
    assert (observation.silent_since(), observation.steps_per_s()) == (10.0, 1.0)
    observation.record_progress(ProgressReport(0, 20, 0.5, 1.0, 12.0, 20 * GLOBAL_BATCH), 40.0)
    assert (observation.silent_since(), observation.steps_per_s()) == (10.0, 1.0)


def test_the_step_rate_counts_model_train_epochs_but_not_steps_that_restart_each_epoch() -> None:
    runtime, output = GenerationObservation(1, started_at=0.0), GenerationObservation(1, started_at=0.0)
    for at, step, epoch in ((0.0, 10, 1), (10.0, 30, 2)):
        runtime.record_progress(ProgressReport(0, step, 0.5, 1.0, 12.0, step * GLOBAL_BATCH, epoch=epoch), at)
        output.record_progress(ProgressReport(0, step, 0.5, 0.0, 0.0, 0, epoch=epoch, from_output=True), at)
    assert runtime.steps_per_s() == 2.0
    assert output.steps_per_s() is None
