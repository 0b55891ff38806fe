"""Bad batches in the reconcile loop (fake clock, in-memory store): the ledger fills from the
workers' reports, a run of spikes rolls back and skips, a step that keeps crashing is skipped,
and every later generation is launched with the ledger."""

from __future__ import annotations

import asyncio

import pytest

from daemon.job.decide import _batch_end
from daemon.job.observation import SkippedBatch
from daemon.job.reports import BatchSkipped
from daemon.job.skip_ledger import BadRange, checked, samples_not_skipped
from daemon.job.state import FailureCause
from proto.vocabulary import JobState
from tests.daemon.job_sim import GLOBAL_BATCH, running_cluster


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_skipped_batches_enter_the_ledger_once_and_every_later_generation_gets_it() -> None:
    async def scenario() -> None:
        sim = await running_cluster(restart={"max": 5, "backoff_s": 0})
        sim.step(12)
        sim.bad_batch(12, "nonfinite_loss")
        sim.bad_batch(12, "nonfinite_loss")  # repeated by a retry: one entry
        sim.step(13)
        await sim.tick(0.1)
        entries = await sim.coordinator.skips()
        assert [(e.start, e.end, e.step, e.generation) for e in entries] == [(11 * GLOBAL_BATCH, 12 * GLOBAL_BATCH, 12, 1)]
        assert entries[0].reason.startswith("nonfinite_loss")
        assert sim.state is JobState.RUNNING  # one bad batch is skipped in the step, no restart
        assert sim.job.view().skipped_batches == 1
        sim.crash("a", 0)
        await sim.tick()
        sim.confirm_stop()
        await sim.tick(1.0)
        assert sim.agents["b"].launches()[-1].skips == ((11 * GLOBAL_BATCH, 12 * GLOBAL_BATCH),)
    run(scenario())


def test_a_run_of_spikes_rolls_back_before_it_and_skips_it() -> None:
    async def scenario() -> None:
        sim = await running_cluster(data_skip={"max_consecutive_spikes": 3}, restart={"max": 5, "backoff_s": 0})
        sim.step(20)
        sim.checkpoint(20)
        await sim.tick()
        for step in (21, 22):
            sim.step(step)
            sim.bad_batch(step)
        await sim.tick(0.1)
        assert sim.state is JobState.RUNNING
        sim.step(23)
        sim.bad_batch(23)
        await sim.tick(0.1)
        assert sim.state is JobState.RECOVERING
        assert sim.job.record.last_failure.cause is FailureCause.BAD_BATCHES
        sim.confirm_stop()
        await sim.tick(1.0)
        launch = sim.agents["a"].launches()[-1]
        assert launch.checkpoint_path == "/ckpt/step_00000020"
        rollback = [e for e in await sim.coordinator.skips() if e.reason.startswith("rollback")]
        assert [(e.start, e.end) for e in rollback] == [(20 * GLOBAL_BATCH, 23 * GLOBAL_BATCH)]
        assert (20 * GLOBAL_BATCH, 23 * GLOBAL_BATCH) in launch.skips
    run(scenario())


def test_spikes_interrupted_by_a_good_step_do_not_roll_back() -> None:
    async def scenario() -> None:
        sim = await running_cluster(data_skip={"max_consecutive_spikes": 2})
        sim.step(11)
        sim.bad_batch(11)
        sim.step(12)  # went through
        sim.step(13)
        sim.bad_batch(13)
        await sim.tick(0.1)
        assert sim.state is JobState.RUNNING
    run(scenario())


def test_a_step_that_crashes_workers_repeatedly_is_skipped() -> None:
    async def scenario() -> None:
        sim = await running_cluster(nodes=("a",), max_nodes=1, restart={"max": 5, "backoff_s": 0},
                                    data_skip={"crash_repeats": 2})
        for attempt in (1, 2):
            sim.started()
            sim.step(14)
            sim.crash("a", 0, signal=9)
            await sim.tick()
            sim.confirm_stop()
            await sim.tick(0.1)
            assert sim.job.record.generation == attempt + 1
        entries = await sim.coordinator.skips()
        assert [(e.start, e.end, e.step) for e in entries] == [(14 * GLOBAL_BATCH, 15 * GLOBAL_BATCH, 15)]
        assert "crashed a worker 2 times" in entries[0].reason
        assert sim.agents["a"].launches()[-1].skips == ((14 * GLOBAL_BATCH, 15 * GLOBAL_BATCH),)
        assert sim.job.record.crash_steps == {}
    run(scenario())


def test_operator_skips_are_checked_and_recorded() -> None:
    async def scenario() -> None:
        sim = await running_cluster()
        await sim.coordinator.add_skip(100, 164, "corrupt shard 7")
        assert "already" in await sim.coordinator.add_skip(100, 164, "again")
        with pytest.raises(BadRange, match="empty or negative"):
            await sim.coordinator.add_skip(50, 50, "x")
        [entry] = await sim.coordinator.skips()
        assert (entry.start, entry.end, entry.reason) == (100, 164, "operator: corrupt shard 7")
    run(scenario())


def test_a_bad_batch_wider_than_one_global_batch_is_not_recorded() -> None:
    """A buggy or hostile reporter could otherwise drop any amount of good data for good."""
    async def scenario() -> None:
        sim = await running_cluster()
        await sim.coordinator.add_skip(0, GLOBAL_BATCH, "corrupt shard 0")
        sim.step(3)
        first = sim.agents[sim.job.inbox.generation.placement.nodes[0]]
        # Everything from the job's start: one global batch not already in the ledger would pass; this is many.
        sim.coordinator.report(first.session, BatchSkipped(sim.job.inbox.generation.number, 0, SkippedBatch(
            3, 0, 10**9, "nonfinite_loss", 2.0, 99.0)))
        # A batch that runs over a ledger range holds one global batch of samples: recorded.
        sim.coordinator.report(first.session, BatchSkipped(sim.job.inbox.generation.number, 0, SkippedBatch(
            4, 0, 2 * GLOBAL_BATCH, "nonfinite_loss", 2.0, 99.0)))
        await sim.tick(0.1)
        entries = await sim.coordinator.skips()
        assert [(e.start, e.end) for e in entries] == [(0, GLOBAL_BATCH), (0, 2 * GLOBAL_BATCH)]
    run(scenario())


def test_samples_not_skipped_counts_what_no_range_covers() -> None:
    assert samples_not_skipped(0, 10, ()) == 10
    assert samples_not_skipped(0, 10, ((3, 5),)) == 8
    assert samples_not_skipped(0, 10, ((3, 5), (4, 7), (9, 30))) == 5
    assert samples_not_skipped(5, 10, ((0, 6), (20, 30))) == 4


def test_batch_end_passes_over_ledger_ranges() -> None:
    assert _batch_end(0, 10, ()) == 10
    assert _batch_end(0, 10, ((3, 5),)) == 12
    assert _batch_end(4, 10, ((3, 5), (20, 30))) == 15
    assert _batch_end(0, 10, ((10, 20),)) == 10
    assert _batch_end(0, 10, ((9, 20),)) == 21


def test_ledger_ranges_are_validated() -> None:
    with pytest.raises(BadRange, match="a skip needs a reason"):
        checked(0, 1, "   ")
    with pytest.raises(BadRange, match="beyond any dataset"):
        checked(0, 10**16, "x")
    assert checked(1, 2, " spaced\n reason ").reason == "spaced reason"
