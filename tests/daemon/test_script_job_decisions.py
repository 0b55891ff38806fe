"""An unmodified script (written for msrun, no trainerd import) under the simulated cluster: its
progress is read from its output (or never seen), its failures carry a root cause, it keeps its
own checkpoints."""

from __future__ import annotations

import asyncio

import pytest

from daemon.job.decide import (
    ERROR_SETTLE_S,
    GRACEFUL_EXIT_TIMEOUT_S,
    RUNNING_WITHOUT_PROGRESS_S,
    STARTUP_FAILURE_SETTLE_S,
)
from daemon.job.observation import RootCause
from daemon.job.state import FailureCause
from proto.vocabulary import JobState
from tests.daemon.job_sim import SimCluster, launched_cluster, running_cluster, take_over

FILE_MISSING = RootCause("FileNotFoundError: [Errno 2] No such file or directory: 'data/x'", "train.py:12",
                         "python_exception")
EVAL_BUG = RootCause("ValueError: For 'Accuracy.update', it needs 2 inputs, but got 3", "train.py:36",
                     "python_exception")
PEER_GONE = RootCause("RuntimeError: Connection reset by peer", "comm.py:80", "mindspore_error")
KERNEL_FAILED = RootCause("RuntimeError: Launch kernel failed: Default/AllReduce-op28", "train.py:24",
                          "python_exception")
NO_BATCH = {"global_batch": None, "micro_batch": None}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def wait(sim: SimCluster, seconds: float) -> None:
    """Let `seconds` pass in ticks of at most 10 s (heartbeats keep flowing)."""
    while seconds > 0:
        await sim.tick(min(seconds, 10.0))
        seconds -= 10.0


def test_a_start_up_error_on_every_rank_fails_the_job_when_the_relaunch_meets_it_again_and_resume_restarts_it(
        ) -> None:
    async def scenario() -> None:
        sim = await launched_cluster(**NO_BATCH)
        for rank, name in enumerate(("a", "b", "c")):
            sim.crash(name, rank, cause=FILE_MISSING)
        await sim.tick()
        record = sim.job.record  # it may have passed (a shared file system that hiccupped): relaunched once, free
        assert record.state is JobState.RECOVERING and record.last_failure.free_retry
        assert (record.crash_restarts, record.node_failures) == (0, {})
        recovery = [e for e in await sim.coordinator.events(0) if e.kind == "recovery_started"][-1]
        assert "relaunching once without spending the restart budget" in recovery.message
        sim.confirm_stop()
        await sim.tick(1.0)
        assert sim.job.record.generation == 2
        sim.started()
        for rank, name in enumerate(("a", "b", "c")):
            sim.crash(name, rank, cause=FILE_MISSING)
        await sim.tick()
        record = sim.job.record
        assert record.state is JobState.FAILED and record.last_failure.cause is FailureCause.JOB_ERROR
        assert "FileNotFoundError" in record.last_failure.message and record.last_failure.location == "train.py:12"
        assert (record.crash_restarts, record.node_failures, sim.job.view().quarantined) == (0, {}, frozenset())
        assert all(agent.stops() for agent in sim.agents.values())  # the scheduler does not linger
        sim.confirm_stop()
        await sim.coordinator.resume(from_step=None)
        await sim.tick()
        assert sim.state is JobState.RECOVERING and sim.job.record.generation == 3
    run(scenario())


def test_every_rank_missing_its_own_shard_is_one_error_of_the_jobs_not_a_crash_of_each_node() -> None:
    async def scenario() -> None:
        sim = await launched_cluster(**NO_BATCH)
        for rank, name in enumerate(("a", "b", "c")):
            sim.crash(name, rank, cause=RootCause(f"FileNotFoundError: [Errno 2] No such file or directory: "
                                                  f"'data/shard-{rank}.bin'", "train.py:12", "python_exception"))
        await sim.tick()
        record = sim.job.record
        assert record.state is JobState.RECOVERING and record.last_failure.free_retry
        assert "shard-0.bin" in record.last_failure.message and "ranks 0, 1, 2 failed the same way" in \
            record.last_failure.message
        assert record.last_failure.same_error_ranks == (0, 1, 2)
        assert (record.crash_restarts, record.node_failures) == (0, {})
    run(scenario())


def test_one_rank_failing_at_start_up_is_a_crash_once_the_settle_window_passed() -> None:
    async def scenario() -> None:
        sim = await launched_cluster(**NO_BATCH)
        sim.crash("b", 1, cause=FILE_MISSING)
        await sim.tick(STARTUP_FAILURE_SETTLE_S - 0.5)
        assert sim.state is JobState.PENDING  # the others might still fail the same way
        await sim.tick(0.5)
        record = sim.job.record
        assert record.state is JobState.RECOVERING and record.last_failure.cause is FailureCause.PROCESS_EXITED
        assert (record.crash_restarts, record.node_failures) == (1, {"b": 1})
    run(scenario())


def test_the_first_failure_by_time_is_kept_when_the_peers_collectives_break_after_it() -> None:
    async def scenario() -> None:
        sim = await launched_cluster(**NO_BATCH)
        sim.crash("c", 2, cause=FILE_MISSING)
        await sim.tick(1.0)
        sim.crash("a", 0, cause=PEER_GONE)
        await sim.tick(STARTUP_FAILURE_SETTLE_S)
        failure = sim.job.record.last_failure
        assert (failure.cause, failure.rank, failure.node, failure.location) == (
            FailureCause.PROCESS_EXITED, 2, "c", "train.py:12")
        # a's error is its collective breaking after c's crash, not c's error: c is singled out
        assert sim.job.record.node_failures == {"c": 1}
    run(scenario())


async def every_rank_raises(sim: SimCluster, cause: RootCause) -> None:
    """Mid-training, every rank of the generation exits with `cause`, rank 0's first."""
    for slot in sorted(sim.job.generation.placement.ranks, key=lambda slot: slot.rank):
        sim.crash(slot.node, slot.rank, cause=cause)
        await sim.tick(0.01)


async def relaunched(sim: SimCluster, step: int = 12, from_output: bool = False) -> None:
    sim.confirm_stop()
    await sim.tick(10.0)  # the crash backoff
    sim.started()
    sim.step(step, from_output=from_output)


def node_of(sim: SimCluster, rank: int) -> str:
    return sim.job.generation.placement.node_of(rank)


def test_an_error_every_rank_raises_blames_no_node_and_fails_the_job_once_it_ends_a_second_generation() -> None:
    async def scenario() -> None:
        # One crash would quarantine a node it singled out.
        sim = await running_cluster(restart={"max": 10, "backoff_s": 1.0, "quarantine_after": 1})
        await every_rank_raises(sim, EVAL_BUG)
        record = sim.job.record
        assert record.state is JobState.RECOVERING and record.last_failure.cause is FailureCause.PROCESS_EXITED
        assert record.last_failure.same_error_ranks == (0, 1, 2)
        assert (record.crash_restarts, record.node_failures, sim.job.view().quarantined) == (0, {}, frozenset())
        recovery = [e for e in await sim.coordinator.events(0) if e.kind == "recovery_started"][-1]
        assert "ranks 0, 1, 2 failed the same way; the job's own error, not a node's, unless it passes: relaunching " \
            "once without spending the restart budget" in recovery.message
        await relaunched(sim)
        assert sim.job.record.generation == 2 and sim.world() == ["a", "b", "c"]
        await every_rank_raises(sim, EVAL_BUG)
        record = sim.job.record
        assert record.state is JobState.FAILED and record.last_failure.cause is FailureCause.JOB_ERROR
        assert record.last_failure.location == "train.py:36" and "Accuracy.update" in record.last_failure.message
        assert "as ranks 0, 1, 2 did when the generation before ended" in record.last_failure.message
        assert (record.crash_restarts, record.node_failures) == (0, {})
    run(scenario())


def test_the_ranks_that_meet_an_error_together_are_waited_for_only_a_moment() -> None:
    async def scenario() -> None:
        sim = await running_cluster(restart={"max": 10, "backoff_s": 1.0, "quarantine_after": 3})
        sim.crash("b", 1, cause=EVAL_BUG)
        await sim.tick(ERROR_SETTLE_S - 0.5)
        assert sim.state is JobState.RUNNING  # the others may be a moment behind with the same error
        sim.crash("a", 0, cause=PEER_GONE)  # a collective broken by b's crash is not the same error
        await sim.tick(0.5)
        record = sim.job.record
        assert record.state is JobState.RECOVERING and record.last_failure.rank == 1
        assert record.last_failure.same_error_ranks == (1,) and record.node_failures == {"b": 1}
    run(scenario())


def test_one_rank_raising_the_same_error_twice_is_a_crash_and_a_changed_error_starts_over() -> None:
    async def scenario() -> None:
        sim = await running_cluster(restart={"max": 10, "backoff_s": 1.0, "quarantine_after": 5})
        for _ in range(2):  # one rank's error, twice: a node's or a sample's, relaunched each time
            sim.crash("b", 1, cause=EVAL_BUG)
            await sim.tick(ERROR_SETTLE_S)
            assert sim.state is JobState.RECOVERING
            await relaunched(sim)
        await every_rank_raises(sim, EVAL_BUG)
        assert sim.state is JobState.RECOVERING  # the first time every rank raised it
        await relaunched(sim)
        await every_rank_raises(sim, FILE_MISSING)
        assert sim.state is JobState.RECOVERING  # another error: the script changed, or it is another fault
        assert sim.job.record.last_failure.same_error_ranks == (0, 1, 2)
    run(scenario())


@pytest.mark.parametrize("from_output", [False, True], ids=["runtime", "output"])
def test_one_ranks_error_that_follows_it_to_another_node_fails_the_job_and_takes_back_the_nodes_crashes(
        from_output: bool) -> None:
    """From the runtime's reports the failing samples are known; read from a script's output they are not, and
    the failure says that nothing could be skipped."""
    async def scenario() -> None:
        sim = await running_cluster(restart={"max": 10, "backoff_s": 1.0, "quarantine_after": 3})
        sim.step(11, from_output=from_output)
        sim.crash("b", 1, cause=EVAL_BUG)  # a bug only rank 1 runs into (after step 10)
        await sim.tick(ERROR_SETTLE_S)
        assert sim.state is JobState.RECOVERING and sim.job.record.node_failures == {"b": 1}
        await relaunched(sim, step=12, from_output=from_output)
        assert node_of(sim, 1) == "b"  # once is no pattern: the world keeps its order
        sim.crash("b", 1, cause=EVAL_BUG)
        await sim.tick(ERROR_SETTLE_S)
        record = sim.job.record
        assert record.state is JobState.RECOVERING and record.node_failures == {"b": 2}
        assert (record.last_failure.blamed, record.last_failure.samples_at) == (2, -1 if from_output else 13 * 12)
        recovery = [e for e in await sim.coordinator.events(0) if e.kind == "recovery_started"][-1]
        assert "rank 1 failed the same way on node b 2 generations in a row: it runs on another node next" \
            in recovery.message
        await relaunched(sim, step=14, from_output=from_output)
        assert sim.world() == ["b", "c", "a"] and node_of(sim, 1) == "c"
        sim.crash("c", 1, cause=EVAL_BUG)
        await sim.tick(ERROR_SETTLE_S)
        record = sim.job.record
        assert record.state is JobState.FAILED and record.last_failure.cause is FailureCause.JOB_ERROR
        samples = "its samples unknown (none can be skipped)" if from_output else "at other samples"
        assert record.last_failure.message.endswith(f"; rank 1 failed the same way on node b before, {samples}: "
                                                    f"the error follows the rank, not a node or a batch")
        assert record.node_failures == {} and record.crash_restarts == 2
        failed = [e for e in await sim.coordinator.events(0) if e.kind == "job_failed"][-1]
        assert "node b is no longer blamed for its 2 crash(es) from this error" in failed.message
    run(scenario())


def test_a_nodes_own_error_stays_with_the_node_when_its_rank_moves_and_quarantines_it() -> None:
    async def scenario() -> None:
        sim = await running_cluster(restart={"max": 10, "backoff_s": 1.0, "quarantine_after": 3})
        for step in (12, 14):  # b lacks a file the job reads, whichever rank runs there
            sim.crash("b", 1, cause=FILE_MISSING)
            await sim.tick(ERROR_SETTLE_S)
            await relaunched(sim, step=step)
        assert sim.world() == ["b", "c", "a"] and node_of(sim, 0) == "b"
        sim.crash("b", 0, cause=FILE_MISSING)
        await sim.tick(ERROR_SETTLE_S)
        record = sim.job.record
        assert record.state is JobState.RECOVERING and record.last_failure.cause is FailureCause.PROCESS_EXITED
        assert record.node_failures == {"b": 3} and sim.job.view().quarantined == frozenset({"b"})
        assert (record.last_failure.blamed_node, record.last_failure.blamed) == ("b", 1)  # another rank: a new count
        await relaunched(sim, step=16)
        assert "b" not in sim.world()
    run(scenario())


def test_a_rank_is_moved_once_for_its_error_not_again_at_a_reshape_after_it() -> None:
    async def scenario() -> None:
        sim = await running_cluster(restart={"max": 10, "backoff_s": 1.0, "quarantine_after": 3})
        for step in (12, 14):
            sim.crash("b", 1, cause=EVAL_BUG)
            await sim.tick(ERROR_SETTLE_S)
            await relaunched(sim, step=step)
        assert sim.world() == ["b", "c", "a"]
        await sim.coordinator.set_drain("a", True)  # the generation ends for a reshape, not a failure
        await sim.tick(0.1)
        [request] = sim.agents["b"].checkpoint_requests()
        sim.checkpoint(request.step)
        await sim.tick(0.1)
        assert sim.state is JobState.RECOVERING
        sim.confirm_stop()
        await sim.tick(0.1)
        assert sim.world() == ["b", "c"]  # the failure before the reshape turns the order no more
    run(scenario())


def test_an_error_that_follows_a_rank_at_the_same_samples_may_be_a_batch_and_is_skipped_first() -> None:
    async def scenario() -> None:
        sim = await running_cluster(restart={"max": 10, "backoff_s": 1.0, "quarantine_after": 1})
        sim.crash("b", 1, cause=EVAL_BUG)
        await sim.tick(ERROR_SETTLE_S)
        assert sim.job.view().quarantined == frozenset({"b"})
        await relaunched(sim, step=10)  # the same step again: the same samples
        assert "b" not in sim.world() and node_of(sim, 1) == "c"
        sim.crash("c", 1, cause=EVAL_BUG)
        await sim.tick(ERROR_SETTLE_S)
        record = sim.job.record
        assert record.state is JobState.RECOVERING and record.last_failure.cause is FailureCause.PROCESS_EXITED
        assert [(entry.start, entry.end) for entry in await sim.coordinator.skips()] == [(10 * 12, 11 * 12)]
        assert record.node_failures == {"b": 1}  # the error came with the rank: c is not to blame
        recovery = [e for e in await sim.coordinator.events(0) if e.kind == "recovery_started"][-1]
        assert "rank 1 failed the same way on node b, at these samples: node c is not blamed" in recovery.message
        await relaunched(sim, step=10)  # step 11 now trains on other samples
        sim.crash("c", 1, cause=EVAL_BUG)
        await sim.tick(ERROR_SETTLE_S)
        record = sim.job.record
        assert record.state is JobState.FAILED and record.last_failure.cause is FailureCause.JOB_ERROR
        assert record.node_failures == {} and sim.job.view().quarantined == frozenset()
        failed = [e for e in await sim.coordinator.events(0) if e.kind == "job_failed"][-1]
        assert "node b is no longer blamed for its 1 crash(es) from this error and its quarantine is lifted" \
            in failed.message
    run(scenario())


def test_a_killed_rank_is_acted_on_at_once() -> None:
    async def scenario() -> None:
        sim = await running_cluster()
        sim.crash("b", 1, exit_code=0, signal=9)
        await sim.tick()
        assert sim.state is JobState.RECOVERING and sim.job.record.node_failures == {"b": 1}
    run(scenario())


def test_a_silent_script_is_running_after_the_window_and_hangs_only_once_it_showed_progress() -> None:
    async def scenario() -> None:
        sim = await launched_cluster(hang_timeout_s=30.0, **NO_BATCH)
        await wait(sim, RUNNING_WITHOUT_PROGRESS_S - 1)
        assert sim.state is JobState.PENDING
        await sim.tick(1.0)
        assert sim.state is JobState.RUNNING and not sim.job.view().hang_detection
        await wait(sim, 100.0)  # far past hang_timeout_s: nothing to judge yet
        assert sim.state is JobState.RUNNING
        sim.step(3, epoch=1, from_output=True)
        sim.step(4, epoch=1, from_output=True, ranks=(0, 2))
        view = sim.job.view()
        assert view.hang_detection and view.epoch == 1 and all(r.from_output for r in view.ranks)
        await wait(sim, 30.5)
        failure = sim.job.record.last_failure
        assert failure.cause is FailureCause.HANG
        assert failure.message.endswith("(hang_timeout_s 30); rank 1 on node b was behind at epoch 1 step 3")
        assert all(agent.stops()[-1].dump_stacks for agent in sim.agents.values())
        recovery = [e for e in await sim.coordinator.events(0) if e.kind == "recovery_started"][-1]
        assert recovery.message.endswith("; its steps are read from its output, so an evaluation or a save of the "
                                         "script's own that prints nothing for longer than hang_timeout_s looks the "
                                         "same: if that is it, raise job.hang_timeout_s")
    run(scenario())


def test_a_script_without_graceful_exit_is_stopped_at_once_to_take_a_node_in() -> None:
    async def scenario() -> None:
        sim = await launched_cluster(nodes=("a", "b"), **NO_BATCH)
        sim.step(2, epoch=1, from_output=True)
        await sim.tick()
        assert sim.state is JobState.RUNNING
        await sim.connect("c")
        await sim.tick()
        assert sim.state is JobState.RECOVERING and sim.job.record.crash_restarts == 0
        assert [len(sim.agents[n].stops()) for n in ("a", "b")] == [1, 1]
        assert not sim.agents["a"].checkpoint_requests()
        sim.confirm_stop()
        await sim.tick()
        assert sim.job.record.generation == 2 and sim.world() == ["a", "b", "c"]
    run(scenario())


def test_where_a_relaunched_script_resumes_and_what_it_lost_are_not_claimed() -> None:
    """A script read from its output resumes from its own checkpoints, if any: the recovery names neither
    the step it resumes from nor the steps lost (it said "from step 0, 319 steps lost" for a script that
    resumed from its checkpoint of step 300); one with the runtime that has no checkpoint yet starts at 0."""
    async def scenario() -> None:
        for from_output, expected in ((True, (None, None)), (False, (0, 30))):
            sim = await launched_cluster(nodes=("a", "b"), max_nodes=2, restart={"max": 3, "backoff_s": 0},
                                         **NO_BATCH)
            sim.step(30, epoch=2 if from_output else None, from_output=from_output)
            await sim.tick()
            sim.crash("a", 0, signal=9)
            await sim.tick()
            sim.exit_on_stop("a")
            sim.exit_on_stop("b")
            sim.confirm_stop()
            await sim.tick()
            assert sim.job.record.generation == 2
            recovery = sim.job.view().last_recovery
            assert (recovery.resumed_from_step, recovery.lost_steps) == expected, from_output
    run(scenario())


def test_a_new_leader_claims_no_resume_step_for_a_script_whose_agents_restarted_with_trainerd() -> None:
    """trainerd restarted with its local agents under a script job: the new leader heard no step of the
    generation, yet the script resumes from its own checkpoints as before (it said "from step 0")."""
    async def scenario() -> None:
        for from_output, expected in ((True, None), (False, 0)):
            sim = await launched_cluster(nodes=("a", "b"), max_nodes=2, **NO_BATCH)
            sim.step(30, epoch=2 if from_output else None, from_output=from_output)
            await sim.tick()
            assert sim.state is JobState.RUNNING
            standby = await take_over(sim, agents_restarted=True)
            await standby.tick(0.1)
            await standby.tick(1.0)  # the second heartbeat naming no generation
            assert standby.job.record.last_failure.cause is FailureCause.PROCESSES_GONE
            await standby.tick(1.0)
            assert standby.job.record.generation == 2
            recovery = standby.job.view().last_recovery
            assert (recovery.resumed_from_step, recovery.lost_steps) == (expected, None), from_output
    run(scenario())


def test_a_script_with_graceful_exit_leaves_through_it_and_is_relaunched_on_the_larger_world() -> None:
    async def scenario() -> None:
        sim = await launched_cluster(nodes=("a", "b"), graceful_exit_file="exit.json", workdir="/srv/job",
                                     progress_pattern=r"step (?P<step>\d+)", **NO_BATCH)
        launch = sim.agents["a"].launches()[0]
        assert (launch.workdir, launch.graceful_exit_file, launch.progress_pattern) == (
            "/srv/job", "exit.json", r"step (?P<step>\d+)")
        sim.step(2, from_output=True)
        await sim.tick()
        await sim.connect("c")
        await sim.tick()
        assert [r.generation for n in ("a", "b") for r in sim.agents[n].exit_requests()] == [1, 1]
        assert sim.state is JobState.RUNNING and not sim.agents["a"].stops()
        sim.finish_all()  # every rank leaves at the same step boundary
        await sim.tick()
        assert sim.state is JobState.RECOVERING  # not COMPLETED
        sim.confirm_stop()
        await sim.tick()
        assert sim.job.record.generation == 2 and sim.world() == ["a", "b", "c"]
        assert sim.job.record.crash_restarts == 0
        kinds = await sim.event_kinds()
        assert kinds.index("exit_requested") < kinds.index("reshape_started")
    run(scenario())


def test_a_new_leader_knows_the_generation_was_asked_to_leave_and_does_not_call_it_completed() -> None:
    async def scenario() -> None:
        sim = await launched_cluster(nodes=("a", "b"), graceful_exit_file="exit.json", **NO_BATCH)
        sim.step(2, from_output=True)
        await sim.tick()
        await sim.connect("c")
        await sim.tick()
        assert sim.job.record.exit_requested_generation == 1
        await sim.job.load(sim.coordinator.leadership.fence)  # what a newly elected leader does
        sim.finish_all()
        await sim.tick()
        assert sim.state is JobState.RECOVERING
    run(scenario())


def test_a_graceful_exit_that_does_not_come_is_given_up_and_the_generation_stopped() -> None:
    async def scenario() -> None:
        sim = await launched_cluster(nodes=("a", "b"), graceful_exit_file="exit.json", **NO_BATCH)
        sim.step(2, from_output=True)
        await sim.tick()
        await sim.connect("c")
        await sim.tick()
        await sim.tick(GRACEFUL_EXIT_TIMEOUT_S - 0.5)
        assert sim.state is JobState.RUNNING
        await sim.tick(0.5)
        assert sim.state is JobState.RECOVERING and sim.agents["a"].stops()
        assert "did not end generation 1" in (await sim.coordinator.events(0))[-1].message
    run(scenario())


def test_without_a_batch_split_a_step_that_keeps_crashing_is_not_skipped() -> None:
    async def scenario() -> None:
        sim = await running_cluster(restart={"max": 5, "backoff_s": 0}, data_skip={"crash_repeats": 2}, **NO_BATCH)
        for _ in range(2):
            sim.started()
            sim.step(14)
            sim.crash("a", 0, signal=9)
            await sim.tick()
            sim.confirm_stop()
            await sim.tick(0.1)
        assert await sim.coordinator.skips() == () and sim.job.record.crash_steps == {}
        recovery = [e.message for e in await sim.coordinator.events(0) if e.kind == "recovery_started"][-1]
        assert recovery.endswith("but without global_batch its samples are unknown: nothing is skipped")
    run(scenario())


def test_a_free_retry_survives_a_new_leader_which_fails_the_job_when_the_error_comes_again() -> None:
    async def scenario() -> None:
        sim = await launched_cluster(**NO_BATCH)
        for rank, name in enumerate(("a", "b", "c")):
            sim.crash(name, rank, cause=FILE_MISSING)
        await sim.tick()
        assert sim.state is JobState.RECOVERING and sim.job.record.last_failure.free_retry
        standby = await take_over(sim)  # it reads the free retry from etcd
        standby.confirm_stop()
        await standby.tick(1.0)
        assert standby.job.record.generation == 2
        standby.started()
        for rank, name in enumerate(("a", "b", "c")):
            standby.crash(name, rank, cause=FILE_MISSING)
        await standby.tick()
        record = standby.job.record
        assert record.state is JobState.FAILED and record.last_failure.cause is FailureCause.JOB_ERROR
        assert record.crash_restarts == 0
    run(scenario())


def test_ranks_timed_out_waiting_for_a_cold_rank_recover_and_the_cold_rank_is_named() -> None:
    async def scenario() -> None:
        # The demo: a host came back, the job grew to 3, and its rank 2 was slow to reach the first
        # collective; ranks 0 and 1 timed out waiting in their AllReduce.
        sim = await launched_cluster(restart={"max": 3, "backoff_s": 1.0, "quarantine_after": 1})
        for rank, name in enumerate(("a", "b")):
            sim.crash(name, rank, cause=KERNEL_FAILED)
        await sim.tick(STARTUP_FAILURE_SETTLE_S)
        record = sim.job.record
        assert record.state is JobState.RECOVERING and record.last_failure.cause is FailureCause.PROCESS_EXITED
        assert (record.last_failure.rank, record.last_failure.node) == (2, "c")
        assert record.last_failure.message.startswith("rank 2 on node c reached no collective, and ranks 0, 1 "
                                                      "failed waiting: rank 0 on node a exited with code 1:")
        assert (record.crash_restarts, record.node_failures, sim.job.view().quarantined) == (1, {}, frozenset())
        sim.confirm_stop()
        await sim.tick(1.0)  # the crash backoff
        assert sim.job.record.generation == 2 and sim.world() == ["a", "b", "c"]
        sim.started()
        sim.step(1)
        await sim.tick()
        assert sim.state is JobState.RUNNING
    run(scenario())
