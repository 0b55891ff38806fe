"""Every rule of the job's reconcile decision, as plain values in and actions out: no controller,
no store, no clock. `job_world` builds the facts a pass sees; each test changes only what its
rule reads."""

from __future__ import annotations

from dataclasses import replace

import pytest

from daemon.config import JobSettings
from daemon.events import EventKind
from daemon.job.catalog import CheckpointEntry
from daemon.job.decide import (
    MIN_CHECKPOINT_LEAD_STEPS,
    REMEMBERED_BAD_MEMORY_STEPS,
    STOPPING,
    AddSkip,
    CheckpointRequest,
    CommitRecord,
    EndStopPhase,
    ExitRequest,
    JobWorld,
    LaunchGeneration,
    MarkCheckpointBad,
    NotePlaceableSince,
    ReadyToStop,
    RequestCheckpoint,
    RequestGracefulExit,
    StopGeneration,
    bad_memory_steps_after,
    decide,
    record_after_checkpoint,
)
from daemon.job.observation import (
    GenerationObservation,
    MemorySnapshot,
    ProcessReport,
    ProgressReport,
    RootCause,
    SkippedBatch,
)
from daemon.job.placement import NodeOffer, place
from daemon.job.state import Failure, FailureCause, GenerationRecord, JobRecord, ResumePoint
from daemon.membership import DeviceInfo
from proto.exit_codes import EXIT_CANNOT_EXECUTE, EXIT_CHECKPOINT_UNREADABLE, EXIT_USAGE
from proto.vocabulary import JobState, ProcessRole

NOW = 1000.0
FILE_MISSING = RootCause("FileNotFoundError: [Errno 2] No such file or directory: 'data/x'", "train.py:12",
                         "python_exception")
PEER_GONE = RootCause("RuntimeError: Connection reset by peer", "comm.py:80", "mindspore_error")
NO_BATCH = {"global_batch": None, "micro_batch": None}
NODES = ("a", "b", "c")  # one device each: node a runs rank 0, b rank 1, c rank 2
GLOBAL_BATCH = 12
SPEC = {"name": "job", "entrypoint": ["train"], "min_nodes": 1, "max_nodes": 3, "global_batch": GLOBAL_BATCH,
        "micro_batch": 1, "start_wait_s": 10.0, "stop_grace_s": 5.0, "hang_timeout_s": 60.0,
        "restart": {"max": 3, "backoff_s": 1.0, "max_backoff_s": 8.0, "quarantine_after": 3}}


def _offer(name: str) -> NodeOffer:
    return NodeOffer(name, f"host-{name}", (DeviceInfo(0, "", "cpu"),))


def _checkpoint(step: int) -> CheckpointEntry:
    return CheckpointEntry(step, step * GLOBAL_BATCH, f"/ckpt/step_{step:08d}", 1, 3)


def exited(node: str, rank: int, exit_code: int = 0, signal: int = 0, *, cause: RootCause | None = None,
           at: float = 0.0) -> ProcessReport:
    return ProcessReport(node, ProcessRole.WORKER, rank, 100 + rank, False, exit_code, signal, log_tail="boom",
                         cause=cause, observed_at=at)


def progress(rank: int, step: int, epoch: int | None = None, from_output: bool = False) -> ProgressReport:
    return ProgressReport(rank, step, 0.5, 1.0, 10.0 * GLOBAL_BATCH, step * GLOBAL_BATCH, epoch, from_output)


def job_world(*, spec: dict | None = None, state: JobState = JobState.RUNNING, record: dict | None = None,
              on: tuple[str, ...] | None = NODES, offers: tuple[str, ...] = NODES, stopped: bool = False,
              step: int | None = 10, resume_step: int | None = None, reports: tuple[ProcessReport, ...] = (),
              seen: dict | None = None, catalog: tuple[CheckpointEntry | int, ...] = (10,),
              started_ago: float = 100.0, from_output: bool = False, **facts) -> JobWorld:
    """A job in `state` whose generation 1 runs on `on` (None: nothing launched yet), its processes
    started `started_ago` s ago (from `resume_step`'s checkpoint), every rank at `step` (reported 1 s
    ago, at 10 steps/s, by the trainer runtime or, `from_output`, read from its output).
    `stopped`: its stop was decided, sent and confirmed by every node 10 s ago. `offers`: the READY
    nodes; `catalog`: checkpoint steps (or entries). Overrides: `spec` (job settings), `record`
    (JobRecord fields), `seen` (GenerationObservation fields), `reports` (process reports on top),
    `facts` (any other JobWorld field)."""
    settings = JobSettings.model_validate({**SPEC, **(spec or {})})
    changes: dict = {}
    generation: GenerationRecord | None = None
    observation: GenerationObservation | None = None
    if on is not None:
        placement = place(settings, [_offer(n) for n in on])
        assert placement is not None, f"{on} cannot hold the job"
        resume = None if resume_step is None else ResumePoint(resume_step, resume_step * GLOBAL_BATCH,
                                                               f"/ckpt/step_{resume_step:08d}")
        generation = GenerationRecord(1, placement, settings.scheduler_port, "{}", resume)
        observation = GenerationObservation(1, started_at=NOW - started_ago)
        for slot in placement.ranks:
            observation.agent_generation[slot.node] = 1
            observation.record_process(ProcessReport(slot.node, ProcessRole.WORKER, slot.rank, 100 + slot.rank, True,
                                                     observed_at=NOW - started_ago))
            if step is not None:
                observation.record_progress(progress(slot.rank, step, from_output=from_output), NOW - 1)
        if stopped:
            observation.stop_decided_at = observation.all_stopped_at = NOW - 10
            observation.stop_sent = {n: NOW - 10 for n in placement.nodes}
            observation.stopped = set(placement.nodes)
        for report in reports:
            observation.record_process(report)
        for name, value in (seen or {}).items():
            setattr(observation, name, value)
        changes = {"generation": 1, "world_size": placement.world_size, "stopped_generation": int(stopped)}
    world = JobWorld(settings, JobRecord(state, **{**changes, **(record or {})}), generation, observation,
                     tuple(_offer(n) for n in offers), frozenset(), frozenset(), frozenset(),
                     tuple(c if isinstance(c, CheckpointEntry) else _checkpoint(c) for c in catalog), (), None,
                     None, NOW)
    return replace(world, **facts)


def commit_of(actions: list) -> CommitRecord:
    [commit] = [a for a in actions if isinstance(a, CommitRecord)]
    return commit


# ---------------------------------------------------------------- the first generation

@pytest.mark.parametrize("offers, placeable_since, world_size", [
    (("a", "b"), None, None),  # min_nodes are here: wait start_wait_s for the third
    (("a", "b"), NOW - 9.9, None),
    (("a", "b"), NOW - 10, 2),  # waited long enough
    (NODES, None, 3),  # max_nodes are here: no need to wait
])
def test_first_launch_waits_for_max_nodes_or_start_wait_s(offers, placeable_since, world_size) -> None:
    actions = decide(job_world(state=JobState.PENDING, on=None, offers=offers, catalog=(),
                               placeable_since=placeable_since))
    notes = [] if placeable_since is not None else [NotePlaceableSince(NOW)]
    launches = [a for a in actions if isinstance(a, LaunchGeneration)]
    assert actions == notes + launches
    if world_size is None:
        assert launches == []
    else:
        [launch] = launches
        assert launch.placement.world_size == world_size and launch.checkpoint is None
        assert launch.record == JobRecord(JobState.PENDING, generation=1, world_size=world_size)


def test_placeable_since_is_forgotten_when_the_nodes_cannot_hold_the_job_or_it_launched() -> None:
    assert decide(job_world(spec={"min_nodes": 2}, state=JobState.PENDING, on=None, offers=("a",),
                            placeable_since=NOW - 5)) == [NotePlaceableSince(None)]
    assert NotePlaceableSince(None) in decide(job_world(placeable_since=NOW - 5))


def test_every_rank_reporting_a_step_makes_the_job_running() -> None:
    [commit] = decide(job_world(state=JobState.PENDING))
    assert commit.record.state is JobState.RUNNING and commit.event == "job_running"
    assert decide(job_world(state=JobState.PENDING, step=None, started_ago=0)) == []


# ---------------------------------------------------------------- a live generation

def test_completion_commits_then_stops_the_scheduler() -> None:
    actions = decide(job_world(reports=tuple(exited(n, r) for r, n in enumerate(NODES))))
    assert actions == [CommitRecord(JobRecord(JobState.COMPLETED, 1, 3, stopped_generation=1), EventKind.JOB_COMPLETED,
                                    "job job is COMPLETED"), StopGeneration("every rank finished", job_completed=True)]


def test_a_worker_told_exited_with_no_pid_never_started_and_is_no_finished_rank() -> None:
    never_started = ProcessReport("a", ProcessRole.WORKER, 0, 0, False, 0, 0)
    reports = (never_started,) + tuple(exited(n, r) for r, n in enumerate(NODES) if r > 0)
    assert not any(isinstance(a, StopGeneration) for a in decide(job_world(reports=reports)))


def test_a_lost_node_ends_the_generation_without_spending_the_budget() -> None:
    actions = decide(job_world(lost_nodes=frozenset({"c"})))
    commit = commit_of(actions)
    assert actions[-1] == StopGeneration("node c was lost while running generation 1")
    assert commit.record.last_failure.cause is FailureCause.NODE_LOST and commit.recovery == FailureCause.NODE_LOST
    assert (commit.record.state, commit.record.stopped_generation) == (JobState.RECOVERING, 1)
    assert (commit.record.restarts, commit.record.crash_restarts, commit.record.consecutive_crashes) == (1, 0, 0)


@pytest.mark.parametrize("exit_code, signal, cause, state", [
    (1, 0, FailureCause.PROCESS_EXITED, JobState.RECOVERING),
    (0, 9, FailureCause.PROCESS_EXITED, JobState.RECOVERING),
    (EXIT_USAGE, 9, FailureCause.PROCESS_EXITED, JobState.RECOVERING),  # killed, whatever the code
    (EXIT_USAGE, 0, FailureCause.USAGE_ERROR, JobState.FAILED),
    (EXIT_CANNOT_EXECUTE, 0, FailureCause.LAUNCH_FAILED, JobState.FAILED),
    (EXIT_CHECKPOINT_UNREADABLE, 0, FailureCause.CHECKPOINT_UNREADABLE, JobState.RECOVERING),
])
def test_a_process_exit_ends_the_generation_and_spends_the_budget(exit_code, signal, cause, state) -> None:
    """A crash spends one restart of the budget; what fails the job at once spends none (none follows)."""
    actions = decide(job_world(resume_step=10, reports=(exited("b", 1, exit_code, signal),)))
    record = commit_of(actions).record
    assert (record.state, record.last_failure.cause, record.last_failure.node) == (state, cause, "b")
    spent = 0 if state is JobState.FAILED else 1
    assert (record.crash_restarts, record.consecutive_crashes, record.stopped_generation) == (spent, spent, 1)
    assert isinstance(actions[-1], StopGeneration)
    marked = [a for a in actions if isinstance(a, MarkCheckpointBad)]
    assert marked == ([MarkCheckpointBad(10, record.last_failure.message)]
                      if cause is FailureCause.CHECKPOINT_UNREADABLE else [])


def test_a_crash_is_counted_against_its_node_and_its_step() -> None:
    record = commit_of(decide(job_world(reports=(exited("b", 1, 1),)))).record
    assert record.node_failures == {"b": 1} and record.crash_steps == {11: 1}  # rank 1 had reported step 10


def test_a_failure_while_a_node_is_disconnected_waits_out_the_reconnect_grace() -> None:
    crashed = (exited("a", 0, 1),)  # a peer's collective broke when c went away
    assert decide(job_world(reports=crashed, disconnected=frozenset({"c"}))) == []
    assert commit_of(decide(job_world(reports=crashed))).record.state is JobState.RECOVERING


@pytest.mark.parametrize("silent_s, hangs", [(60.0, False), (60.5, True)])
def test_hang_after_hang_timeout_s_without_a_new_step(silent_s, hangs) -> None:
    actions = decide(job_world(seen={"last_progress_at": NOW - silent_s}))
    if not hangs:
        assert actions == []
        return
    record = commit_of(actions).record
    assert record.last_failure.cause is FailureCause.HANG and record.crash_restarts == 1


def test_a_rank_that_evaluates_between_steps_is_no_hang_until_it_falls_silent() -> None:
    world = job_world(seen={"last_progress_at": NOW - 60.5})  # a hang, but for what follows
    world.observation.record_progress(replace(progress(0, 10), evaluating=True), NOW - 1)  # Model.fit validates
    assert decide(world) == []
    assert world.observation.progress[0].step == 10  # no step came with it
    assert commit_of(decide(replace(world, now=NOW + 60))).record.last_failure.cause is FailureCause.HANG


def test_ranks_that_all_ended_their_training_are_no_hang_however_long_they_take_to_exit() -> None:
    world = job_world(seen={"last_progress_at": NOW - 600})
    for rank in (0, 1):  # a final evaluation or an export after the training loop
        world.observation.record_progress(replace(progress(rank, 10), training_finished=True), NOW - 599)
    assert commit_of(decide(world)).record.last_failure.cause is FailureCause.HANG  # rank 2 has not ended
    world.observation.record_progress(replace(progress(2, 10), training_finished=True), NOW - 599)
    assert decide(world) == []


def test_a_run_of_bad_batches_rolls_back_before_it_and_skips_it() -> None:
    bad = {s: SkippedBatch(s, (s - 1) * GLOBAL_BATCH, s * GLOBAL_BATCH, "grad_norm_spike", 2.0, 99.0)
           for s in (21, 22, 23)}
    world = job_world(spec={"data_skip": {"max_consecutive_spikes": 3}}, step=23, catalog=(10, 20, 30),
                      seen={"bad_batches": bad})
    actions = decide(world)
    assert actions[1] == AddSkip(20 * GLOBAL_BATCH, 23 * GLOBAL_BATCH, "rollback after 3 consecutive bad batches", 21)
    assert isinstance(actions[2], StopGeneration)
    record = commit_of(actions).record
    assert record.last_failure.cause is FailureCause.BAD_BATCHES and record.resume_from_step == 20
    world.observation.record_progress(ProgressReport(0, 24, 0.5, 1.0, 120.0, 24 * GLOBAL_BATCH), NOW)
    assert decide(world) == []  # step 24 went through: the run is over


def test_a_step_that_crashed_crash_repeats_times_is_skipped_past_the_ledger_ranges() -> None:
    actions = decide(job_world(record={"crash_steps": {11: 1, 7: 1}}, reports=(exited("b", 1, 1),),
                               skips=((125, 130),)))
    # Step 11's batch starts at sample 120; it holds 12 samples outside the ledger: 120-125 and 130-137.
    assert AddSkip(120, 137, "step 11 crashed a worker 2 times", 11) in actions
    assert commit_of(actions).record.crash_steps == {7: 1}


def test_a_crash_past_the_restart_budget_fails_the_job() -> None:
    actions = decide(job_world(record={"crash_restarts": 3}, reports=(exited("b", 1, 1),)))
    commit = commit_of(actions)
    assert commit.record.state is JobState.FAILED and commit.event == "job_failed"
    assert commit.message.endswith("(restart budget of 3 spent)") and commit.record.restarts == 0
    assert isinstance(actions[-1], StopGeneration)


def test_processes_their_own_agent_fenced_are_no_crash_of_the_node() -> None:
    """A coordinator down past the heartbeat timeout: every agent stopped its processes, and reports
    their SIGTERM once it reconnects. Not the node's crash, nor the job's own error on every rank."""
    fenced = RootCause("stopped by its agent: no coordinator answered for 5.1s (heartbeat timeout 5.0s)", "",
                       "fenced")
    reports = tuple(exited(node, rank, signal=15, cause=fenced) for rank, node in enumerate(NODES))
    actions = decide(job_world(record={"node_failures": {"a": 2}}, reports=reports))
    commit = commit_of(actions)
    assert commit.record.last_failure.cause is FailureCause.FENCED
    assert commit.message == ("job job is RECOVERING (fenced): node a stopped its processes of generation 1 itself: "
                              "stopped by its agent: no coordinator answered for 5.1s (heartbeat timeout 5.0s)")
    assert (commit.record.crash_restarts, commit.record.consecutive_crashes, commit.record.node_failures) == (
        0, 0, {"a": 2})  # no quarantine for the coordinator's outage


def test_the_crash_that_reaches_quarantine_after_says_so() -> None:
    commit = commit_of(decide(job_world(record={"node_failures": {"c": 2}}, reports=(exited("c", 2, 1),))))
    assert commit.message.endswith("; node c is quarantined after 3 crashes")


@pytest.mark.parametrize("asked, checkpoints, expected", [
    (None, set(), [RequestCheckpoint(30, "world size can grow from 2 to 3")]),  # 10 steps/s, 2 s ahead
    (CheckpointRequest(30, NOW - 29), {29}, []),  # an older checkpoint does not answer
    (CheckpointRequest(30, NOW - 30), set(), [RequestCheckpoint(30, "world size can grow from 2 to 3")]),
    (CheckpointRequest(30, NOW - 1), {30}, [
        CommitRecord(JobRecord(JobState.RECOVERING, 1, 2, restarts=1, stopped_generation=1), EventKind.RESHAPE_STARTED,
                     "job job is RECOVERING: world size can grow from 2 to 3; relaunching from the checkpoint "
                     "just saved", recovery="reshape"),
        StopGeneration("world size can grow from 2 to 3")]),
])
def test_a_joined_node_is_taken_in_at_the_checkpoint_asked_for(asked, checkpoints, expected) -> None:
    assert decide(job_world(on=("a", "b"), checkpoint_request=asked, seen={"checkpoints": checkpoints})) == expected


def test_a_drained_node_is_let_go_at_a_checkpoint() -> None:
    assert decide(job_world(offers=("a", "c"), drained=frozenset({"b"}))) == [
        RequestCheckpoint(30, "node b is drained")]


@pytest.mark.parametrize(("seen", "how"), [
    ({"failed_checkpoints": {30}}, "its save at step 30 failed"),  # a full disk: asking again would fail too
    ({"failed_checkpoints": {20}}, None),  # an older periodic save failed: the one asked for may not
])
def test_a_drained_node_is_let_go_when_the_checkpoint_asked_for_failed(seen, how) -> None:
    world = job_world(offers=("a", "c"), drained=frozenset({"b"}), checkpoint_request=CheckpointRequest(30, NOW - 1),
                      seen=seen)
    if how is None:
        assert decide(world) == []
        return
    actions = decide(world)
    assert commit_of(actions).message == f"job job is RECOVERING: node b is drained; relaunching now; {how}"
    assert actions[-1] == StopGeneration("node b is drained")


def test_a_generation_that_reported_no_step_yet_is_reshaped_without_a_checkpoint() -> None:
    """Nothing was trained that a checkpoint would keep: waiting for a step to save it would only delay."""
    actions = decide(job_world(on=("a", "b"), step=None))
    assert commit_of(actions).message == ("job job is RECOVERING: world size can grow from 2 to 3; relaunching now; "
                                          "it reported no step yet")


@pytest.mark.parametrize("later_step, requested", [(None, 10 + MIN_CHECKPOINT_LEAD_STEPS), (20, 40)])
def test_without_a_batch_split_the_checkpoint_lead_comes_from_the_step_rate(later_step, requested) -> None:
    world = job_world(spec=NO_BATCH, on=("a", "b"))
    if later_step is not None:
        for rank in (0, 1):
            world.observation.record_progress(progress(rank, later_step), NOW)  # 10 steps in 1 s
    assert decide(world) == [RequestCheckpoint(requested, "world size can grow from 2 to 3")]


@pytest.mark.parametrize(("step", "how"), [(10, "the script resumes from its own checkpoints"),  # from output
                                           (None, "it reported no step yet")])  # no progress at all
def test_a_script_job_without_graceful_exit_is_reshaped_at_once(step, how) -> None:
    actions = decide(job_world(on=("a", "b"), step=step, from_output=True))
    commit = commit_of(actions)
    assert commit.message == f"job job is RECOVERING: world size can grow from 2 to 3; relaunching now; {how}"
    assert (commit.record.stopped_generation, commit.record.crash_restarts, commit.recovery) == (1, 0, "reshape")
    assert actions[-1] == StopGeneration("world size can grow from 2 to 3")


def test_a_script_job_with_graceful_exit_is_asked_to_leave_and_its_clean_exits_end_the_generation() -> None:
    script = {"spec": {"graceful_exit_file": "exit.json"}, "on": ("a", "b"), "from_output": True}
    reason = "world size can grow from 2 to 3"
    commit, request = decide(job_world(**script))
    assert (commit.record.exit_requested_generation, commit.event, request) == (1, "exit_requested", RequestGracefulExit(reason))
    asked = ExitRequest(reason, NOW - 29)
    assert decide(job_world(**script, exit_request=asked)) == []
    left = (exited("a", 0), exited("b", 1))
    # Not COMPLETED, even once the node that was to join went away again.
    commit = commit_of(decide(job_world(**{**script, "offers": ("a", "b")}, exit_request=asked, reports=left)))
    assert (commit.record.state, commit.event, commit.record.crash_restarts) == (
        JobState.RECOVERING, "reshape_started", 0)
    assert commit.message.endswith("every rank left at the graceful exit; relaunching")
    late = commit_of(decide(job_world(**script, exit_request=ExitRequest(reason, NOW - 30))))
    assert late.message.endswith("the graceful exit did not end generation 1 within 30s; stopping it")


def test_trainerd_stopping_has_the_runtime_save_first_and_is_ready_once_the_asked_step_is_committed() -> None:
    assert decide(job_world(stopping=True)) == [RequestCheckpoint(30, STOPPING)]
    asked = CheckpointRequest(30, NOW - 1)
    assert decide(job_world(stopping=True, checkpoint_request=asked, seen={"checkpoints": {20}})) == []
    assert decide(job_world(stopping=True, checkpoint_request=asked, seen={"checkpoints": {30}})) == [
        ReadyToStop("generation 1 saved a checkpoint at step 30")]
    assert decide(job_world(stopping=True, checkpoint_request=asked, seen={"failed_checkpoints": {30}})) == [
        ReadyToStop("generation 1 stops without a checkpoint: its save at step 30 failed")]


def test_trainerd_stopping_launches_nothing() -> None:
    for state, on, stopped in ((JobState.PENDING, None, False), (JobState.RECOVERING, NODES, True)):
        *notes, ready = decide(job_world(state=state, on=on, stopped=stopped, stopping=True))
        assert ready == ReadyToStop(f"{state.value}, no running generation to save")
        assert all(isinstance(note, NotePlaceableSince) for note in notes)  # no launch


def test_trainerd_stopping_has_a_script_leave_through_its_graceful_exit_or_stops_it_as_it_is() -> None:
    script = {"on": ("a", "b"), "from_output": True, "stopping": True}
    commit, request = decide(job_world(spec={"graceful_exit_file": "exit.json"}, **script))
    assert (commit.event, request) == ("exit_requested", RequestGracefulExit(STOPPING))
    left = (exited("a", 0), exited("b", 1))
    *ended, ready = decide(job_world(spec={"graceful_exit_file": "exit.json"}, **script, reports=left,
                                     exit_request=ExitRequest(STOPPING, NOW - 1)))
    assert commit_of(ended).record.between_generations and ready == ReadyToStop(
        "every rank of generation 1 left at the graceful exit")
    assert decide(job_world(**script)) == [ReadyToStop(
        "generation 1 stops without a checkpoint: the script resumes from its own checkpoints")]


def test_a_generation_that_committed_a_checkpoint_uses_the_runtime_even_with_progress_from_output() -> None:
    world = job_world(spec={"graceful_exit_file": "exit.json"}, on=("a", "b"), from_output=True,
                      seen={"checkpoints": {10}})
    assert decide(world) == [RequestCheckpoint(30, "world size can grow from 2 to 3")]


def test_a_crash_in_native_code_on_every_rank_is_the_jobs_error_only_when_it_names_a_line_of_python() -> None:
    at_line = RootCause("Fatal Python error: Segmentation fault", "train.py:4", "fatal_error")
    nowhere = RootCause("Fatal Python error: Segmentation fault", "", "fatal_error")  # in a thread of C++ alone
    both = (exited("a", 0, signal=11, cause=at_line), exited("b", 1, signal=11, cause=at_line))
    suspected = commit_of(decide(job_world(step=None, reports=both))).record
    assert (suspected.state, suspected.last_failure.free_retry, suspected.crash_restarts) == (
        JobState.RECOVERING, True, 0)  # the job's own, unless it passes
    again = commit_of(decide(job_world(step=None, reports=both, record={"last_failure": suspected.last_failure})))
    assert (again.record.state, again.record.last_failure.cause) == (JobState.FAILED, FailureCause.JOB_ERROR)
    unknown = (exited("a", 0, signal=11, cause=nowhere), exited("b", 1, signal=11, cause=nowhere))
    crashed = commit_of(decide(job_world(step=None, reports=unknown))).record
    assert (crashed.state, crashed.last_failure.cause, crashed.last_failure.free_retry, crashed.crash_restarts) == (
        JobState.RECOVERING, FailureCause.PROCESS_EXITED, False, 1)


def test_a_failure_is_told_by_its_root_cause_line_when_there_is_one() -> None:
    assert exited("n0", 1, 1, cause=FILE_MISSING).describe() == (
        "rank 1 on node n0 exited with code 1: FileNotFoundError: [Errno 2] No such file or directory: 'data/x' "
        "(train.py:12)")
    assert exited("n0", 1, 1).describe() == "rank 1 on node n0 exited with code 1: boom"
    crashed = RootCause("Fatal Python error: Segmentation fault", "train.py:4", "fatal_error")
    assert exited("n0", 1, signal=11, cause=crashed).describe() == (
        "rank 1 on node n0 was killed by signal 11 (SIGSEGV): Fatal Python error: Segmentation fault (train.py:4)")
    cut_off = RootCause("epoch: 1 step: 3, loss is 0.5", "", "last_line")  # where it was cut off, not why
    assert exited("n0", 1, signal=11, cause=cut_off).describe() == "rank 1 on node n0 was killed by signal 11 (SIGSEGV)"


def test_the_first_failure_is_the_earliest_observed_and_its_peers_errors_do_not_replace_it() -> None:
    reports = (exited("c", 2, 1, cause=FILE_MISSING, at=NOW - 2), exited("a", 0, 1, cause=PEER_GONE, at=NOW - 1))
    failure = commit_of(decide(job_world(reports=reports))).record.last_failure
    assert (failure.rank, failure.node, failure.location) == (2, "c", "train.py:12")
    scheduler = ProcessReport("a", ProcessRole.SCHEDULER, -1, 99, False, 1, observed_at=NOW - 2)
    failure = commit_of(decide(job_world(reports=(scheduler, exited("c", 2, 1, at=NOW - 2))))).record.last_failure
    assert failure.rank == 2  # at the same moment, a worker's own failure explains more than the scheduler's


def test_an_exit_told_again_keeps_when_it_was_first_seen_and_its_root_cause() -> None:
    observation = GenerationObservation(1)
    observation.record_process(exited("a", 0, 1, at=NOW - 2))  # a heartbeat's summary
    observation.record_process(exited("a", 0, 1, cause=FILE_MISSING, at=NOW))  # the exit report
    observation.record_process(exited("a", 0, 1, at=NOW + 1))  # the next heartbeat
    [known] = observation.processes.values()
    assert (known.observed_at, known.cause) == (NOW - 2, FILE_MISSING)


def test_no_hang_is_judged_before_a_rank_showed_progress() -> None:
    assert decide(job_world(step=None, started_ago=1000)) == []  # silent for 1000 s, hang_timeout_s 60


@pytest.mark.parametrize("positions, behind", [
    ({0: (None, 12), 1: (None, 11), 2: (None, 11)}, "rank 1 on node b was behind at step 11"),
    ({0: (2, 5), 1: (2, 7), 2: (1, 40)}, "rank 2 on node c was behind at epoch 1 step 40"),
])
def test_a_hang_dumps_the_stacks_and_names_the_rank_behind(positions, behind) -> None:
    world = job_world(step=None)
    for rank, (epoch, step) in positions.items():
        world.observation.record_progress(progress(rank, step, epoch, from_output=epoch is not None), NOW - 61)
    actions = decide(world)
    message = f"no rank of generation 1 reported a new step for 61s (hang_timeout_s 60); {behind}"
    failure = commit_of(actions).record.last_failure
    assert (failure.cause, failure.message, failure.node) == (FailureCause.HANG, message, behind.split()[4])
    assert actions[-1] == StopGeneration(message, dump_stacks=True)
    # only steps read from output (an epoch given here) leave a long evaluation of the script's own unseen
    assert ("raise job.hang_timeout_s" in commit_of(actions).message) == ("epoch" in behind)


def test_a_frozen_rank_is_named_behind_though_its_peers_wait_at_the_same_step() -> None:
    """A SIGSTOPped (or kernel-stuck) rank and the ranks waiting for it in a collective all last
    reported the same step: the kernel state the agent reports singles out the frozen one."""
    world = job_world(step=None)
    for rank in (0, 1, 2):
        world.observation.record_progress(progress(rank, 30, epoch=2, from_output=True), NOW - 61)
        state = "T" if rank == 2 else "S"
        world.observation.record_process(ProcessReport("abc"[rank], ProcessRole.WORKER, rank, 100 + rank, True,
                                                       os_state=state))
    commit = commit_of(decide(world))
    failure = commit.record.last_failure
    assert failure.rank == 2 and failure.node == "c" and "hang_timeout_s looks the same" not in commit.message
    assert failure.message.endswith("rank 2 on node c was behind at epoch 2 step 30 "
                                    "(its process is stopped or stuck in the kernel)")


def test_progress_read_from_output_restarts_each_epoch_and_yields_to_the_runtime() -> None:
    observation = GenerationObservation(1)
    observation.record_progress(progress(0, 40, epoch=1, from_output=True), NOW - 10)
    observation.record_progress(progress(0, 1, epoch=2, from_output=True), NOW)  # a new epoch is progress
    assert observation.last_progress_at == NOW and not observation.uses_runtime
    observation.record_progress(progress(0, 100), NOW + 1)
    observation.record_progress(progress(0, 2, epoch=2, from_output=True), NOW + 2)
    assert observation.progress[0] == progress(0, 100) and observation.uses_runtime


@pytest.mark.parametrize("started_ago, reports, running", [
    (59.9, (), False),
    (60.0, (), True),
    (60.0, (exited("c", 2),), False),  # not every process runs
])
def test_a_generation_without_progress_is_running_once_every_process_ran_for_the_window(
        started_ago, reports, running) -> None:
    actions = decide(job_world(state=JobState.RECOVERING, step=None, started_ago=started_ago, reports=reports))
    if not running:
        assert actions == []
        return
    [commit] = actions
    assert commit.record.state is JobState.RUNNING and commit.message == (
        "job job is RUNNING: every process of generation 1 has run for 60s (no rank reported a step)")


def test_every_rank_failing_the_same_way_before_any_progress_is_relaunched_once_without_spending_the_budget() -> None:
    same = tuple(exited(n, r, 1, cause=FILE_MISSING, at=NOW - 1) for r, n in enumerate(NODES))
    actions = decide(job_world(state=JobState.PENDING, step=None, reports=same, record={"node_failures": {"a": 2}}))
    commit = commit_of(actions)
    failure = commit.record.last_failure
    assert commit.record.state is JobState.RECOVERING and failure.cause is FailureCause.PROCESS_EXITED
    assert (failure.location, failure.same_error_ranks, failure.free_retry) == ("train.py:12", (0, 1, 2), True)
    assert (commit.record.crash_restarts, commit.record.consecutive_crashes, commit.record.node_failures,
            commit.record.restarts) == (0, 0, {"a": 2}, 1)
    assert commit.message == (
        "job job is RECOVERING (process_exited): rank 0 on node a exited with code 1: FileNotFoundError: [Errno 2] "
        "No such file or directory: 'data/x' (train.py:12); ranks 0, 1, 2 failed the same way before any progress; "
        "the job's own error, not a node's, unless it passes: relaunching once without spending the restart budget "
        "(if it ends the next generation too, the job fails)")
    assert isinstance(actions[-1], StopGeneration)


@pytest.mark.parametrize("before", [
    Failure(FailureCause.PROCESS_EXITED, "", "a", 0, 1, location="train.py:12", error=FILE_MISSING.message,
            same_error_ranks=(0, 1, 2), error_kind="python_exception", free_retry=True),
    # resumed by the operator after it failed the job: not fixed
    Failure(FailureCause.JOB_ERROR, "", "a", 0, 1, location="train.py:12", error=FILE_MISSING.message,
            error_kind="python_exception"),
])
def test_the_same_error_on_every_rank_in_the_next_generation_fails_the_job(before: Failure) -> None:
    same = tuple(exited(n, r, 1, cause=FILE_MISSING, at=NOW - 1) for r, n in enumerate(NODES))
    actions = decide(job_world(state=JobState.RECOVERING, step=None, reports=same,
                               record={"last_failure": before, "crash_restarts": 1}))
    commit = commit_of(actions)
    assert commit.record.state is JobState.FAILED and commit.record.last_failure.cause is FailureCause.JOB_ERROR
    assert commit.record.crash_restarts == 1
    assert commit.message == (
        "job job is FAILED: rank 0 on node a exited with code 1: FileNotFoundError: [Errno 2] No such file or "
        "directory: 'data/x' (train.py:12); ranks 0, 1, 2 failed the same way before any progress, as when the "
        "generation before ended (the job itself fails: fix it, then trainerctl resume)")
    assert isinstance(actions[-1], StopGeneration)


@pytest.mark.parametrize("cause, fails", [
    (RootCause("SyntaxError: invalid syntax", "train.py:3", "python_exception"), True),
    (RootCause("IndentationError: unexpected indent", "model.py:40", "python_exception"), True),
    (RootCause("ModuleNotFoundError: No module named 'tokenizers'", "train.py:1", "python_exception"), True),
    (RootCause("ImportError: cannot import name 'Dense' from 'mindspore.nn'", "/home/alice/job/train.py:2",
               "python_exception"), True),
    # raised in a library: the node's install may be broken, and another may not be
    (RootCause("ImportError: libgomp.so.1: cannot open shared object file",
               "/opt/venv/lib/python3.11/site-packages/mindspore/__init__.py:17", "python_exception"), False),
    (RootCause("SyntaxError: invalid syntax", "", "last_line"), False),  # no traceback: not the job's code for sure
    (FILE_MISSING, False),
])
def test_an_error_no_relaunch_can_pass_fails_the_job_at_once(cause: RootCause, fails: bool) -> None:
    same = tuple(exited(n, r, 1, cause=cause, at=NOW - 1) for r, n in enumerate(NODES))
    record = commit_of(decide(job_world(state=JobState.PENDING, step=None, reports=same))).record
    expected = (JobState.FAILED, FailureCause.JOB_ERROR, False) if fails else \
        (JobState.RECOVERING, FailureCause.PROCESS_EXITED, True)
    assert (record.state, record.last_failure.cause, record.last_failure.free_retry) == expected
    assert record.crash_restarts == 0


@pytest.mark.parametrize("rank_0, ago, outcome", [
    (None, 4.9, "wait"),  # the others may still fail the same way
    (None, 5.0, FailureCause.PROCESS_EXITED),  # rank 1 failed alone: a crash
    (FILE_MISSING, 4.9, "wait"),  # rank 2 still runs
    (FILE_MISSING, 5.0, "same error"),  # two ranks, the same error: the job's own, unless it passes
    (PEER_GONE, 5.0, FailureCause.PROCESS_EXITED),  # they failed differently
    ("killed", 5.0, FailureCause.PROCESS_EXITED),
])
def test_a_start_up_failure_waits_the_settle_window_to_tell_a_job_error_from_a_crash(rank_0, ago, outcome) -> None:
    reports = [exited("b", 1, 1, cause=FILE_MISSING, at=NOW - ago)]
    if rank_0 == "killed":
        reports.append(exited("a", 0, signal=9, at=NOW - 1))
    elif rank_0 is not None:
        reports.append(exited("a", 0, 1, cause=rank_0, at=NOW - 1))
    actions = decide(job_world(state=JobState.PENDING, step=None, reports=tuple(reports)))
    if outcome == "wait":
        assert actions == []
        # Nor is a RUNNING generation reshaped meanwhile (a node joined): the failure comes first.
        assert decide(job_world(step=None, on=("a", "b", "c"), offers=NODES + ("d",), spec={"max_nodes": 4},
                                reports=tuple(reports))) == []
        return
    failure = commit_of(actions).record.last_failure
    assert (failure.cause, failure.rank, failure.free_retry) == (
        FailureCause.PROCESS_EXITED, 1, True) if outcome == "same error" else (outcome, 1, False)


def test_a_single_rank_failing_before_any_progress_is_a_suspected_job_error_and_with_progress_a_crash() -> None:
    alone = (exited("a", 0, 1, cause=FILE_MISSING, at=NOW),)
    record = commit_of(decide(job_world(on=("a",), offers=("a",), step=None, reports=alone))).record
    assert (record.last_failure.cause, record.last_failure.free_retry, record.crash_restarts) == (
        FailureCause.PROCESS_EXITED, True, 0)
    again = commit_of(decide(job_world(on=("a",), offers=("a",), step=None, reports=alone,
                                       record={"last_failure": record.last_failure}))).record
    assert again.last_failure.cause is FailureCause.JOB_ERROR
    everyone = tuple(exited(n, r, 1, cause=FILE_MISSING, at=NOW) for r, n in enumerate(NODES))
    assert commit_of(decide(job_world(reports=everyone))).record.last_failure.cause is FailureCause.PROCESS_EXITED


# What the ranks that waited for a peer in a collective print, as the agent reads them: MindSpore's exception
# (its "- Kernel error:" section), or its ring's own error line.
KERNEL_FAILED = RootCause("RuntimeError: Launch kernel failed: Default/AllReduce-op28", "train.py:24",
                          "python_exception")
RING_WAIT = RootCause("Reduce wait receiving [const pair] failed.",
                      "mindspore/ccsrc/cluster/rpc/core/collective_ops_impl.cc:201", "mindspore_error")


@pytest.mark.parametrize("cause", [KERNEL_FAILED, RING_WAIT])
def test_ranks_timed_out_waiting_in_a_collective_are_no_job_error_and_the_rank_that_never_came_is_named(cause) -> None:
    # A host came back cold: its rank 2 is slow to reach the first collective, ranks 0 and 1 give up on it.
    waited = (exited("a", 0, 1, cause=cause, at=NOW - 5), exited("b", 1, 1, cause=cause, at=NOW - 5))
    record = commit_of(decide(job_world(state=JobState.RECOVERING, step=None, reports=waited))).record
    failure = record.last_failure
    assert (record.state, failure.cause, failure.free_retry) == (JobState.RECOVERING, FailureCause.PROCESS_EXITED,
                                                                 False)
    assert (failure.node, failure.rank, failure.exit_code, failure.same_error_ranks) == ("c", 2, 0, ())
    assert failure.message == (f"rank 2 on node c reached no collective, and ranks 0, 1 failed waiting: rank 0 on "
                               f"node a exited with code 1: {cause.line}")
    assert (record.crash_restarts, record.node_failures) == (1, {})
    # The same again in the next generation is no proof of the job's error either.
    again = commit_of(decide(job_world(state=JobState.RECOVERING, step=None, reports=waited,
                                       record={"last_failure": failure, "crash_restarts": 1}))).record
    assert (again.state, again.last_failure.cause, again.crash_restarts) == (
        JobState.RECOVERING, FailureCause.PROCESS_EXITED, 2)


def test_a_rank_timed_out_waiting_mid_training_blames_neither_its_node_nor_its_step() -> None:
    waited = (exited("a", 0, 1, cause=KERNEL_FAILED, at=NOW - 1),)
    record = commit_of(decide(job_world(reports=waited))).record
    failure = record.last_failure
    assert (failure.node, failure.rank) == ("b", 1)
    assert failure.message.startswith("rank 1 on node b and rank 2 on node c did not reach the collective, and "
                                      "rank 0 failed waiting: rank 0 on node a exited with code 1: RuntimeError:")
    assert (record.crash_restarts, record.node_failures, record.crash_steps) == (1, {}, {})


def test_every_rank_failing_in_a_collective_is_a_crash_of_no_node() -> None:
    everyone = tuple(exited(n, r, 1, cause=PEER_GONE, at=NOW - 1) for r, n in enumerate(NODES))
    record = commit_of(decide(job_world(on=("a", "b"), offers=("a", "b"), reports=everyone[:2]))).record
    assert (record.state, record.last_failure.rank, record.last_failure.same_error_ranks) == (JobState.RECOVERING, 0,
                                                                                             ())
    assert record.last_failure.message.endswith("every rank failed in a collective: a link between the nodes, not "
                                                "the job")
    assert (record.crash_restarts, record.node_failures, record.crash_steps) == (1, {}, {})


def test_a_scheduler_that_lost_a_node_alone_names_no_rank_that_never_came() -> None:
    lost = RootCause("RuntimeError: The total number of timed out node is 1. Timed out node list is: [const "
                     "vector]{1}", "scheduler.py:30", "python_exception")
    scheduler = ProcessReport("a", ProcessRole.SCHEDULER, -1, 99, False, 1, cause=lost, observed_at=NOW - 1)
    failure = commit_of(decide(job_world(reports=(scheduler,)))).record.last_failure
    assert (failure.rank, failure.node, failure.message) == (-1, "a", f"scheduler on node a exited with code 1: "
                                                                      f"{lost.line}")


def test_a_peers_own_error_told_after_the_collectives_it_broke_is_the_failure() -> None:
    reports = (exited("a", 0, 1, cause=PEER_GONE, at=NOW - 2), exited("c", 2, 1, cause=FILE_MISSING, at=NOW - 1.5))
    record = commit_of(decide(job_world(reports=reports))).record
    assert (record.last_failure.rank, record.last_failure.location, record.node_failures) == (2, "train.py:12",
                                                                                              {"c": 1})


def test_the_ranks_that_waited_do_not_hide_the_same_error_of_the_others_before_any_progress() -> None:
    reports = (exited("a", 0, 1, cause=FILE_MISSING, at=NOW - 5), exited("b", 1, 1, cause=FILE_MISSING, at=NOW - 5),
               exited("c", 2, 1, cause=RING_WAIT, at=NOW - 4))
    failure = commit_of(decide(job_world(step=None, reports=reports))).record.last_failure
    assert (failure.cause, failure.same_error_ranks, failure.free_retry) == (FailureCause.PROCESS_EXITED, (0, 1),
                                                                             True)


def test_a_free_retry_is_given_once_in_a_row() -> None:
    before = Failure(FailureCause.PROCESS_EXITED, "", "a", 0, 1, location="train.py:36", error="ValueError: x",
                     same_error_ranks=(0, 1, 2), error_kind="python_exception", free_retry=True)
    same = tuple(exited(n, r, 1, cause=FILE_MISSING, at=NOW - 1) for r, n in enumerate(NODES))
    record = commit_of(decide(job_world(step=None, reports=same, record={"last_failure": before}))).record
    assert (record.state, record.last_failure.free_retry, record.crash_restarts) == (JobState.RECOVERING, False, 1)
    mid_training = commit_of(decide(job_world(reports=same, record={"last_failure": before}))).record
    assert (mid_training.last_failure.free_retry, mid_training.crash_restarts) == (False, 1)
    first = commit_of(decide(job_world(reports=same))).record
    assert (first.last_failure.free_retry, first.crash_restarts) == (True, 0)


@pytest.mark.parametrize("on, failed, counted", [
    (NODES, (("c", 2),), {"c": 1}),
    (NODES, (("b", 1), ("c", 2)), {}),  # two nodes: neither is singled out
    (("a",), (("a", 0),), {}),  # a one-node generation has nothing to compare with
])
def test_a_crash_counts_against_a_node_only_when_it_singles_the_node_out(on, failed, counted) -> None:
    reports = tuple(exited(node, rank, 1) for node, rank in failed)
    record = commit_of(decide(job_world(on=on, offers=on, reports=reports))).record
    assert record.node_failures == counted and record.crash_restarts == 1


def test_a_crash_at_a_step_read_from_output_counts_no_crash_step() -> None:
    record = commit_of(decide(job_world(from_output=True, reports=(exited("b", 1, 1),)))).record
    assert record.crash_steps == {} and record.crash_restarts == 1


def test_without_a_batch_split_a_repeatedly_crashing_step_is_not_skipped_and_the_event_says_so() -> None:
    actions = decide(job_world(spec=NO_BATCH, record={"crash_steps": {11: 1}}, reports=(exited("b", 1, 1),)))
    assert [a for a in actions if isinstance(a, AddSkip)] == []
    commit = commit_of(actions)
    assert commit.message.endswith("; step 11 crashed a worker 2 times, but without global_batch its samples are "
                                   "unknown: nothing is skipped")
    assert commit.record.crash_steps == {}


# ---------------------------------------------------------------- between generations

@pytest.mark.parametrize("confirmed, ago, expected", [
    (("a", "b"), 6.9, "wait"),  # c may still answer within stop_grace_s + 2 s
    (NODES, 6.9, ["a", "b", "c"]),
    (("a", "b"), 7.0, ["a", "b"]),  # c is left out, and the stop phase ends now
])
def test_the_next_generation_waits_for_every_stop_or_the_stop_grace(confirmed, ago, expected) -> None:
    seen = {"stopped": set(confirmed), "stop_sent": {n: NOW - ago for n in NODES}, "stop_decided_at": NOW - ago,
            "all_stopped_at": NOW - ago if confirmed == NODES else None}
    actions = decide(job_world(state=JobState.RECOVERING, stopped=True, seen=seen))
    if expected == "wait":
        assert actions == []
        return
    notes = [] if confirmed == NODES else [EndStopPhase(NOW)]
    assert actions[:-1] == notes
    launch = actions[-1]
    assert launch.placement.nodes == expected and launch.checkpoint == _checkpoint(10)
    assert launch.record == JobRecord(JobState.RECOVERING, 2, len(expected), stopped_generation=1)


def test_a_node_not_told_to_stop_yet_is_told_first() -> None:
    seen = {"stopped": set(), "stop_sent": {"a": NOW}, "stop_decided_at": NOW, "all_stopped_at": None}
    assert decide(job_world(state=JobState.RECOVERING, stopped=True, seen=seen)) == [
        StopGeneration("generation 1 is over")]


@pytest.mark.parametrize("stopped_ago, launches", [(1.9, False), (2.0, True)])
def test_the_crash_backoff_counts_from_the_end_of_the_stop_phase(stopped_ago, launches) -> None:
    actions = decide(job_world(state=JobState.RECOVERING, stopped=True, record={"consecutive_crashes": 2},
                               seen={"all_stopped_at": NOW - stopped_ago}))  # 2 crashes: 1 s doubled
    assert [type(a) for a in actions] == ([LaunchGeneration] if launches else [])


def test_a_committed_checkpoint_resets_the_crash_backoff() -> None:
    record = JobRecord(JobState.RUNNING, 2, 3, consecutive_crashes=2)
    assert record_after_checkpoint(record) == replace(record, consecutive_crashes=0)
    assert record_after_checkpoint(replace(record, consecutive_crashes=0)) is None


@pytest.mark.parametrize("min_nodes, nodes", [(1, ["a", "b"]), (3, ["a", "b", "c"])])
def test_a_quarantined_node_is_left_out_unless_the_job_cannot_run_without_it(min_nodes, nodes) -> None:
    [launch] = decide(job_world(spec={"min_nodes": min_nodes}, state=JobState.RECOVERING, stopped=True,
                                record={"node_failures": {"c": 3}}))
    assert launch.placement.nodes == nodes


def test_waiting_while_fewer_than_min_nodes_are_ready() -> None:
    world = job_world(spec={"min_nodes": 2}, state=JobState.RECOVERING, on=("a", "b"), offers=("a",), stopped=True)
    [commit] = decide(world)
    assert commit.record.state is JobState.WAITING and commit.event == "job_waiting"
    assert commit.message == ("job job is WAITING: 1 usable node(s) with 1 device(s); it needs at least 2 "
                              "node(s) and a world size of 2 or 3")
    assert decide(replace(world, record=commit.record)) == []


@pytest.mark.parametrize("catalog, resume_from_step, outcome", [
    ((10, 20), None, 20),  # the newest good one
    ((10, 20), 10, 10),  # the operator's choice
    ((replace(_checkpoint(10), problem="digest mismatch"), 20), None, 20),
    ((), None, None),  # nothing saved: from scratch
    ((replace(_checkpoint(10), problem="digest mismatch"),), None, "failed"),  # never silently from step 0
])
def test_the_relaunch_starts_from_the_newest_good_checkpoint(catalog, resume_from_step, outcome) -> None:
    [action] = decide(job_world(state=JobState.RECOVERING, stopped=True, catalog=catalog,
                                record={"resume_from_step": resume_from_step}))
    if outcome == "failed":
        assert action.record.state is JobState.FAILED
        assert action.record.last_failure.cause is FailureCause.CHECKPOINT_UNREADABLE
        return
    assert (None if action.checkpoint is None else action.checkpoint.step) == outcome
    assert action.record.resume_from_step is None


def _held(step: int) -> MemorySnapshot:
    return MemorySnapshot(step, step * GLOBAL_BATCH)


@pytest.mark.parametrize("held, changes, outcome", [
    ({n: _held(25) for n in NODES}, {}, "memory"),  # newer than the newest checkpoint, on every node
    ({n: _held(15) for n in NODES}, {}, 20),  # older than the newest checkpoint
    ({"a": _held(25), "b": _held(25)}, {}, 20),  # node c holds none: its ranks would find nothing
    ({"a": _held(25), "b": _held(25), "c": _held(30)}, {}, 20),  # the nodes disagree
    ({n: _held(25) for n in NODES}, {"record": {"resume_from_step": 10}}, 10),  # the operator's choice
    ({n: _held(25) for n in NODES}, {"bad_memory_steps": frozenset({25})}, 20),  # it failed to load before
    ({n: _held(25) for n in NODES}, {"record": {"last_failure": Failure(FailureCause.BAD_BATCHES, "spikes")}},
     20),  # a rollback must go back before the bad steps
])
def test_the_relaunch_prefers_a_newer_in_memory_snapshot_every_node_holds(held, changes, outcome) -> None:
    changes = dict(changes)
    record = changes.pop("record", {})
    [action] = decide(job_world(state=JobState.RECOVERING, stopped=True, catalog=(10, 20), seen={
        "memory_snapshots": held}, record=record, **changes))
    assert isinstance(action, LaunchGeneration)
    if outcome == "memory":
        assert action.checkpoint == _held(25)
    else:
        assert isinstance(action.checkpoint, CheckpointEntry) and action.checkpoint.step == outcome


def test_a_snapshot_on_a_lost_host_is_not_chosen() -> None:
    """Node a, which held the snapshot, is gone: the relaunch on b starts from the newest checkpoint."""
    [action] = decide(job_world(spec={"max_nodes": 1}, state=JobState.RECOVERING, stopped=True, on=("a",),
                                offers=("b",), catalog=(10,), seen={"memory_snapshots": {"a": _held(17)}}))
    assert action.placement.nodes == ["b"] and action.checkpoint == _checkpoint(10)


@pytest.mark.parametrize("seen, facts, outcome", [
    ({"stop_sent": {"a": NOW - 6.9}}, {}, "wait"),  # its processes exited; its confirmation may name a newer one
    ({"stop_sent": {"a": NOW - 7}}, {}, 17),  # the stop patience passed: the heartbeat's snapshot
    ({"stop_sent": {"a": NOW - 1}, "stopped": {"a"}, "memory_snapshots": {"a": _held(19)}}, {}, 19),  # confirmed
    ({"stop_sent": {"a": NOW - 1}, "memory_snapshots": {}}, {}, 10),  # it holds none: nothing to wait for
    ({"stop_sent": {}, "stop_decided_at": NOW - 1}, {}, "resend"),  # its Stop never went out: sent now,
    # waited for from the stop's decision
    ({"stop_sent": {}, "stop_decided_at": NOW - 7}, {}, 17),  # (sent again, and the relaunch goes on)
    # Disconnected, it can neither confirm nor be placed: the relaunch goes on b, from the checkpoint.
    ({"stop_sent": {"a": NOW - 1}}, {"disconnected": frozenset({"a"}), "offers": ("b",)}, 10),
    ({"stop_sent": {"a": NOW - 1}}, {"lost_nodes": frozenset({"a"}), "offers": ("b",)}, 10),  # lost: holds nothing
])
def test_the_relaunch_waits_for_the_stop_confirmation_of_a_node_holding_a_snapshot(seen, facts, outcome) -> None:
    """Node a's processes all exited (their reports came first), its last heartbeat named the snapshot of
    step 17; its confirmation names its newest, which the relaunch waits for, for the stop patience
    (stop_grace_s 5 + 2 s) from when its Stop went out."""
    actions = decide(job_world(
        spec={"max_nodes": 1}, state=JobState.RECOVERING, stopped=True, on=("a",), catalog=(10,),
        reports=(exited("a", 0, signal=9),), seen={"stopped": set(), "memory_snapshots": {"a": _held(17)}, **seen},
        **facts))
    if outcome in ("wait", "resend"):
        assert actions == ([StopGeneration("generation 1 is over")] if outcome == "resend" else [])
        return
    [launch] = [a for a in actions if isinstance(a, LaunchGeneration)]
    assert launch.checkpoint is not None and launch.checkpoint.step == outcome


def test_a_snapshot_that_failed_to_load_is_remembered_while_it_could_be_chosen() -> None:
    """Only a snapshot newer than the newest good checkpoint is ever chosen, and an agent holds only its
    newest few: the controller keeps the newest REMEMBERED_BAD_MEMORY_STEPS failures above that checkpoint."""
    catalog = (_checkpoint(10), _checkpoint(20), replace(_checkpoint(30), problem="digest mismatch"))
    assert bad_memory_steps_after(frozenset({15, 20, 25}), 27, catalog) == {25, 27}
    assert bad_memory_steps_after(frozenset(), 5, catalog) == {5}  # the one that failed, whatever its step
    many = frozenset(range(21, 21 + 3 * REMEMBERED_BAD_MEMORY_STEPS))
    kept = bad_memory_steps_after(many, 100, catalog)
    assert len(kept) == REMEMBERED_BAD_MEMORY_STEPS and 100 in kept
    assert kept - {100} == set(sorted(many)[-(REMEMBERED_BAD_MEMORY_STEPS - 1):])


# ---------------------------------------------------------------- a job that is not active

def test_a_paused_job_stops_what_still_runs_once() -> None:
    unsent = {"stopped": set(), "stop_sent": {}, "stop_decided_at": NOW, "all_stopped_at": None}
    assert decide(job_world(state=JobState.PAUSED, stopped=True, seen=unsent)) == [StopGeneration("job is PAUSED")]
    told = {**unsent, "stop_sent": {n: NOW for n in NODES}}
    assert decide(job_world(state=JobState.PAUSED, stopped=True, seen=told)) == []


def test_a_killed_process_is_not_explained_by_the_line_it_was_cut_off_at() -> None:
    info_line = RootCause("INFO trainer: step 1 loss 2.26", "", "last_line")
    exception = RootCause("ValueError: bad value at step 7", "train.py:95", "python_exception")
    killed = replace(exited("b", 1, signal=9), cause=info_line)
    assert killed.describe() == "rank 1 on node b was killed by signal 9 (SIGKILL)"
    assert replace(killed, cause=exception).describe() == ("rank 1 on node b was killed by signal 9 (SIGKILL): "
                                                           "ValueError: bad value at step 7 (train.py:95)")
    assert replace(exited("b", 1, exit_code=3), cause=info_line).describe() == \
        "rank 1 on node b exited with code 3: INFO trainer: step 1 loss 2.26"


def test_a_job_skipping_more_than_its_share_of_the_data_as_bad_fails_saying_so() -> None:
    """Once 20 ranges were found bad, more than data_skip.max_skipped_fraction of the samples got through
    skipped means the data, the model or a device is broken: the job fails rather than skip on."""
    bad = tuple((s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH) for s in range(100, 120))  # 20 batches
    at_step_1000 = dict(step=1000, found_bad=bad, skips=bad)  # 2% of the 1000 batches got through
    assert not [a for a in decide(job_world(**at_step_1000)) if isinstance(a, (CommitRecord, StopGeneration))]

    actions = decide(job_world(**at_step_1000, spec={"data_skip": {"max_skipped_fraction": 0.01}}))
    commit = commit_of(actions)
    assert commit.record.state is JobState.FAILED and commit.record.last_failure.cause is FailureCause.BAD_DATA
    assert commit.record.crash_restarts == 0  # permanent: nothing is relaunched
    assert commit.record.last_failure.message == (
        "240 of the 12000 samples trained on so far were skipped as bad, in 20 ranges: more than "
        "data_skip.max_skipped_fraction (0.01); the data, the model or a device is broken, not a batch")
    assert any(isinstance(a, StopGeneration) for a in actions)

    strict = {"data_skip": {"max_skipped_fraction": 0.01}}
    assert not [a for a in decide(job_world(step=1000, found_bad=bad[:19], skips=bad[:19], spec=strict))
                if isinstance(a, CommitRecord)]  # 19 ranges: too few to judge by
    assert not [a for a in decide(job_world(step=1000, skips=bad, spec=strict))
                if isinstance(a, CommitRecord)]  # an operator's own entries are no sign of broken data
    ahead = tuple((s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH) for s in range(2000, 2020))
    assert not [a for a in decide(job_world(step=1000, found_bad=bad[:10] + ahead, skips=bad[:10] + ahead,
                                            spec={"data_skip": {"max_skipped_fraction": 0.011}}))
                if isinstance(a, CommitRecord)]  # samples not yet reached count for nothing
