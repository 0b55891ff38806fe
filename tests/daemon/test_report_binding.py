"""Reports are bound to the placement: a worker's report counts only from the node its rank runs on in
that generation, the scheduler's and a checkpoint commit only from rank 0's node, and a checkpoint's
path only inside job.checkpoint.dir (when recorded, and again before a Launch names it). End to end
through the Coordinator and the JobController on the in-memory store with a fake clock."""

from __future__ import annotations

import asyncio
import logging

from daemon.job.observation import ProcessReport, ProgressReport, RootCause, SkippedBatch
from daemon.job.reports import BatchSkipped, CheckpointCommitted, ProcessChanged, RankProgressed
from daemon.store import codec, keys
from proto.exit_codes import EXIT_USAGE
from proto.vocabulary import CauseKind, JobState, ProcessRole
from tests.daemon.job_sim import GLOBAL_BATCH, crash_and_relaunch, running_cluster, take_over


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_an_exit_reported_by_a_node_outside_the_job_changes_nothing() -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b", "c"))
        outsider = await sim.connect("x")  # READY, but max_nodes 3: not in the generation
        assert "x" not in sim.world()
        sim.coordinator.report(outsider.session, ProcessChanged(1, ProcessReport(
            "x", ProcessRole.WORKER, 1, 4242, False, exit_code=EXIT_USAGE)))
        sim.coordinator.report(outsider.session, ProcessChanged(1, ProcessReport("x", ProcessRole.SCHEDULER, -1, 4243,
                                                                                 False, exit_code=1)))
        await sim.tick()
        assert sim.state is JobState.RUNNING and sim.job.record.last_failure is None
    run(scenario())


def test_a_node_speaks_only_for_its_own_ranks_and_only_rank_0s_node_for_the_scheduler() -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b", "c"))
        b = sim.agents["b"].session
        sim.coordinator.report(b, ProcessChanged(1, ProcessReport("b", ProcessRole.WORKER, 0, 200, False, exit_code=1)))
        sim.coordinator.report(b, ProcessChanged(1, ProcessReport("b", ProcessRole.SCHEDULER, -1, 100, False,
                                                                  exit_code=1)))
        sim.coordinator.report(b, RankProgressed(1, ProgressReport(2, 99, 0.1, 1.0, 1.0, 99 * GLOBAL_BATCH)))
        sim.coordinator.report(b, BatchSkipped(1, 0, SkippedBatch(11, 120, 132, "nonfinite_loss", float("nan"), 1.0)))
        await sim.tick()
        assert sim.state is JobState.RUNNING and sim.job.record.last_failure is None
        assert [r.step for r in sim.job.view().ranks] == [10, 10, 10]
        assert sim.job.ledger.entries() == ()

        sim.coordinator.report(b, RankProgressed(1, ProgressReport(1, 11, 0.1, 1.0, 1.0, 11 * GLOBAL_BATCH)))
        sim.crash("b", 1)  # its own rank: heard
        await sim.tick()
        assert sim.state is JobState.RECOVERING and sim.job.record.last_failure.node == "b"
        assert sim.job.record.crash_steps == {12: 1}
    run(scenario())


def test_a_checkpoint_counts_only_from_rank_0s_node_and_inside_the_checkpoint_dir() -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b", "c"))
        a, b = sim.agents["a"].session, sim.agents["b"].session
        sim.step(30)
        sim.coordinator.report(b, CheckpointCommitted(1, 20, 20 * GLOBAL_BATCH, "/ckpt/step_00000020"))  # not rank 0's
        for step, forged in ((21, "/etc/evil/step_00000021"), (22, "/ckpt/../etc/step_00000022"),
                             (23, "ckpt/step_00000023"), (24, "/ckpt"), (25, "/ckptx/step_00000025")):
            sim.coordinator.report(a, CheckpointCommitted(1, step, step * GLOBAL_BATCH, forged))
        await sim.tick()
        assert [c.step for c in sim.job.catalog.entries()] == [10]

        await crash_and_relaunch(sim)
        launch = sim.agents["a"].launches()[-1]
        assert launch.checkpoint_path == "/ckpt/step_00000010"
        assert {p.env["TRAINERD_RESUME_FROM"] for p in launch.processes} == {"/ckpt/step_00000010"}

        sim.step(20)
        sim.coordinator.report(a, CheckpointCommitted(2, 20, 20 * GLOBAL_BATCH, "/ckpt/./sub/../step_00000020"))
        await sim.tick()
        assert [c.step for c in sim.job.catalog.entries()] == [10, 20]
    run(scenario())


def test_a_catalog_entry_outside_the_checkpoint_dir_is_marked_bad_and_never_resumed_from() -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b"))
        entry = {"step": 30, "consumed_samples": 30 * GLOBAL_BATCH, "path": "/elsewhere/step_00000030",
                 "generation": 1, "world_size": 2, "problem": "", "superseded": False}
        # Written by hand into etcd; a new leader reads it with the catalog.
        assert await sim.store.compare_and_swap(keys.checkpoint("job", 30), codec.encode(entry), 0)
        await sim.job.catalog.load()

        sim.crash("b", 1)
        await sim.tick()
        sim.confirm_stop()
        await sim.tick(1.0)  # chooses step 30, finds it outside: marked bad; the next pass chooses 10
        await sim.tick()
        assert "not inside job.checkpoint.dir /ckpt" in sim.job.catalog.get(30).problem
        assert sim.job.record.generation == 2
        assert [launch.checkpoint_path for launch in sim.agents["a"].launches()] == ["", "/ckpt/step_00000010"]
    run(scenario())


def test_a_generation_whose_resume_was_moved_outside_the_checkpoint_dir_is_not_launched(caplog) -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b"))
        await crash_and_relaunch(sim)
        key = keys.generation("job", 2)
        kv = await sim.store.get(key)
        record = codec.decode(kv.value, key=key)
        record["resume"]["path"] = "/etc/evil/step_00000010"  # changed by hand in etcd
        assert await sim.store.compare_and_swap(key, codec.encode(record), kv.mod_revision)

        standby = await take_over(sim)
        with caplog.at_level(logging.ERROR, logger="daemon.pass_guard"):
            await standby.tick()
        assert all(not agent.launches() for agent in standby.agents.values())
        assert any("outside job.checkpoint.dir /ckpt; it is not launched" in r.getMessage() for r in caplog.records)
        assert standby.coordinator.leadership is not None
    run(scenario())


def test_forged_reports_are_warned_about_once_a_minute_per_node(caplog) -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b"))
        b = sim.agents["b"].session
        with caplog.at_level(logging.WARNING, logger="daemon.job.inbox"):
            for _ in range(100):
                sim.coordinator.report(b, ProcessChanged(1, ProcessReport("b", ProcessRole.WORKER, 0, 200, False,
                                                                          exit_code=1)))
            sim.clock.advance(61)
            sim.coordinator.report(b, ProcessChanged(1, ProcessReport("b", ProcessRole.WORKER, 0, 200, False, exit_code=1)))
        warnings = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert len(warnings) == 2
        assert "node b sent a process report of rank 0 in generation 1, which runs on node a" in warnings[0]
        assert "99 more about b held back" in warnings[1]
    run(scenario())


def test_a_generation_that_moved_on_takes_no_commit_progress_or_exit_from_the_one_before() -> None:
    """A fenced-off host's last reports (it was cut off while generation 1 ran) arrive after the job
    moved on to generation 2: none of them is recorded or acted on."""
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b", "c"))
        sim.step(15)
        await crash_and_relaunch(sim)
        a = sim.agents["a"].session
        sim.coordinator.report(a, CheckpointCommitted(1, 30, 30 * GLOBAL_BATCH, "/ckpt/step_00000030"))
        sim.coordinator.report(a, RankProgressed(1, ProgressReport(0, 99, 0.1, 1.0, 1.0, 99 * GLOBAL_BATCH)))
        sim.coordinator.report(a, ProcessChanged(1, ProcessReport("a", ProcessRole.WORKER, 0, 200, False, exit_code=1)))
        await sim.tick()
        assert [c.step for c in sim.job.catalog.entries()] == [10]
        assert sim.state is not JobState.FAILED and sim.job.record.generation == 2
        assert all(r.step != 99 for r in sim.job.view().ranks)
        assert sim.job.record.last_failure is None or sim.job.record.last_failure.rank == 1
    run(scenario())


def test_a_launch_an_agent_refused_is_one_launch_refused_event_per_node_with_its_reason() -> None:
    """Issue 47: a refused Launch left the job PENDING with no event. The agent reports each process it did not
    start with a root cause of kind launch_refused; the coordinator records one event per node, saying why."""
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a", "b"))
        reason = "refused to launch ['{python}', 'train.py']: its environment sets 'PATH' (it loads code)"
        for role, rank in ((ProcessRole.SCHEDULER, -1), (ProcessRole.WORKER, 0)):
            sim.coordinator.report(sim.agents["a"].session, ProcessChanged(1, ProcessReport(
                "a", role, rank, 0, False, exit_code=127, cause=RootCause(reason, kind=CauseKind.LAUNCH_REFUSED))))
        await sim.tick()
        refused = [e for e in await sim.coordinator.events(0) if e.kind == "launch_refused"]
        assert [(e.fields["node"], e.fields["generation"], e.fields["reason"]) for e in refused] == [("a", 1, reason)]
        assert "node a refused to launch generation 1: " + reason in refused[0].message
    run(scenario())
