"""The job's reconcile decision: a pure function of (desired, observed, now) -> actions.

The controller (daemon/job/controller.py) gathers the inputs, calls `decide` on every pass and on
every report, and applies the actions in order, idempotently. Nothing here does I/O or reads a
clock, so every transition is tested with plain values (tests/daemon/test_decide.py). What the
controller keeps from one pass to the next (since when the first generation could be placed, when
a stop phase ended) is derived here too and handed back as actions it merely records.

A job's life, in the terms of the durable record (daemon/job/state.py):
- no generation yet: launch the first once enough nodes are READY (PENDING);
- a live generation (`record.generation > record.stopped_generation`): watch it. It is RUNNING once
  every rank reported a step, or every process ran for RUNNING_WITHOUT_PROGRESS_S (a script that
  prints nothing trainerd reads). It completes, or fails (a process exits, a node is lost, no new
  step for its hang allowance once a rank showed progress: hang_allowance.py). A failure is the job's
  own error only when it cannot be the cluster's, and is proven, not guessed: the ranks failing the same way end two
  generations in a row (the first is relaunched without spending the restart budget), unless the error
  is one no relaunch can pass (a SyntaxError or an ImportError in the job's code). A collective or a
  connection that failed never is: the ranks that waited in it are not blamed, and the ranks that never
  reached it are named. Or it is reshaped (a node to take in, or a drained node to let
  go): at a checkpoint it asks for when the generation runs trainerd's runtime, else through the
  script's graceful exit, else at once. The stop is committed first (`stopped_generation`), then sent;
- between generations: wait until every node confirmed the stop (or the stop grace passed: the
  silent ones are left out; a node whose processes all exited counts as stopped, but one holding an
  in-memory snapshot is waited for as long, since its confirmation names its newest snapshot), wait
  out the crash backoff, then launch the next generation on the largest valid world, from the
  newest good checkpoint (or a newer in-memory snapshot every node of the new placement holds);
  WAITING while no valid world exists.

When trainerd stops and takes its local agents, and the processes they run, with it (`stopping`), a
RUNNING generation saves first, as for a reshape, and nothing new is launched; ReadyToStop tells the
controller when the stop may go ahead.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from daemon.config import JobSettings
from daemon.events import EventKind
from daemon.job.catalog import CheckpointEntry
from daemon.job.hang_allowance import hang_allowance
from daemon.job.observation import DEVICE_SUSPICION_WINDOW_S, GenerationObservation, MemorySnapshot, ProcessReport
from daemon.job.placement import NodeOffer, Placement, place, place_keeping_spares, place_replacing_lost
from daemon.job.state import Failure, FailureCause, GenerationRecord, JobRecord, SnapshotHolder
from proto.exit_codes import EXIT_CANNOT_EXECUTE, EXIT_CHECKPOINT_UNREADABLE, EXIT_USAGE
from proto.vocabulary import CauseKind, JobState, ProcessRole

# After the stop grace the agents had to SIGKILL; this much more is allowed for their answer.
STOP_CONFIRM_MARGIN_S = 2.0
# A job is judged by the share of its samples skipped only once it has skipped this many ranges: a
# rollback early in a run covers many samples at once and is no sign of broken data.
MIN_RANGES_FOR_FRACTION = 20
# A requested checkpoint is placed this far ahead of the fastest rank, so that every rank reads the
# request before it passes that step.
CHECKPOINT_LEAD_S = 2.0
MIN_CHECKPOINT_LEAD_STEPS = 2
# A request no checkpoint answered (a rank read it too late) is made again after this long.
CHECKPOINT_REQUEST_RETRY_S = 30.0
# A generation whose processes have all run this long is RUNNING although not every rank reported a
# step (a script that prints nothing trainerd can read would otherwise never be).
RUNNING_WITHOUT_PROGRESS_S = 60.0
# After a failure before any progress, wait this long (or until every worker exited) to see whether
# the other ranks fail the same way: then the job itself is broken.
STARTUP_FAILURE_SETTLE_S = 5.0
# After an error a worker printed (an exception, not a signal) once progress was seen, wait this long (or
# until every worker exited) for the ranks that hit the same line: data-parallel ranks run in step, so
# theirs come milliseconds later, and an error every rank raised is the job's code, not a node's.
ERROR_SETTLE_S = 1.0
# A graceful exit asked for a reshape that has not ended the generation after this long: stop it.
GRACEFUL_EXIT_TIMEOUT_S = 30.0
# A pause waits this long for the generation's checkpoint (or graceful exit) before it stops it as it is:
# long enough for a large model's save, short enough for an operator who wants the hosts.
PAUSE_SAVE_WAIT_S = 120.0
# Why a generation saves (or leaves) when trainerd stops with its local agents.
STOPPING = "trainerd is stopping, and its local agents with it"
# In-memory snapshots that failed to load: at most this many are remembered (bad_memory_steps_after).
REMEMBERED_BAD_MEMORY_STEPS = 8


@dataclass(frozen=True)
class CommitRecord:
    """Write the job record (fenced); `event` names the event to append with `message`.
    `recovery` names the cause when the write starts a recovery (its phases are timed from here)."""

    record: JobRecord
    event: EventKind
    message: str
    recovery: str | None = None


@dataclass(frozen=True)
class StopGeneration:
    """Send Stop for the current generation to every node not yet told (its stop is committed)."""

    reason: str
    dump_stacks: bool = False  # a hang: every process's Python stack goes into its log before the kill
    job_completed: bool = False  # the job is COMPLETED: the agents drop its in-memory snapshots


@dataclass(frozen=True)
class LaunchGeneration:
    """Write the generation, then `record` (which names it), then send Launch to its nodes."""

    placement: Placement
    checkpoint: CheckpointEntry | MemorySnapshot | None  # None: from scratch
    record: JobRecord
    # The SnapshotPeer address of each node of `placement` that serves one (GenerationRecord.peer_addresses).
    peer_addresses: dict[str, str] = field(default_factory=dict, hash=False)
    # Why the generation does not resume from an in-memory snapshot newer than its checkpoint ("": none was).
    memory_shortfall: str = ""


@dataclass(frozen=True)
class RequestCheckpoint:
    """Ask every rank of the current generation for a checkpoint once `step` completes."""

    step: int
    reason: str


@dataclass(frozen=True)
class RequestGracefulExit:
    """Ask every rank of the current generation to leave at its next step boundary through the
    script's own graceful exit (job.graceful_exit_file), to reshape the job; the request is
    committed first (JobRecord.exit_requested_generation)."""

    reason: str


@dataclass(frozen=True)
class ReadyToStop:
    """trainerd may stop now (`JobWorld.stopping`): the generation saved, or left through the script's
    graceful exit, or nothing runs that could."""

    how: str


@dataclass(frozen=True)
class MarkCheckpointBad:
    step: int
    problem: str


@dataclass(frozen=True)
class AddSkip:
    """Add a sample range to the skip ledger (before the relaunch that must leave it out)."""

    start: int
    end: int
    reason: str
    step: int


@dataclass(frozen=True)
class NotePlaceableSince:
    """Remember for the next pass since when the nodes on offer could hold the first generation
    (None: they cannot, or it was launched); start_wait_s counts from there."""

    since: float | None


@dataclass(frozen=True)
class EndStopPhase:
    """The current generation's stop phase ended at `at`: the stop grace passed, and the nodes that
    never confirmed their stop are left out."""

    at: float


Action = (CommitRecord | StopGeneration | LaunchGeneration | RequestCheckpoint | RequestGracefulExit | MarkCheckpointBad
          | AddSkip | NotePlaceableSince | EndStopPhase | ReadyToStop)

ACTIVE_STATES = frozenset({JobState.PENDING, JobState.RUNNING, JobState.RECOVERING, JobState.WAITING})


@dataclass(frozen=True)
class CheckpointRequest:
    """A checkpoint asked for to reshape the job at `step`."""

    step: int
    asked_at: float


@dataclass(frozen=True)
class ExitRequest:
    """A graceful exit asked for (RequestExit) to reshape the job; the ranks' clean exits that
    follow end the generation for the reshape, not the job. A new leader takes it over from
    JobRecord.exit_requested_generation, timed from its takeover."""

    reason: str
    asked_at: float


@dataclass(frozen=True)
class JobWorld:
    spec: JobSettings
    record: JobRecord
    generation: GenerationRecord | None  # the record's current generation, once launched
    observation: GenerationObservation | None
    offers: tuple[NodeOffer, ...]  # READY, connected and not drained
    disconnected: frozenset[str]  # READY nodes whose session broke (within the reconnect grace)
    lost_nodes: frozenset[str]
    drained: frozenset[str]
    catalog: tuple[CheckpointEntry, ...]  # oldest first
    skips: tuple[tuple[int, int], ...]  # the skip ledger's ranges
    placeable_since: float | None  # as noted by the last pass (NotePlaceableSince)
    checkpoint_request: CheckpointRequest | None
    now: float
    exit_request: ExitRequest | None = None
    # In-memory snapshots a generation failed to resume from: never chosen again.
    bad_memory_steps: frozenset[int] = frozenset()
    # The node order of the last generation at each world size (placement.place): a regrown world
    # gives its nodes back their ranks. Kept in the leader's memory only; a new leader starts empty.
    orders_seen: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    # The ledger's ranges found bad by the workers or the coordinator (not those an operator added).
    found_bad: tuple[tuple[int, int], ...] = ()
    # When the operator's pause of the live generation was asked for (a new leader: when it took over).
    pause_asked_at: float | None = None
    # trainerd is stopping and its local agents with it: save first, launch nothing (kept in memory only).
    stopping: bool = False


def decide(world: JobWorld) -> list[Action]:
    """The actions of this pass, in the order they are to be applied."""
    return _notes(world) + _transitions(world)


def restart_backoff_s(spec: JobSettings, consecutive_crashes: int) -> float:
    if consecutive_crashes <= 0:
        return 0.0
    return min(spec.restart.max_backoff_s, spec.restart.backoff_s * 2 ** (consecutive_crashes - 1))


def bad_memory_steps_after(known: frozenset[int], step: int,
                           catalog: tuple[CheckpointEntry, ...]) -> frozenset[int]:
    """The in-memory snapshot steps never to resume from again, once the one of `step` failed to load.
    A step not newer than the newest good checkpoint is forgotten (only a newer snapshot is chosen),
    and of the others only the newest REMEMBERED_BAD_MEMORY_STEPS are kept (an agent holds only its
    newest few snapshots, and drops those newer than where a generation resumes from at its launch)."""
    newest_good = max((c.step for c in catalog if c.good), default=-1)
    older = sorted(s for s in known if s > newest_good and s != step)
    return frozenset(older[len(older) - REMEMBERED_BAD_MEMORY_STEPS + 1:]) | {step}


def record_after_checkpoint(record: JobRecord) -> JobRecord | None:
    """A committed checkpoint is durable progress: the crash backoff starts over. None: no change."""
    return record.moved_to(record.state, consecutive_crashes=0) if record.consecutive_crashes else None


def _transitions(world: JobWorld) -> list[Action]:
    record = world.record
    if world.stopping and (record.state is not JobState.RUNNING or record.between_generations):
        return [ReadyToStop(f"{record.state.value}, no running generation to save")]
    if record.state not in ACTIVE_STATES:
        return _stop_leftovers(world)
    if world.generation is None:
        return _first_launch(world)
    if not record.between_generations:
        return _watch_generation(world)
    return _relaunch(world)


# ---------------------------------------------------------------- what the controller keeps between passes

def _notes(world: JobWorld) -> list[Action]:
    """What changed in the controller's memory; first, so that the transitions see the same."""
    notes: list[Action] = []
    since = _placeable_since(world)
    if since != world.placeable_since:
        notes.append(NotePlaceableSince(since))
    observation = world.observation
    if observation is not None and observation.all_stopped_at is None and _stop_phase_end(world) is not None:
        notes.append(EndStopPhase(world.now))
    return notes


def _placeable_since(world: JobWorld) -> float | None:
    if world.generation is not None or place(world.spec, list(world.offers)) is None:
        return None
    return world.placeable_since if world.placeable_since is not None else world.now


def _stop_patience_s(spec: JobSettings) -> float:
    """How long after its Stop a node has to confirm it: the stop grace (after which its agent had
    to SIGKILL), plus the time for the answer."""
    return spec.stop_grace_s + STOP_CONFIRM_MARGIN_S


def _stop_phase_end(world: JobWorld) -> float | None:
    """When the stop phase of the current generation ended: every node went idle (noted as the
    reports came in), or the stop patience passed since the stop was decided (it ends now, and
    the silent nodes are left out). None while it goes on, or when no stop was decided."""
    observation = world.observation
    if observation is None or observation.stop_decided_at is None:
        return None
    if observation.all_stopped_at is not None:
        return observation.all_stopped_at
    if world.now - observation.stop_decided_at >= _stop_patience_s(world.spec):
        return world.now
    return None


# ---------------------------------------------------------------- no generation to watch

def _stop_leftovers(world: JobWorld) -> list[Action]:
    """A finished, failed or paused job must not leave processes behind."""
    observation = world.observation
    if observation is None or world.generation is None:
        return []
    unstopped = [n for n in world.generation.placement.nodes
                 if n not in observation.stop_sent and not observation.node_idle(n)]
    return [StopGeneration(f"job is {world.record.state.value}")] if unstopped else []


def _usable_offers(world: JobWorld, excluded: frozenset[str] = frozenset()) -> list[NodeOffer]:
    """Offers minus `excluded`, and minus quarantined nodes unless the job cannot run without them
    (then the restart budget, not the quarantine, decides when to give up)."""
    offers = [o for o in world.offers if o.name not in excluded]
    quarantined = world.record.quarantined(world.spec.restart.quarantine_after)
    healthy = [o for o in offers if o.name not in quarantined]
    return healthy if place(world.spec, healthy) is not None else offers


def _first_launch(world: JobWorld) -> list[Action]:
    offers = _usable_offers(world)
    placement = place_keeping_spares(world.spec, offers)
    if placement is None:
        return []
    # Every node the job can use, and its spares: nothing to wait for (else the first spare to come would be
    # placed, and the job then stand by without one, or grow at once when one more came).
    everyone_here = len(offers) >= world.spec.max_nodes + world.spec.spare_nodes
    since = _placeable_since(world)
    waited = since is not None and world.now - since >= world.spec.start_wait_s
    if not (everyone_here or waited):
        return []
    checkpoint = _choose_checkpoint(world)
    return [_launch(world, placement, checkpoint if isinstance(checkpoint, CheckpointEntry) else None)]


def _launch(world: JobWorld, placement: Placement,
            checkpoint: CheckpointEntry | MemorySnapshot | None) -> LaunchGeneration:
    """The next generation; the job stays PENDING until the first one runs, a relaunch is RECOVERING."""
    record = world.record
    state = JobState.PENDING if record.state is JobState.PENDING else JobState.RECOVERING
    addresses = {o.name: o.peer_address for o in world.offers if o.name in placement.nodes and o.peer_address}
    shortfall = "" if isinstance(checkpoint, MemorySnapshot) else _memory_shortfall(world, checkpoint)
    return LaunchGeneration(placement, checkpoint, record.moved_to(
        state, generation=record.generation + 1, world_size=placement.world_size, resume_from_step=None),
        addresses, shortfall)


# ---------------------------------------------------------------- a live generation

def _watch_generation(world: JobWorld) -> list[Action]:
    generation, observation, record = world.generation, world.observation, world.record
    assert generation is not None and observation is not None
    every_rank_finished = observation.finished_ranks() >= set(range(generation.placement.world_size))
    exit_request = world.exit_request
    if exit_request is not None and every_rank_finished:
        if record.pausing:
            return _paused(world, "every rank left at the graceful exit")
        if world.stopping:
            return [*_start_reshape(world, exit_request.reason, "every rank left at the graceful exit; trainerd "
                                    "relaunches it when it is started again"),
                    ReadyToStop(f"every rank of generation {generation.number} left at the graceful exit")]
        return _start_reshape(world, exit_request.reason, "every rank left at the graceful exit; relaunching")
    if every_rank_finished:
        done = record.moved_to(JobState.COMPLETED, stopped_generation=generation.number)
        return [CommitRecord(done, EventKind.JOB_COMPLETED, f"job {world.spec.name} is COMPLETED"),
                StopGeneration("every rank finished", job_completed=True)]
    failure = _failure(world)
    if failure is not None:
        return _end_generation(world, failure)
    if observation.first_failure() is not None:
        return []  # a failure is being told apart (a start-up settle window, a reconnect grace): nothing else
    if record.pausing:
        return _pause(world)
    if exit_request is not None and world.now - exit_request.asked_at >= GRACEFUL_EXIT_TIMEOUT_S:
        return _start_reshape(world, exit_request.reason, f"the graceful exit did not end generation "
                              f"{generation.number} within {GRACEFUL_EXIT_TIMEOUT_S:g}s; stopping it")
    if world.stopping:
        return _save_before_stopping(world)
    if record.state is not JobState.RUNNING:
        why = _running_reason(world)
        if why is None:
            return []
        from_output = bool(observation.progress) and not observation.runtime_progress
        return [CommitRecord(record.moved_to(JobState.RUNNING, steps_from_output=from_output),
                             EventKind.JOB_RUNNING, f"job {world.spec.name} is RUNNING: {why}")]
    return _reshape(world)


def _running_reason(world: JobWorld) -> str | None:
    """Why the generation counts as running now; None while it is still starting."""
    generation, observation = world.generation, world.observation
    assert generation is not None and observation is not None
    world_size = generation.placement.world_size
    if len(observation.progress) >= world_size:
        return f"every rank of generation {generation.number} reported a step"
    since = observation.running_since(world_size)
    if since is None or world.now - since < RUNNING_WITHOUT_PROGRESS_S:
        return None
    reported = f"{len(observation.progress)} of {world_size} ranks" if observation.progress else "no rank"
    return (f"every process of generation {generation.number} has run for {RUNNING_WITHOUT_PROGRESS_S:g}s "
            f"({reported} reported a step)")


def _failure(world: JobWorld) -> Failure | None:
    generation, observation = world.generation, world.observation
    assert generation is not None and observation is not None
    nodes = generation.placement.nodes
    lost = [n for n in nodes if n in world.lost_nodes]
    if lost:
        return Failure(FailureCause.NODE_LOST, f"node {lost[0]} was lost while running generation {generation.number}",
                       lost[0])
    gone = [n for n in nodes if observation.processes_gone(n)]
    if gone:
        return Failure(FailureCause.PROCESSES_GONE,
                       f"node {gone[0]} runs none of its processes of generation {generation.number}: its agent "
                       f"started again (with trainerd, for a local agent), and they died with the one before",
                       gone[0])
    fenced = [(p.node, p.cause.message) for p in observation.processes.values()
              if p.failed and p.cause is not None and p.cause.kind == CauseKind.FENCED]
    if fenced:
        node, message = fenced[0]
        return Failure(FailureCause.FENCED, f"node {node} stopped its processes of generation {generation.number} "
                       f"itself: {message}", node)
    failed = observation.first_failure()
    if failed is not None:
        if any(n in world.disconnected for n in nodes):
            # A node going down takes its peers' collectives with it; wait for the reconnect grace
            # to tell a node loss (no budget spent) from a crash.
            return None
        if failed.exit_code == EXIT_CANNOT_EXECUTE and not failed.signal:
            return _process_failure(FailureCause.LAUNCH_FAILED, failed)
        if failed.role is ProcessRole.WORKER and not failed.signal:
            if failed.exit_code == EXIT_CHECKPOINT_UNREADABLE:
                return _process_failure(FailureCause.CHECKPOINT_UNREADABLE, failed)
            if failed.exit_code == EXIT_USAGE:
                return _process_failure(FailureCause.USAGE_ERROR, failed)
        printed = failed.same_cause_key is not None and not failed.signal
        if not observation.progress_seen or printed:
            # Let the other ranks show whether they fail the same way (and the exit reports, with their
            # root causes, catch up with the heartbeats).
            settle_s = ERROR_SETTLE_S if observation.progress_seen else STARTUP_FAILURE_SETTLE_S
            settled = world.now - failed.observed_at >= settle_s
            if not settled and not observation.workers_exited(generation.placement.world_size):
                return None
        own = next((p for p in observation.failures() if not p.communication), None)
        if own is None:
            return _collective_failure(world, failed)
        failed = own  # a peer's crash broke the collectives that failed before its exit was told
        if not observation.progress_seen:
            job_error = _job_error(world)
            if job_error is not None:
                return job_error
        alike = _same_error_ranks(observation, failed)
        if observation.progress_seen and _same_error_again(world.record.last_failure, failed, alike):
            previous = world.record.last_failure
            assert previous is not None
            return _process_failure(FailureCause.JOB_ERROR, failed,
                                    f"{failed.describe()}; ranks {_ranks(alike)} failed the same way, as ranks "
                                    f"{_ranks(previous.same_error_ranks)} did when the generation before ended",
                                    alike)
        previous = world.record.last_failure
        crash = replace(_process_failure(FailureCause.PROCESS_EXITED, failed, same_error_ranks=alike),
                        samples_at=_failing_samples(world, failed.rank))
        if len(alike) >= 2 and _free_retry_left(previous):  # the job's own error, unless it passes
            crash = replace(crash, free_retry=True,
                            message=f"{crash.message}; ranks {_ranks(alike)} failed the same way")
        if observation.progress_seen and _follows_rank(previous, crash) and not _same_samples(previous, crash):
            assert previous is not None
            samples = "at other samples" if crash.samples_at >= 0 and previous.samples_at >= 0 \
                else "its samples unknown (none can be skipped)"
            return replace(crash, cause=FailureCause.JOB_ERROR,
                           message=f"{crash.message}; rank {crash.rank} failed the same way on node "
                                   f"{_met_elsewhere(previous, crash)} before, {samples}: the error follows the "
                                   f"rank, not a node or a batch")
        return crash
    suspected = {node: count for node, count in observation.suspected_devices(world.now).items()
                 if node in nodes and count >= world.spec.restart.quarantine_after}
    if suspected:
        node, count = sorted(suspected.items())[0]
        return Failure(FailureCause.DEVICE_FAULT, f"node {node}'s devices computed {count} steps otherwise when they "
                       f"were replayed within {DEVICE_SUSPICION_WINDOW_S / 60:.0f} minutes", node)
    run = observation.bad_run()
    if len(run) >= world.spec.data_skip.max_consecutive_spikes:
        return Failure(FailureCause.BAD_BATCHES, f"steps {run[0].step}-{run[-1].step} were all skipped as bad "
                                      f"({run[-1].reason}, grad norm {run[-1].grad_norm:.3g}); rolling back")
    too_much = _too_much_skipped(world)
    if too_much is not None:
        return Failure(FailureCause.BAD_DATA, too_much)
    return _hang(world)


def _too_much_skipped(world: JobWorld) -> str | None:
    """Why the samples found bad so far mean the job is broken (None while they do not): the ledger holds
    MIN_RANGES_FOR_FRACTION such ranges or more, and they cover more than data_skip.max_skipped_fraction of
    the samples the job has got through. It is also what keeps the ledger, which every Launch carries,
    from growing without bound. An operator's own entries (`trainerctl skips add`) do not count."""
    observation = world.observation
    assert observation is not None
    found = world.found_bad
    if len(found) < MIN_RANGES_FOR_FRACTION or not observation.progress:
        return None
    consumed = max(report.consumed_samples for report in observation.progress.values())
    skipped = sum(min(end, consumed) - start for start, end in found if start < consumed)
    fraction = world.spec.data_skip.max_skipped_fraction
    if consumed <= 0 or skipped <= fraction * consumed:
        return None
    return (f"{skipped} of the {consumed} samples trained on so far were skipped as bad, in {len(found)} "
            f"ranges: more than data_skip.max_skipped_fraction ({fraction:g}); the data, the model or a device "
            f"is broken, not a batch")


def _process_failure(cause: FailureCause, failed: ProcessReport, message: str | None = None,
                     same_error_ranks: tuple[int, ...] = ()) -> Failure:
    root = failed.cause
    return Failure(cause, failed.describe() if message is None else message, failed.node, failed.rank,
                   failed.exit_code, failed.signal, "" if root is None else root.location,
                   "" if root is None else root.message, same_error_ranks,
                   error_kind="" if root is None else root.kind)


def _same_error_ranks(observation: GenerationObservation, failed: ProcessReport) -> tuple[int, ...]:
    """The worker ranks that failed with `failed`'s error (its root cause's message and location)."""
    key = failed.same_cause_key
    if key is None:
        return ()
    return tuple(sorted(p.rank for p in observation.failures()
                        if p.role is ProcessRole.WORKER and p.same_cause_key == key))


def _same_error_again(previous: Failure | None, failed: ProcessReport, alike: tuple[int, ...]) -> bool:
    """Two generations in a row ended by the same error, raised by two or more ranks each time: the
    job's own code (its evaluation, its saving, its data pipeline), which a relaunch runs into again.
    One raising rank is not enough: a corrupt sample or a bad device strikes one rank, and the
    crash-step skip and the quarantine deal with those. The first time is relaunched all the same, for
    an error every rank met at once may have passed (a shared file system that hiccupped)."""
    return (previous is not None and previous.cause is FailureCause.PROCESS_EXITED and len(alike) >= 2
            and len(previous.same_error_ranks) >= 2 and previous.error_key == failed.same_cause_key)


def _follows_rank(previous: Failure | None, failure: Failure) -> bool:
    """One rank alone raised the error that ended the generation before, as that same rank alone, but
    now on another node: no fault of a node's explains it. The rank moves after its error was blamed
    on its node twice (_relaunch_order), or once that node is quarantined."""
    return (previous is not None and previous.cause is FailureCause.PROCESS_EXITED and bool(failure.error)
            and not failure.signal and not previous.signal
            and failure.same_error_ranks == previous.same_error_ranks == (failure.rank,)
            and bool(_met_elsewhere(previous, failure))
            and previous.error_key == failure.error_key)


def _met_elsewhere(previous: Failure, failure: Failure) -> str:
    """The node other than `failure`'s that `previous` puts the rank's error on ("" for none): where
    it ended the generation before, or, when that was this node, where it was blamed before that."""
    for node in (previous.node, previous.blamed_node):
        if node not in ("", failure.node):
            return node
    return ""


def _same_samples(previous: Failure | None, failure: Failure) -> bool:
    """`failure`'s rank failed at the very samples it failed at before: a batch may be at fault (the
    crash-step skip deals with it), where other samples leave the job's own code for that rank (a
    summary only rank 0 writes, a file only that rank opens). Without a sample position (steps read
    from output) nothing can be skipped, and it counts as other samples."""
    return previous is not None and failure.samples_at >= 0 and failure.samples_at == previous.samples_at


def _ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(str(rank) for rank in ranks)


def _job_error(world: JobWorld) -> Failure | None:
    """The job itself may be broken (its code, its data, its settings): before any rank showed progress,
    every worker that failed failed with the same root cause, and at least two did (or the generation
    has one rank); the workers that only failed waiting in a collective for them are left aside. A rank
    failing alone, or the ranks failing differently, is a crash.

    It is proven, not guessed: the job FAILs at once only for an error no relaunch can pass (_cannot_pass),
    or one that ended the generation before too. Else the generation is relaunched once without spending
    the restart budget (Failure.free_retry): an error every rank met at once may have passed (a shared file
    system that hiccupped, a download that timed out)."""
    generation, observation = world.generation, world.observation
    assert generation is not None and observation is not None
    workers = [p for p in observation.failures() if p.role is ProcessRole.WORKER and not p.communication]
    causes = {p.same_cause_key for p in workers}
    if not workers or None in causes or len(causes) > 1:
        return None
    if len(workers) < 2 and generation.placement.world_size > 1:
        return None
    first = workers[0]
    ranks = tuple(sorted(p.rank for p in workers))
    same = "before any progress" if len(workers) == 1 else \
        f"ranks {_ranks(ranks)} failed the same way before any progress"
    if _cannot_pass(first):
        return _process_failure(FailureCause.JOB_ERROR, first, f"{first.describe()}; {same}")
    previous = world.record.last_failure
    if (previous is not None and previous.cause in (FailureCause.PROCESS_EXITED, FailureCause.JOB_ERROR)
            and previous.error_key == first.same_cause_key):
        return _process_failure(FailureCause.JOB_ERROR, first,
                                f"{first.describe()}; {same}, as when the generation before ended")
    return replace(_process_failure(FailureCause.PROCESS_EXITED, first, f"{first.describe()}; {same}", ranks),
                   free_retry=_free_retry_left(previous))


# An error of the job's own code that no relaunch can pass: it does not compile, or imports what is not there.
_CANNOT_PASS = re.compile(r"(?:SyntaxError|IndentationError|TabError|ImportError|ModuleNotFoundError)\b")
_LIBRARY_LOCATION = re.compile(r"/(?:site|dist)-packages/|/lib/python\d+\.\d+/|^<frozen ")


def _cannot_pass(report: ProcessReport) -> bool:
    """A SyntaxError or an ImportError raised at a line of the job's own code (not a library's, whose
    install a node may have broken); what the agent reads as a Python exception only."""
    cause = report.cause
    return (cause is not None and cause.kind == CauseKind.PYTHON_EXCEPTION and bool(cause.location)
            and _CANNOT_PASS.match(cause.message) is not None and not _LIBRARY_LOCATION.search(cause.location))


def _free_retry_left(previous: Failure | None) -> bool:
    """The generation before did not end in a free retry: one is given once in a row, or a job whose error
    changes every generation would be relaunched for ever without spending the budget."""
    return previous is None or not previous.free_retry


def _collective_failure(world: JobWorld, failed: ProcessReport) -> Failure:
    """Every process that failed failed in a collective or on a connection (ProcessReport.communication):
    they waited for a peer that never came, or went away. Those ranks are not blamed: the ranks that did
    not fail so (still running, or gone without an error) never reached the collective, and the failure
    names them. It is never the job's own error, nor a node's (no node is singled out), nor a batch's (no
    crash step); it spends the restart budget like any crash, which bounds a peer that never comes."""
    generation, observation = world.generation, world.observation
    assert generation is not None and observation is not None
    waited = sorted({p.rank for p in observation.failures() if p.role is ProcessRole.WORKER})
    absent = [slot for slot in generation.placement.ranks if slot.rank not in waited]
    failure = _process_failure(FailureCause.PROCESS_EXITED, failed)
    if not waited:  # the scheduler alone: no rank was seen waiting
        return failure
    if not absent:
        return replace(failure, message=f"{failed.describe()}; every rank failed in a collective: a link between "
                                        f"the nodes, not the job")
    named = " and ".join(f"rank {slot.rank} on node {slot.node}" for slot in absent)
    reached = "did not reach the collective" if observation.progress_seen else "reached no collective"
    waiters = f"rank {waited[0]}" if len(waited) == 1 else f"ranks {_ranks(tuple(waited))}"
    return replace(failure, node=absent[0].node, rank=absent[0].rank, exit_code=0, signal=0,
                   message=f"{named} {reached}, and {waiters} failed waiting: {failed.describe()}")


def _hang(world: JobWorld) -> Failure | None:
    """No rank reported a new step for the generation's hang allowance (hang_allowance.py: hang_timeout_s, or
    less once its step time is measured), once a rank showed progress at all: a script that prints nothing
    trainerd reads is never judged (its exits and its nodes still are)."""
    generation, observation, spec = world.generation, world.observation, world.spec
    assert generation is not None and observation is not None
    if observation.training_finished >= set(range(generation.placement.world_size)):
        return None  # every rank ended its training: what they do before they exit awaits no step
    silent_since, behind = observation.silent_since(), observation.behind()
    if silent_since is None or behind is None:
        return None
    allowance = hang_allowance(spec, observation, world.checkpoint_request is not None or world.pause_asked_at
                               is not None)
    if world.now - silent_since <= allowance.seconds:
        return None
    node = next(slot.node for slot in generation.placement.ranks if slot.rank == behind.rank)
    frozen = " (its process is stopped or stuck in the kernel)" if behind.rank in observation.frozen_ranks() else ""
    return Failure(FailureCause.HANG, f"no rank of generation {generation.number} reported a new step for "
                                      f"{world.now - silent_since:.0f}s ({allowance.why}); "
                                      f"rank {behind.rank} on node {node} was behind at {behind.describe_position()}"
                                      f"{frozen}", node, behind.rank)


def _failing_step(world: JobWorld, failure: Failure) -> int | None:
    """The step a crashed rank was on: one past its last reported step. None when it crashed
    before its first step of this generation (start-up problems are not the data's fault), or when
    its steps were read from its output (they have no sample position, and may restart each epoch)."""
    if failure.cause is not FailureCause.PROCESS_EXITED or failure.rank < 0 or failure.communication:
        return None  # (a collective that failed is no sample's fault)
    assert world.observation is not None
    report = world.observation.progress.get(failure.rank)
    return None if report is None or report.from_output else report.step + 1


def _failing_samples(world: JobWorld, rank: int) -> int:
    """Where the samples of the step `rank` failed on end, past the ledger's ranges the step passes over
    (a skip added since moves them though the step starts where it did); -1 when that step (see
    _failing_step) or the global batch is unknown."""
    assert world.observation is not None
    report = world.observation.progress.get(rank)
    if report is None or report.from_output or world.spec.global_batch is None:
        return -1
    return _batch_end(_step_start(world, rank), world.spec.global_batch, world.skips)


def _step_start(world: JobWorld, rank: int) -> int:
    """The sample position where the step after `rank`'s last reported one began."""
    assert world.generation is not None and world.observation is not None
    report = world.observation.progress.get(rank)
    if report is not None:
        return report.consumed_samples
    return 0 if world.generation.resume is None else world.generation.resume.consumed_samples


def _batch_end(start: int, global_batch: int, skips: tuple[tuple[int, int], ...]) -> int:
    """The position after the global batch that starts at `start`, passing over ledger ranges."""
    position, taken = start, 0
    for skip_start, skip_end in sorted(skips):
        if skip_end <= position:
            continue
        room = skip_start - position
        if taken + room >= global_batch:
            break
        taken += max(0, room)
        position = max(position, skip_end)
    return position + (global_batch - taken)


def _end_generation(world: JobWorld, failure: Failure) -> list[Action]:
    """Commit the stop of the generation (and what the failure costs), then send it."""
    record, spec, generation, observation = world.record, world.spec, world.generation, world.observation
    assert generation is not None and observation is not None
    failure = _with_history(world, failure)
    changes: dict = dict(stopped_generation=generation.number, last_failure=failure, restarts=record.restarts + 1)
    actions: list[Action] = []
    note = _forgive_node(world, failure, changes)
    shared = len(failure.same_error_ranks) >= 2
    if failure.free_retry:
        note = ("; the job's own error, not a node's, unless it passes: relaunching once without spending the "
                "restart budget (if it ends the next generation too, the job fails)")
    if failure.spends_budget:
        changes["crash_restarts"] = record.crash_restarts + 1
        changes["consecutive_crashes"] = record.consecutive_crashes + 1
        if failure.blamed and failure.blamed_node == failure.node:
            changes["node_failures"] = {**record.node_failures,
                                        failure.node: record.node_failures.get(failure.node, 0) + 1}
        if shared:
            note = (f"; ranks {_ranks(failure.same_error_ranks)} failed the same way: the job's own error, not a "
                    f"node's (if it ends the next generation too, the job fails)")
        step = _failing_step(world, failure)
        if step is not None and not shared:  # an error every rank raised is no sample's fault
            crashes = record.crash_steps.get(step, 0) + 1
            changes["crash_steps"] = {**record.crash_steps, step: crashes}
            if crashes >= spec.data_skip.crash_repeats:
                # The same step keeps killing workers: its samples are the likely cause.
                if spec.global_batch is None:
                    note = (f"; step {step} crashed a worker {crashes} times, but without global_batch its "
                            f"samples are unknown: nothing is skipped")
                else:
                    start = _step_start(world, failure.rank)
                    actions.append(AddSkip(start, _batch_end(start, spec.global_batch, world.skips),
                                           f"step {step} crashed a worker {crashes} times", step))
                changes["crash_steps"] = {k: v for k, v in record.crash_steps.items() if k != step}
    if failure.cause is FailureCause.HANG:
        note += _hang_hint(world, failure)
    if failure.cause is FailureCause.CHECKPOINT_UNREADABLE and generation.resume is not None:
        actions.append(MarkCheckpointBad(generation.resume.step, failure.message))
    if failure.cause is FailureCause.DEVICE_FAULT:
        changes["node_failures"] = {**record.node_failures, failure.node: max(
            record.node_failures.get(failure.node, 0), spec.restart.quarantine_after)}
    if failure.cause is FailureCause.BAD_BATCHES:
        run = observation.bad_run()
        actions.append(AddSkip(run[0].sample_start, run[-1].sample_end,
                               f"rollback after {len(run)} consecutive bad batches", run[0].step))
        before = [c for c in world.catalog if c.good and c.step < run[0].step]
        if before:
            changes["resume_from_step"] = before[-1].step
    over_budget = failure.spends_budget and changes["crash_restarts"] > spec.restart.max
    if over_budget or failure.cause.permanent:
        updated = record.moved_to(JobState.FAILED, **{**changes, "restarts": record.restarts})
        if failure.cause is FailureCause.JOB_ERROR:
            why = "the job itself fails: fix it, then trainerctl resume"
        elif failure.cause.permanent:
            why = "the same launch would fail again"
        else:
            why = f"restart budget of {spec.restart.max} spent"
        message = f"job {spec.name} is FAILED: {failure.message} ({why}){note}"
        actions.insert(0, CommitRecord(updated, EventKind.JOB_FAILED, message))
    else:
        updated = record.moved_to(JobState.RECOVERING, **changes)
        quarantine = ""
        if failure.node and failure.node in updated.quarantined(spec.restart.quarantine_after) - \
                record.quarantined(spec.restart.quarantine_after):
            quarantine = (f"; node {failure.node} is quarantined (its devices are suspected)"
                          if failure.cause is FailureCause.DEVICE_FAULT else
                          f"; node {failure.node} is quarantined after {spec.restart.quarantine_after} crashes")
        elif failure.blamed >= 2 and failure.blamed_node == failure.node and len(generation.placement.nodes) >= 2:
            quarantine = (f"; rank {failure.rank} failed the same way on node {failure.node} "
                          f"{failure.blamed} generations in a row: it runs on another node next, to tell "
                          f"a fault of the node's from the job's own")
        elif failure.blamed and failure.blamed_node != failure.node:
            quarantine = (f"; rank {failure.rank} failed the same way on node {failure.blamed_node}, at these "
                          f"samples: node {failure.node} is not blamed")
        actions.insert(0, CommitRecord(updated, EventKind.RECOVERY_STARTED,
                                       f"job {spec.name} is RECOVERING ({failure.cause}): {failure.message}"
                                       f"{quarantine}{note}", recovery=failure.cause))
    actions.append(StopGeneration(failure.message, dump_stacks=failure.cause is FailureCause.HANG))
    return actions


def _hang_hint(world: JobWorld, failure: Failure) -> str:
    """What to tell of a hang of a rank whose steps come from its output: a long evaluation or save of the
    script's own prints no step either (trainerd's runtime tells of those), so the likelier cause is named
    with its remedy. Nothing for a rank whose process was seen frozen, which is a hang for sure."""
    observation = world.observation
    assert observation is not None
    report = observation.progress.get(failure.rank)
    if report is None or not report.from_output or failure.rank in observation.frozen_ranks():
        return ""
    return ("; its steps are read from its output, so an evaluation or a save of the script's own that prints "
            "nothing for longer than hang_timeout_s looks the same: if that is it, raise job.hang_timeout_s")


def _with_history(world: JobWorld, failure: Failure) -> Failure:
    """`failure` (its samples_at set where _failure made it) with, when the crash singles out its node, the
    node it is blamed on: its own, one more time in a row when the rank's same error ended the generation
    before there too (twice moves the rank, see _relaunch_order); or, when the error followed the rank
    from another node (at the same samples, or _failure would have failed the job), still that one."""
    if failure.cause is not FailureCause.PROCESS_EXITED or not failure.node or _singled_out_node(world) != failure.node:
        return failure
    previous = world.record.last_failure
    if previous is not None and _follows_rank(previous, failure) and previous.blamed:
        return replace(failure, blamed_node=previous.blamed_node, blamed=previous.blamed)
    again = (previous is not None and previous.blamed_node == failure.node and bool(failure.error)
             and previous.rank == failure.rank and previous.error_key == failure.error_key)
    return replace(failure, blamed_node=failure.node, blamed=previous.blamed + 1 if again and previous else 1)


def _forgive_node(world: JobWorld, failure: Failure, changes: dict) -> str:
    """The job failed on its own error, which earlier singled out a node: the crashes that error was
    counted against that node are taken back (lifting a quarantine they caused). Puts the node's new
    count in `changes`; returns what to add to the event."""
    record, after = world.record, world.spec.restart.quarantine_after
    previous = record.last_failure
    if (failure.cause is not FailureCause.JOB_ERROR or previous is None or not previous.blamed
            or previous.error_key != failure.error_key):
        return ""
    node, counted = previous.blamed_node, record.node_failures.get(previous.blamed_node, 0)
    left = max(0, counted - previous.blamed)
    changes["node_failures"] = {**{n: c for n, c in record.node_failures.items() if n != node},
                                **({node: left} if left else {})}
    lifted = " and its quarantine is lifted" if counted >= after > left else ""
    return f"; node {node} is no longer blamed for its {counted - left} crash(es) from this error{lifted}"


def _singled_out_node(world: JobWorld) -> str | None:
    """The node a crash points at, for the quarantine: every process that failed as the first one did
    (its error, or a signal) ran on it, and the generation ran on other nodes too. The collective
    errors its crash caused on the other nodes do not clear it; the same error on another node does
    (the job's code, not the node). A crash of a one-node generation singles out nothing (there is no
    healthy node to compare with; counting it would quarantine node after node for a bug of the job's
    own): the restart budget bounds those."""
    generation, observation = world.generation, world.observation
    assert generation is not None and observation is not None
    failures = observation.failures()
    first = next((p for p in failures if not p.communication), None)
    if first is None:
        return None  # every process failed waiting in a collective: none of them is to blame
    nodes = {p.node for p in failures if p.same_cause_key == first.same_cause_key}
    if len(generation.placement.nodes) < 2 or len(nodes) != 1:
        return None
    return nodes.pop()


def _reshape(world: JobWorld) -> list[Action]:
    """Take in nodes that joined, or let drained ones go (no restart budget spent), once the generation
    saved what it can (_save_first)."""
    generation, spec = world.generation, world.spec
    assert generation is not None
    if world.exit_request is not None:
        return []  # the ranks are leaving (see _watch_generation)
    draining = [n for n in generation.placement.nodes if n in world.drained]
    # Spares held back first: a node that returns refills them before the world grows.
    wanted = place_keeping_spares(spec, _usable_offers(world), generation.placement.nodes, world.orders_seen)
    growing = wanted is not None and wanted.world_size > generation.placement.world_size
    if not draining and not growing:
        return []
    reason = (f"node {draining[0]} is drained" if draining or wanted is None
              else f"world size can grow from {generation.placement.world_size} to {wanted.world_size}")
    saved = _save_first(world, reason)
    if isinstance(saved, list):
        return saved
    return _start_reshape(world, reason, "relaunching from the checkpoint just saved" if saved.step is not None
                          else f"relaunching now; {saved.why_none}")


def _requested_checkpoint(world: JobWorld) -> int | None:
    """The step of the generation's checkpoint that answered the request; None while none did. Only the
    requested step (or a later one) answers: an older periodic checkpoint would throw away the steps
    trained since."""
    request, observation = world.checkpoint_request, world.observation
    assert observation is not None
    if request is None:
        return None
    return max((step for step in observation.checkpoints if step >= request.step), default=None)


def _ask_checkpoint(world: JobWorld, reason: str) -> list[Action]:
    """Ask for a checkpoint a little ahead of the fastest rank, again when the last request went unanswered."""
    request, observation = world.checkpoint_request, world.observation
    assert observation is not None
    newest = observation.max_step()
    if newest is None or (request is not None and world.now - request.asked_at < CHECKPOINT_REQUEST_RETRY_S):
        return []
    return [RequestCheckpoint(newest + _checkpoint_lead_steps(observation, world.spec), reason)]


def _ask_exit(world: JobWorld, reason: str) -> list[Action]:
    """Ask every rank to leave through the script's graceful exit (once; _watch_generation sees them go)."""
    generation, spec = world.generation, world.spec
    assert generation is not None
    if world.exit_request is not None:
        return []
    asked = world.record.moved_to(world.record.state, exit_requested_generation=generation.number)
    return [CommitRecord(asked, EventKind.EXIT_REQUESTED, f"job {spec.name}: generation {generation.number} is asked "
                                                          f"to leave through the script's graceful exit: {reason}"),
            RequestGracefulExit(reason)]


def _pause(world: JobWorld) -> list[Action]:
    """The operator asked to pause the running generation: it saves first (_save_first), so that the
    resume loses no steps; then the job is PAUSED. One that has not within PAUSE_SAVE_WAIT_S is stopped
    as it is."""
    if world.pause_asked_at is not None and world.now - world.pause_asked_at >= PAUSE_SAVE_WAIT_S:
        return _paused(world, f"nothing was saved within {PAUSE_SAVE_WAIT_S:g}s; stopped as it was")
    saved = _save_first(world, "paused by the operator")
    if isinstance(saved, list):
        return saved
    return _paused(world, f"stopped after the checkpoint at step {saved.step}" if saved.step is not None
                   else f"stopped at once; {saved.why_none}")


def _save_before_stopping(world: JobWorld) -> list[Action]:
    """trainerd is stopping, and the generation's processes and in-memory snapshots with its local agents:
    the generation saves first (_save_first), so that trainerd started again resumes there rather than at
    the last periodic checkpoint. trainerd bounds the wait itself (Coordinator.save_before_stopping)."""
    generation = world.generation
    assert generation is not None
    saved = _save_first(world, STOPPING)
    if isinstance(saved, list):
        return saved
    if saved.step is not None:
        return [ReadyToStop(f"generation {generation.number} saved a checkpoint at step {saved.step}")]
    return [ReadyToStop(f"generation {generation.number} stops without a checkpoint: {saved.why_none}")]


@dataclass(frozen=True)
class _Saved:
    """What a generation asked to save first (_save_first) left for the one after it."""

    step: int | None  # the checkpoint it saved when asked; None: none
    why_none: str = ""  # a few words on why there is none


def _save_first(world: JobWorld, reason: str) -> list[Action] | _Saved:
    """Have the running generation save before it is stopped, for `reason` (a reshape, a pause, trainerd's
    own stop). trainerd's runtime saves a checkpoint a little ahead of its fastest rank; a script with a
    graceful exit (job.graceful_exit_file) leaves through it at a step boundary, and its clean exits then
    end the generation (_watch_generation). Returns the actions that ask (none while the answer is awaited),
    or, once the generation saved or cannot, what it left: the requested checkpoint, or why there is none
    (its save failed; it reported no step yet, so there is little to lose, and a generation of the runtime
    is not told from a script before its first step; a script without a graceful exit resumes from its own
    checkpoints)."""
    observation = world.observation
    assert observation is not None
    if observation.uses_runtime:
        step, request = _requested_checkpoint(world), world.checkpoint_request
        if step is not None:
            return _Saved(step)
        if request is not None and any(failed >= request.step for failed in observation.failed_checkpoints):
            return _Saved(None, f"its save at step {request.step} failed")
        if observation.max_step() is not None:
            return _ask_checkpoint(world, reason)
    elif world.spec.graceful_exit_file is not None:
        return _ask_exit(world, reason)  # a script that prints no step may still have trained
    if observation.max_step() is None:  # trainerd's runtime before its first step, or a script
        return _Saved(None, "it reported no step yet")
    return _Saved(None, "the script resumes from its own checkpoints")


def _paused(world: JobWorld, how: str) -> list[Action]:
    generation, record = world.generation, world.record
    assert generation is not None
    paused = record.moved_to(JobState.PAUSED, stopped_generation=generation.number, pause_requested_generation=0)
    return [CommitRecord(paused, EventKind.JOB_PAUSED, f"job {world.spec.name} is PAUSED by the operator: {how}"),
            StopGeneration("paused by the operator")]


def _start_reshape(world: JobWorld, reason: str, how: str) -> list[Action]:
    """Commit the end of the generation for a reshape, then stop what still runs of it."""
    generation, record = world.generation, world.record
    assert generation is not None
    updated = record.moved_to(JobState.RECOVERING, stopped_generation=generation.number,
                              restarts=record.restarts + 1)
    return [CommitRecord(updated, EventKind.RESHAPE_STARTED, f"job {world.spec.name} is RECOVERING: {reason}; {how}",
                         recovery="reshape"),
            StopGeneration(reason)]


def _checkpoint_lead_steps(observation: GenerationObservation, spec: JobSettings) -> int:
    """How far ahead of the fastest rank a requested checkpoint goes: CHECKPOINT_LEAD_S of steps, at
    the reported sample rate over the global batch, else at the rate the steps arrived."""
    rates = [p.samples_per_s for p in observation.progress.values()
             if math.isfinite(p.samples_per_s) and p.samples_per_s > 0]
    if spec.global_batch is not None and rates:
        steps_per_s = max(rates) / spec.global_batch
    else:
        steps_per_s = observation.steps_per_s() or 0.0
    return max(MIN_CHECKPOINT_LEAD_STEPS, math.ceil(steps_per_s * CHECKPOINT_LEAD_S))


# ---------------------------------------------------------------- between generations

def _relaunch(world: JobWorld) -> list[Action]:
    generation, observation, record, spec = world.generation, world.observation, world.record, world.spec
    assert generation is not None and observation is not None
    if record.pausing:  # the generation ended some other way while it was to save first: no relaunch
        return _paused(world, f"generation {generation.number} ended before it saved")
    actions: list[Action] = []
    busy = [n for n in generation.placement.nodes if not observation.node_idle(n) and n not in world.lost_nodes]
    unconfirmed = _unconfirmed_snapshot_holders(world, busy)
    if any(n not in observation.stop_sent for n in busy + unconfirmed):
        actions.append(StopGeneration(f"generation {generation.number} is over"))
    # A node gets the stop patience (from when its Stop went out) to confirm; then it is left out.
    patience = _stop_patience_s(spec)
    if any(world.now - observation.stop_sent.get(n, world.now) < patience for n in busy):
        return actions
    # A snapshot holder's confirmation names its newest snapshot, fresher than its last heartbeat's (the
    # exit reports that made it idle come first): wait for it as long, then go with the heartbeat's.
    decided = observation.stop_decided_at if observation.stop_decided_at is not None else world.now - patience
    if any(world.now - observation.stop_sent.get(n, decided) < patience for n in unconfirmed):
        return actions
    stopped_at = _stop_phase_end(world)
    if stopped_at is None:  # a lost node never confirms: the backoff counts from the stop decision
        stopped_at = observation.stop_decided_at if observation.stop_decided_at is not None else world.now
    if world.now < stopped_at + restart_backoff_s(spec, record.consecutive_crashes):
        return actions
    order, moved = _relaunch_order(world)
    placement = place_replacing_lost(spec, _usable_offers(world, frozenset(busy)), generation.placement.world_size,
                                     order, None if moved else world.orders_seen)
    if placement is None:
        if record.state is not JobState.WAITING:
            actions.append(CommitRecord(record.moved_to(JobState.WAITING), EventKind.JOB_WAITING,
                                        f"job {spec.name} is WAITING: {_shortage(world)}"))
        return actions
    checkpoint = _choose_checkpoint(world, placement)
    if isinstance(checkpoint, str):
        failed = record.moved_to(JobState.FAILED, last_failure=Failure(FailureCause.CHECKPOINT_UNREADABLE, checkpoint))
        return actions + [CommitRecord(failed, EventKind.JOB_FAILED, f"job {spec.name} is FAILED: {checkpoint}")]
    return actions + [_launch(world, placement, checkpoint)]


def _relaunch_order(world: JobWorld) -> tuple[list[str], bool]:
    """The node order for the next generation, and whether it was turned: after one rank's error singled
    out its node twice in a row, the order is rotated by one node, so that the rank runs on another
    node. Where the error then goes tells a fault of the node's (it stays, another rank meets it) from
    the job's own (it follows the rank: _failure), without waiting for the quarantine."""
    assert world.generation is not None and world.observation is not None
    nodes = list(world.generation.placement.nodes)
    failure, ended_by = world.record.last_failure, world.observation.first_failure()
    if (failure is None or failure.blamed < 2 or failure.blamed_node != failure.node or len(nodes) < 2
            or ended_by is None
            or (ended_by.node, ended_by.rank) != (failure.node, failure.rank)):
        return nodes, False  # (a generation stopped for a reshape leaves the failure before it behind)
    return nodes[1:] + nodes[:1], True


def _unconfirmed_snapshot_holders(world: JobWorld, busy: list[str]) -> list[str]:
    """The nodes of the stopped generation that run nothing of it any more (their processes' exits
    were reported) and that report holding an in-memory snapshot, but whose Stop confirmation has
    not come. A lost node holds nothing; a disconnected one cannot be placed (nor confirm)."""
    generation, observation = world.generation, world.observation
    assert generation is not None and observation is not None
    return [n for n in generation.placement.nodes
            if (n in observation.memory_snapshots or n in observation.held_snapshots)
            and n not in observation.stopped and n not in busy
            and n not in world.lost_nodes and n not in world.disconnected]


def _memory_snapshot(world: JobWorld, placement: Placement | None) -> MemorySnapshot | None:
    """The in-memory snapshot every node of `placement` reports holding, when they all report the same
    one: each worker then reads it from its own host's memory. In this slice a snapshot is complete only
    in the memory of a one-host generation (every rank's files and the manifest in one place), so the
    relaunch must be on that host; copies between agents (issue 15 item 2) would lift that. None after a
    rollback for bad batches (a snapshot may hold the steps being rolled back), or for a snapshot that
    failed to load."""
    observation = world.observation
    failure = world.record.last_failure
    if placement is None or observation is None or (failure is not None and failure.cause is FailureCause.BAD_BATCHES):
        return None
    held = {observation.memory_snapshots.get(node) for node in placement.nodes}
    if len(held) == 1:
        snapshot = held.pop()
        if snapshot is not None and snapshot.step not in world.bad_memory_steps:
            return snapshot
    return _snapshot_across_hosts(world, placement)


def _snapshot_across_hosts(world: JobWorld, placement: Placement) -> MemorySnapshot | None:
    """The newest snapshot of a generation that spanned hosts of which every rank's files are held by a
    node that can serve them now (connected, READY, with a SnapshotPeer address), with a holder for
    each rank: one of the new placement's nodes when one holds it (no fetch), else the first by name.
    Every node of `placement` must serve too: each fetches what it lacks from the others."""
    observation = world.observation
    assert observation is not None
    serving = {o.name: o.peer_address for o in world.offers if o.peer_address}
    if not all(node in serving for node in placement.nodes):
        return None
    by_step: dict[int, list[tuple[str, MemorySnapshot]]] = {}
    for node, snapshots in observation.held_snapshots.items():
        if node in serving:
            for snapshot in snapshots:
                by_step.setdefault(snapshot.step, []).append((node, snapshot))
    for step in sorted(by_step, reverse=True):
        if step in world.bad_memory_steps:
            continue
        holdings = by_step[step]
        first = holdings[0][1]
        if any((s.world_size, s.generation, s.consumed_samples) != (first.world_size, first.generation,
                                                                    first.consumed_samples) for _, s in holdings):
            continue  # the agents disagree on what this step is: not one snapshot
        holders = []
        for rank in range(first.world_size):
            nodes = sorted(n for n, s in holdings if rank in s.ranks)
            if not nodes:
                break
            placed = [n for n in nodes if n in placement.nodes]
            node = (placed or nodes)[0]
            holders.append(SnapshotHolder(rank, node, serving[node]))
        else:
            return replace(first, ranks=frozenset(range(first.world_size)), holders=tuple(holders))
    return None


def _memory_shortfall(world: JobWorld, checkpoint: CheckpointEntry | None) -> str:
    """Why no in-memory snapshot newer than `checkpoint` is resumed from, when nodes that are gone took
    one with them: the newest step newer than the checkpoint whose missing ranks were held only by nodes
    that cannot serve now, and those nodes ("" when none was: the newer steps were never taken by every
    rank, as with per-rank `auto` intervals, or were not held at all)."""
    observation = world.observation
    if observation is None or world.record.resume_from_step is not None:
        return ""
    floor = 0 if checkpoint is None else checkpoint.step
    serving = {o.name for o in world.offers if o.peer_address}
    steps = sorted({s.step for held in observation.held_snapshots.values() for s in held if s.step > floor},
                   reverse=True)
    for step in steps:
        at_step = [(n, s) for n, held in observation.held_snapshots.items() for s in held if s.step == step]
        world_size = max(s.world_size for _, s in at_step)
        kept = {r for n, s in at_step if n in serving for r in s.ranks}
        held_elsewhere = {r for n, s in at_step if n not in serving for r in s.ranks}
        missing = sorted(set(range(world_size)) - kept)
        if missing and set(missing) <= held_elsewhere:
            gone = sorted({n for n, s in at_step if n not in serving and set(s.ranks) & set(missing)})
            return (f"no complete in-memory snapshot survives: ranks {', '.join(map(str, missing))} of step "
                    f"{step} were held only by {', '.join(gone)}")
        if not missing:
            return f"the in-memory snapshot of step {step} was not usable"
    return ""


def spares(world: JobWorld) -> tuple[str, ...]:
    """The usable nodes standing by beside the live generation, by name: a lost node's replacements."""
    if world.generation is None or world.record.state not in (JobState.PENDING, JobState.RUNNING,
                                                              JobState.RECOVERING, JobState.WAITING):
        return ()
    placed = set(world.generation.placement.nodes)
    return tuple(sorted(o.name for o in _usable_offers(world) if o.name not in placed))


def waiting_for(world: JobWorld) -> str:
    """What a job that has not launched yet, or is WAITING, waits for, in words ("" when it waits for
    nothing): an operator whose job stays PENDING must see why, e.g. nodes with fewer devices than
    devices_per_node."""
    spec, record = world.spec, world.record
    if record.state is JobState.WAITING:
        return _shortage(world)
    if record.state is not JobState.PENDING or world.generation is not None:
        return ""
    offers = _usable_offers(world)
    if place(spec, offers) is None:
        return _shortage(world)
    if len(offers) < spec.max_nodes:
        return (f"{len(offers)} of max_nodes {spec.max_nodes} node(s) are here: the first launch waits up to "
                f"start_wait_s ({spec.start_wait_s:g}s) for the others")
    return ""


def _shortage(world: JobWorld) -> str:
    spec = world.spec
    usable = _usable_offers(world)
    devices = sum(min(len(o.devices), spec.devices_per_node) for o in usable)
    return (f"{len(usable)} usable node(s) with {devices} device(s); it needs at least {spec.min_nodes} "
            f"node(s) and a world size of {_either(sorted(spec.allowed_world_sizes()))}")


def _either(sizes: list[int]) -> str:
    """`2`, `2 or 3`, `2, 4 or 8`; "none" when no size keeps the batch."""
    if not sizes:
        return "none (no world size keeps the global batch)"
    if len(sizes) == 1:
        return str(sizes[0])
    return f"{', '.join(map(str, sizes[:-1]))} or {sizes[-1]}"


def _choose_checkpoint(world: JobWorld,
                       placement: Placement | None = None) -> CheckpointEntry | MemorySnapshot | None | str:
    """The checkpoint to start from: the operator's choice, else an in-memory snapshot newer than the
    newest good checkpoint that the nodes of `placement` hold, else the newest good one; None: from
    scratch; a string: why there is none although the job has saved some (never silently restart
    a long job from step 0 because its checkpoints cannot be read)."""
    good = [c for c in world.catalog if c.good]
    wanted = world.record.resume_from_step
    if wanted is not None:
        chosen = [c for c in good if c.step == wanted]
        if chosen:
            return chosen[0]
    else:
        snapshot = _memory_snapshot(world, placement)
        if snapshot is not None and (not good or snapshot.step > good[-1].step):
            return snapshot
    if good:
        return good[-1]
    unreadable = [c for c in world.catalog if c.problem]
    if unreadable:
        return (f"no readable checkpoint is left ({len(unreadable)} could not be loaded, the newest at step "
                f"{unreadable[-1].step}: {unreadable[-1].problem})")
    return None
