"""Carries out the job's decisions: commits them to etcd (fenced compare-and-swap), then tells agents.

Level-triggered: `reconcile` runs on every coordinator pass and right after a report that matters
(a process exit, a committed checkpoint); it reads the job record, the current generation and what
agents reported, calls the pure `decide`, and applies each action so that applying it twice
changes nothing. Every decision is durable before it is acted on: a generation is written before
its Launch is sent, a stop is committed before Stop is sent, so a leader that takes over mid-way
carries on from etcd and never launches a generation twice.

Reports are bound to the placement: a worker's report counts only from the node its rank runs on in
that generation, the scheduler's and a checkpoint commit only from rank 0's node; anything else is
dropped with a warning (at most one a minute per node). A checkpoint's path must lie inside
job.checkpoint.dir, when it is recorded and again before a worker is told to resume from it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import assert_never

from common.clock import Clock
from daemon import metrics
from daemon.config import JobSettings
from daemon.errors import PermanentError
from daemon.events import EventKind, EventLog
from daemon.job.catalog import CheckpointCatalog, CheckpointEntry, inside_root
from daemon.job.commands import CheckpointNowCommand, LaunchCommand, RequestExitCommand, StopCommand
from daemon.job.decide import (
    PAUSE_SAVE_WAIT_S,
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
    RequestExit,
    StopGeneration,
    bad_memory_steps_after,
    decide,
    record_after_checkpoint,
    waiting_for,
)
from daemon.job.goodput import GoodputAccountant, GoodputSnapshot, JobMoment, Phase, fault_time
from daemon.job.launch_plan import node_processes, ring_predecessor, scheduler_port
from daemon.job.observation import (
    DEVICE_SUSPECTED,
    GenerationObservation,
    MemorySnapshot,
    ProcessReport,
    ProgressReport,
    SkippedBatch,
    WorkerNotice,
)
from daemon.job.placement import NodeOffer, Placement
from daemon.job.rank_table import rank_table_json
from daemon.job.skip_ledger import BadRange, SkipEntry, SkipLedger, checked, samples_not_skipped
from daemon.job.snapshot_claims import admitted
from daemon.job.state import Failure, GenerationRecord, JobRecord, ResumePoint, ResumeSource
from daemon.job.timeline import RecoveryTimeline
from daemon.leader import LeadershipLost
from daemon.rate_limited_log import RateLimitedLog
from daemon.store import codec, keys
from daemon.store.codec import BadValue
from daemon.store.fenced_cache import FencedCache
from daemon.store.interface import Fence, Store
from proto.vocabulary import CauseKind, JobState, ProcessRole

log = logging.getLogger(__name__)

# Generation records (placement and rank table, in etcd) kept besides the current one's: `trainerctl logs
# --generation G` finds through them where a rank of G ran. As many as an agent keeps generations' files
# (agent/generation_dirs.py); a job that restarts for weeks would otherwise fill etcd with rank tables.
KEPT_GENERATION_RECORDS = 32


def kept_catalog_entries(keep: int) -> int:
    """Checkpoint catalog entries kept in etcd: twice the checkpoints the workers keep on disk (room for
    entries marked bad or superseded among them), at least 16."""
    return max(2 * keep, 16)

# The leader saves the goodput totals this often, and whenever the phase changes: a leader that
# dies takes at most this much of the current phase's accounting detail with it (see GoodputAccountant).
GOODPUT_SAVE_INTERVAL_S = 5.0


class CommandRefused(PermanentError):
    """An operator command that does not apply to the job as it is; the message says why."""


class CheckpointOutsideRoot(PermanentError):
    """The generation's checkpoint is not inside job.checkpoint.dir (etcd was changed by hand, or the
    directory was moved): no worker is told to resume from it. `trainerctl resume --from-step N`
    relaunches from a checkpoint inside it."""


@dataclass(frozen=True)
class RankView:
    rank: int
    node: str
    step: int
    loss: float
    samples_per_s: float
    epoch: int | None = None
    from_output: bool = False  # read from the rank's output, not sent by the trainer runtime
    grad_norm: float = 0.0


@dataclass(frozen=True)
class JobView:
    name: str
    state: JobState
    generation: int
    world_size: int
    restarts: int
    crash_restarts: int
    restart_budget: int
    step: int | None
    last_checkpoint_step: int | None
    loss: float | None
    samples_per_s: float | None
    ranks: tuple[RankView, ...]
    last_failure: Failure | None
    last_recovery: RecoveryTimeline | None
    quarantined: frozenset[str]
    skipped_batches: int
    node_crashes: Mapping[str, int]  # the crashes counted against each node (JobRecord.node_failures)
    epoch: int | None = None  # the lowest epoch a rank reported from its output
    hang_detection: bool = False  # a rank of the live generation showed progress: hangs are judged
    goodput: GoodputSnapshot | None = None
    grad_norm: float | None = None  # the global norm: every rank of the runtime reports the same one
    waiting_for: str = ""  # what a job not launched yet, or WAITING, waits for (decide.waiting_for)
    pausing: bool = False  # RUNNING, asked to pause: it saves a checkpoint (or leaves gracefully) first
    warnings: tuple[str, ...] = ()  # what the workers found risky about the job (job_warning), oldest first


# The distinct worker warnings one coordinator records for a job (a script has a few at most).
MAX_JOB_WARNINGS = 100


@dataclass(frozen=True)
class GuardFinding:
    """A rank's word of what a replay of its step found other than bad data, waiting for its event."""

    generation: int
    rank: int
    node: str
    device_id: int | None
    notice: WorkerNotice


@dataclass(frozen=True)
class LaunchRefusal:
    """A node's agent refused the generation's Launch (CauseKind.LAUNCH_REFUSED), waiting for its event."""

    generation: int
    node: str
    reason: str


@dataclass(frozen=True)
class FailedSave:
    """A rank's report that its save of `step` failed, waiting for its event."""

    generation: int
    step: int
    rank: int
    node: str
    reason: str


@dataclass(frozen=True)
class ClusterFacts:
    """What the coordinator knows of the nodes, for one reconcile pass."""

    offers: list[NodeOffer]  # READY, connected, not drained
    disconnected: set[str]
    lost: set[str]
    drained: set[str]


class JobController:
    def __init__(self, *, store: Store, spec: JobSettings, events: EventLog, clock: Clock,
                 send: Callable[[str, object], bool]) -> None:
        self._store = store
        self.spec = spec
        self._events = events
        self._clock = clock
        self._send = send
        self.catalog = CheckpointCatalog(store, spec.name)
        self.ledger = SkipLedger(store, spec.name)
        self._unrecorded_skips: list[SkipEntry] = []
        self._status = FencedCache(store, keys.job_status(spec.name), JobRecord.from_json)
        self.generation: GenerationRecord | None = None
        self.observation: GenerationObservation | None = None
        self._placeable_since: float | None = None
        self._checkpoint_request: CheckpointRequest | None = None
        self._exit_request: ExitRequest | None = None
        self._pause_asked_at: float | None = None
        self._stopping: asyncio.Future[str] | None = None  # trainerd is stopping: see prepare_to_stop
        self._unrecorded_checkpoints: list[CheckpointEntry] = []
        self._unrecorded_failed_saves: deque[FailedSave] = deque()
        self._unrecorded_findings: deque[GuardFinding] = deque()
        # Worker warnings (generation, rank, node, text) waiting for their event, and the texts told already.
        self._unrecorded_warnings: deque[tuple[int, int, str, str]] = deque()
        self._warned: dict[str, None] = {}  # the texts in the order told (a dict keeps it)
        self._unrecorded_refusals: deque[LaunchRefusal] = deque()
        self.recovery: RecoveryTimeline | None = None
        self._bad_memory_steps: frozenset[int] = frozenset()  # in-memory snapshots a generation could not load
        self._waiting_for = ""  # as of the last reconcile pass
        # The node order of the last generation at each world size (decide.JobWorld.orders_seen).
        self._orders_seen: dict[int, tuple[str, ...]] = {}
        # The placement of each kept generation: whom it told to hold which in-memory snapshots.
        self._placements: dict[int, Placement] = {}
        self._dropped = RateLimitedLog(log, clock)
        self._goodput_store = FencedCache(store, keys.job_goodput(spec.name), _saved_goodput)
        self.goodput = GoodputAccountant(clock)
        self._goodput_saved: tuple[float, Phase | None] | None = None  # when, and in which phase

    # ------------------------------------------------------------ durable state

    @property
    def record(self) -> JobRecord:
        """The job's status record as etcd has it (PENDING until `load` reads or writes it)."""
        record = self._status.get(keys.job_status(self.spec.name))
        return JobRecord(JobState.PENDING) if record is None else record

    async def load(self, fence: Fence) -> None:
        """Take over the job as etcd has it (a new leader continues, it does not restart)."""
        name = self.spec.name
        spec_key = keys.job_spec(name)
        current_spec = await self._store.get(spec_key)
        wanted = codec.encode(self.spec.model_dump(mode="json"))
        changed: list[str] = []
        if current_spec is not None and current_spec.value != wanted:
            try:
                stored: object = codec.decode(current_spec.value, key=spec_key)
            except BadValue as exc:  # unreadable: overwritten below, and counted as a change
                log.warning("job %s: %s", name, exc)
                stored = None
            changed = changed_settings(stored, self.spec.model_dump(mode="json"))
        await self._status.load()
        if self._status.get(keys.job_status(name)) is None:
            await self._write_record(JobRecord(JobState.PENDING), fence)
        await self.catalog.load()
        await self.ledger.load()
        await self._goodput_store.load()
        self.goodput = GoodputAccountant(self._clock, self._goodput_store.get(keys.job_goodput(name)))
        self._goodput_saved = None
        self._unrecorded_skips = []
        self.generation = None
        self.observation = None
        self._checkpoint_request = None
        self._exit_request = None
        self._pause_asked_at = None
        self._unrecorded_checkpoints = []
        self._unrecorded_failed_saves = deque()
        self._unrecorded_findings = deque()
        self._unrecorded_warnings = deque()
        self._unrecorded_refusals = deque()
        now = self._clock.now()
        await self._load_orders_seen()
        if self.record.generation:
            key = keys.generation(name, self.record.generation)
            kv = await self._store.get(key)
            if kv is not None:
                self.generation = GenerationRecord.from_json(codec.decode(kv.value, key=key))
                self.observation = GenerationObservation(
                    self.generation.number, started_at=now,
                    ran_before_takeover=self.record.state is JobState.RUNNING and not self.record.between_generations)
                if self.record.between_generations:
                    self.observation.stop_decided_at = now
        if self.record.state is JobState.RECOVERING:
            self.recovery = RecoveryTimeline("takeover", now)
        if self.record.exit_requested_generation == self.record.generation and not self.record.between_generations:
            self._exit_request = ExitRequest("a graceful exit was asked for before this coordinator took over", now)
        if self.record.pausing:  # its wait for a checkpoint starts again from the takeover
            self._pause_asked_at = now
        self._account()
        log.info("job %s: %s, generation %d", name, self.record.state.value, self.record.generation)
        await self._apply_changed_settings(changed, fence)
        if current_spec is None or current_spec.value != wanted:  # after the record: a change is never half-applied
            revision = 0 if current_spec is None else current_spec.mod_revision
            await self._store.compare_and_swap(spec_key, wanted, revision, fence=fence)

    async def _apply_changed_settings(self, changed: list[str], fence: Fence) -> None:
        """A job the cluster file changed runs again when it had ended (an operator who edits a COMPLETED or
        FAILED job and restarts the coordinator wants the edit run, e.g. more epochs); a live job keeps its
        processes and launches the next generation with the new settings."""
        name, state = self.spec.name, self.record.state
        if not changed:
            if state is JobState.COMPLETED:
                log.info("job %s is COMPLETED: nothing to run. Change the job in the cluster file to run it again "
                         "from its newest checkpoint, or give it a new name to start afresh", name)
            elif state is JobState.FAILED:
                log.info("job %s is FAILED: once its cause is fixed, `trainerctl resume` runs it again from its "
                         "newest checkpoint (so does a change to the job in the cluster file)", name)
            return
        what = ", ".join(changed)
        if state not in (JobState.COMPLETED, JobState.FAILED):
            log.warning("job %s: the cluster file changed %s; the processes running now keep what they were "
                        "launched with until the next generation, timeouts and limits apply at once", name, what)
            return
        again = self._started_over(from_step=None)
        await self._commit(CommitRecord(again, EventKind.JOB_CHANGED, recovery="resume", message=
                                        f"job {name} is {again.state.value}: the cluster file changed {what} of the "
                                        f"{state.value} job; it runs again from the newest checkpoint"), fence)

    def _started_over(self, from_step: int | None) -> JobRecord:
        """The record of the job starting again from a checkpoint (the newest, or `from_step`), with its
        restart budget, crash counts and node failures cleared."""
        state = JobState.PENDING if self.generation is None else JobState.RECOVERING
        return self.record.moved_to(state, crash_restarts=0, consecutive_crashes=0, node_failures={},
                                    crash_steps={}, resume_from_step=from_step)

    async def _write_record(self, record: JobRecord, fence: Fence) -> None:
        await self._status.put(keys.job_status(self.spec.name), record, fence)

    # ------------------------------------------------------------ reports from agents

    def _current(self, generation: int) -> GenerationObservation | None:
        """Reports about another generation than the current one are ignored (docs/concepts/generations.md)."""
        observation = self.observation
        return observation if observation is not None and observation.number == generation else None

    def _placed(self, generation: int, node: str, rank: int, what: str) -> GenerationObservation | None:
        """The current generation's observation when `rank` (-1: the scheduler) runs on `node` in it.
        None for another generation; a report from a node the rank does not run on is dropped too,
        with a warning."""
        observation, record = self._current(generation), self.generation
        if observation is None or record is None:
            return None
        placed_on = record.placement.scheduler_node if rank == -1 else record.placement.node_of(rank)
        if placed_on == node:
            return observation
        metrics.AGENT_MESSAGES_DROPPED.labels("not_placed").inc()
        where = "not in it" if placed_on is None else f"on node {placed_on}"
        self._dropped.warning(node, "job %s: node %s sent %s of %s in generation %d, which runs %s; dropped",
                              self.spec.name, node, what, "the scheduler" if rank == -1 else f"rank {rank}",
                              generation, where)
        return None

    def process_report(self, generation: int, report: ProcessReport) -> bool:
        """Record a process's state (stamped with when it arrived: the first failure is the
        earliest); True when it changes something the decision depends on."""
        rank = -1 if report.role is ProcessRole.SCHEDULER else report.rank
        observation = self._placed(generation, report.node, rank, "a process report")
        if observation is None:
            return False
        before = observation.processes.get((report.node, report.role, report.rank))
        observation.record_process(replace(report, observed_at=self._clock.now()))
        refused = report.cause is not None and report.cause.kind == CauseKind.LAUNCH_REFUSED and not report.running
        if refused and report.node not in observation.launch_refused:
            assert report.cause is not None
            observation.launch_refused.add(report.node)
            self._unrecorded_refusals.append(LaunchRefusal(generation, report.node, report.cause.message))
        observation.launched.add(report.node)
        self._note_idle(observation)
        return before is None or before.running != report.running

    def session_opened(self, node: str) -> bool:
        """A node's agent opened a new session. What was sent into its previous one may never have arrived
        (the agent's end of a stream can close before the coordinator's does), so a node of the generation
        that has reported none of its processes is due its Launch again, and one that has not confirmed
        its Stop the Stop (an agent ignores a repeat of either); True when one is due."""
        generation, observation = self.generation, self.observation
        if generation is None or observation is None or node not in generation.placement.nodes:
            return False
        if observation.stop_decided_at is not None:
            if node not in observation.stop_sent or node in observation.stopped:
                return False
            del observation.stop_sent[node]  # the next pass stops it again if it still runs anything
            return True
        if node not in observation.launched or any(key[0] == node for key in observation.processes):
            return False
        observation.launched.discard(node)
        return True

    def heartbeat(self, node: str, generation: int, memory: MemorySnapshot | None = None,
                  held: tuple[MemorySnapshot, ...] = ()) -> None:
        """`memory`: the newest in-memory snapshot the node's agent holds whole, `held`: those of which it
        holds some ranks' files; counted only once the agent runs the current generation (at its Launch
        it dropped those of an abandoned future)."""
        observation = self.observation
        if observation is not None:
            observation.heard(node, generation)
            observation.heard_at[node] = self._clock.now()
            if generation != observation.number:
                # An agent on another generation (a restarted one runs none) holds nothing of this one.
                memory, held = None, ()
            self._note_snapshots(observation, node, memory, held)
            self._note_idle(observation)

    def progress_report(self, generation: int, node: str, report: ProgressReport) -> None:
        observation = self._placed(generation, node, report.rank, "progress")
        if observation is not None:
            observation.record_progress(report, self._clock.now())
            self.goodput.checkpoint_stall(generation, report.checkpoint_stall_s)
            self._account()

    def stopped_report(self, generation: int, node: str, memory: MemorySnapshot | None = None,
                       held: tuple[MemorySnapshot, ...] = ()) -> None:
        """The node stopped the generation; `memory` and `held`: the in-memory snapshots its agent holds
        then (fresher than its last heartbeat's, and what the relaunch, decided next, may resume from)."""
        observation = self._current(generation)
        if observation is not None:
            observation.stopped.add(node)
            if memory is not None or held:
                self._note_snapshots(observation, node, memory, held)
            self._note_idle(observation)

    def checkpoint_saved(self, generation: int, node: str, step: int, consumed_samples: int, path: str) -> bool:
        """Rank 0 committed a checkpoint; it is recorded in etcd by the next reconcile. True when new.
        Only rank 0's node reports commits, and only of paths inside job.checkpoint.dir.

        An agent sends its newest commit again on every new session (a leader may have lost it): a
        commit of this generation that this leader was told of, or that the catalog already holds
        (recorded by the leader before), changes nothing; one it never heard of is recorded as new."""
        observation = self._placed(generation, node, 0, "a checkpoint commit")
        if observation is None or self.generation is None:
            return False
        if not inside_root(self.spec.checkpoint.dir, path):
            metrics.AGENT_MESSAGES_DROPPED.labels("outside_checkpoint_dir").inc()
            self._dropped.warning(node, "job %s: node %s reported a checkpoint of step %d at %r, outside "
                                  "job.checkpoint.dir %s; dropped", self.spec.name, node, step, path[:200],
                                  self.spec.checkpoint.dir)
            return False
        reached = self._reached_step(observation)
        if step > reached:
            metrics.AGENT_MESSAGES_DROPPED.labels("beyond_progress").inc()
            self._dropped.warning(node, "job %s: node %s reported a checkpoint of step %d, beyond step %d, the "
                                  "newest the job reported; dropped", self.spec.name, node, step, reached)
            return False
        if not observation.add_checkpoint(step):
            return False
        recorded = self.catalog.get(step)
        if recorded is not None and recorded.generation == generation:
            return False
        self._unrecorded_checkpoints.append(CheckpointEntry(step, consumed_samples, path, generation,
                                                            self.generation.placement.world_size,
                                                            committed_at=self._clock.wall()))
        return True

    def checkpoint_failed(self, generation: int, node: str, rank: int, step: int, reason: str) -> bool:
        """A rank's save of `step` failed: recorded as an event by the next reconcile (the first report of
        each step only: on a full disk every rank fails). True when new."""
        observation = self._placed(generation, node, rank, "a failed checkpoint")
        if observation is None or not observation.add_failed_checkpoint(step):
            return False
        self._unrecorded_failed_saves.append(FailedSave(generation, step, rank, node, reason))
        return True

    def guard_notice(self, generation: int, node: str, rank: int, notice: WorkerNotice) -> None:
        """A worker's replay of a refused step found a device fault or re-baselined its guard: an event."""
        observation = self._placed(generation, node, rank, "a guard notice")
        if observation is None or self.generation is None or not observation.add_guard_notice(rank, notice.step):
            return
        if notice.kind == DEVICE_SUSPECTED:
            observation.suspect_device(node, self._clock.now())
        slot = next((s for s in self.generation.placement.ranks if s.rank == rank), None)
        self._unrecorded_findings.append(GuardFinding(generation, rank, node, None if slot is None else slot.device_id,
                                                      notice))

    def worker_warning(self, generation: int, node: str, rank: int, text: str) -> bool:
        """A worker found something risky about the job (it may work): recorded as a job_warning event by the
        next reconcile, once per text while this coordinator leads (each generation finds it again). True
        when new."""
        if self._placed(generation, node, rank, "a warning") is None or text in self._warned:
            return False
        if len(self._warned) >= MAX_JOB_WARNINGS:  # an agent sending text after text cannot grow the memory
            self._dropped.warning(node, "job %s: node %s sent more than %d distinct warnings; dropped",
                                  self.spec.name, node, MAX_JOB_WARNINGS)
            return False
        self._warned[text] = None
        self._unrecorded_warnings.append((generation, rank, node, text))
        return True

    def bad_batch(self, generation: int, node: str, rank: int, report: SkippedBatch) -> None:
        """A worker's guard skipped a step: its samples go into the ledger at the next reconcile."""
        observation = self._placed(generation, node, rank, "a bad batch")
        if observation is None:
            return
        batch = self.spec.global_batch
        if batch is not None and samples_not_skipped(report.sample_start, report.sample_end,
                                                     self.ledger.ranges()) > batch:
            # A worker skips one global batch at a time: a wider range would drop good data for good.
            log.warning("node %s reported a bad batch at step %d of samples %d:%d, more than one global batch "
                        "(%d) not already skipped: ignored", node, report.step, report.sample_start,
                        report.sample_end, batch)
            return
        if not observation.add_bad_batch(report):
            return
        try:
            entry = checked(report.sample_start, report.sample_end, f"{report.reason} (loss {report.loss:.4g}, "
                            f"grad norm {report.grad_norm:.4g})", report.step, generation)
        except ValueError as exc:
            log.warning("node %s reported an unusable bad batch at step %d: %s", node, report.step, exc)
            return
        self._unrecorded_skips.append(entry)

    def _reached_step(self, observation: GenerationObservation) -> int:
        """The newest step the job can have reached: the furthest any rank of this generation reported, where
        the generation resumed from, or the newest checkpoint recorded. No node's claim goes beyond it (an
        agent sends its ranks' progress before a commit or a heartbeat that names a snapshot of it)."""
        start = 0 if self.generation is None else self.generation.start_step
        committed = max((entry.step for entry in self.catalog.entries()), default=0)
        return max(observation.max_step() or 0, start, committed)

    def _note_snapshots(self, observation: GenerationObservation, node: str, memory: MemorySnapshot | None,
                        held: tuple[MemorySnapshot, ...]) -> None:
        """What the node's agent holds now replaces what it held before, as far as it binds
        (daemon/job/snapshot_claims.py): a claim the coordinator never asked for is dropped, with a warning."""
        claims = admitted(node, memory, held, self._placements, observation.number, self._reached_step(observation))
        if claims.refused:
            metrics.AGENT_MESSAGES_DROPPED.labels("unbound_snapshot").inc(len(claims.refused))
            self._dropped.warning(node, "job %s: node %s claimed in-memory snapshots it cannot hold; dropped: %s",
                                  self.spec.name, node, "; ".join(claims.refused))
        if claims.memory is None:
            observation.memory_snapshots.pop(node, None)
        else:
            observation.memory_snapshots[node] = claims.memory
        if claims.held:
            observation.held_snapshots[node] = claims.held
        else:
            observation.held_snapshots.pop(node, None)

    def _remember_placement(self, generation: GenerationRecord) -> None:
        """Whom each kept generation told to hold which snapshots: its placement (as many as etcd keeps)."""
        self._placements[generation.number] = generation.placement
        for number in [n for n in self._placements if n <= generation.number - KEPT_GENERATION_RECORDS]:
            del self._placements[number]

    def _note_idle(self, observation: GenerationObservation) -> None:
        if (observation.stop_decided_at is None or observation.all_stopped_at is not None
                or self.generation is None or self.generation.number != observation.number):
            return
        if all(observation.node_idle(n) for n in self.generation.placement.nodes):
            observation.all_stopped_at = self._clock.now()

    async def _load_orders_seen(self) -> None:
        """The node order of the newest kept generation at each world size, from their records: a new leader
        regrows a world on the nodes it had as the old one would, giving each node its ranks of then."""
        self._orders_seen = {}
        self._placements = {}
        records, _ = await self._store.get_prefix(keys.generations(self.spec.name))
        for kv in records:  # by key: oldest generation first
            try:
                generation = GenerationRecord.from_json(codec.decode(kv.value, key=kv.key))
            except (BadValue, KeyError, TypeError, ValueError) as exc:  # a hint lost, not a reason to stop
                log.warning("job %s: skipping generation record %s: %s", self.spec.name, kv.key, exc)
                continue
            self._orders_seen[generation.placement.world_size] = tuple(generation.placement.nodes)
            self._remember_placement(generation)

    # ------------------------------------------------------------ reconcile

    async def reconcile(self, fence: Fence, facts: ClusterFacts) -> None:
        now = self._clock.now()
        await self._record_checkpoints(fence)
        await self._record_skips(fence)
        await self._record_failed_saves(fence)
        await self._record_guard_findings(fence)
        await self._record_warnings(fence)
        await self._record_refusals(fence)
        world = JobWorld(self.spec, self.record, self.generation, self.observation, tuple(facts.offers),
                         frozenset(facts.disconnected), frozenset(facts.lost), frozenset(facts.drained),
                         self.catalog.entries(), self.ledger.ranges(), self._placeable_since,
                         self._checkpoint_request, now, self._exit_request, self._bad_memory_steps,
                         dict(self._orders_seen), self.ledger.found_bad(), self._pause_asked_at,
                         stopping=self._stopping is not None)
        actions = decide(world)
        self._waiting_for = "" if any(isinstance(a, LaunchGeneration) for a in actions) else waiting_for(world)
        for action in actions:
            match action:
                case NotePlaceableSince():
                    self._placeable_since = action.since
                case EndStopPhase():
                    if self.observation is not None:
                        self.observation.all_stopped_at = action.at
                case CommitRecord():
                    await self._commit(action, fence)
                case StopGeneration():
                    self._stop(action.reason, action.dump_stacks, action.job_completed)
                case LaunchGeneration():
                    await self._launch(action, fence)
                case RequestCheckpoint():
                    await self._request_checkpoint(action, fence)
                case RequestExit():
                    self._request_exit(action)
                case ReadyToStop():
                    if self._stopping is not None and not self._stopping.done():
                        self._stopping.set_result(action.how)
                case MarkCheckpointBad():
                    resume = None if self.generation is None else self.generation.resume
                    if resume is not None and resume.source is ResumeSource.MEMORY and resume.step == action.step:
                        self._bad_memory_steps = bad_memory_steps_after(self._bad_memory_steps, action.step,
                                                                        self.catalog.entries())
                        await self._events.append(
                            EventKind.SNAPSHOT_UNUSABLE, f"job {self.spec.name}: the in-memory snapshot of step "
                            f"{action.step} could not be loaded and is not used again (the next generation resumes "
                            f"from the next newest source): {action.problem}", fence, step=action.step,
                            problem=action.problem)
                    else:
                        await self.catalog.mark_bad(action.step, action.problem, fence)
                case AddSkip():
                    try:
                        entry = checked(action.start, action.end, action.reason, action.step, self.record.generation)
                    except BadRange as exc:
                        log.warning("job %s: generation %d: the skip decided at step %d cannot be recorded: %s",
                                    self.spec.name, self.record.generation, action.step, exc)
                        continue
                    await self.add_skip(entry, fence)
                case _:
                    assert_never(action)
        self._resend_launches()
        self._account()
        await self._save_goodput(fence)
        self._export_metrics()

    async def _record_checkpoints(self, fence: Fence) -> None:
        while self._unrecorded_checkpoints:
            entry = self._unrecorded_checkpoints[0]
            await self.catalog.record(entry, fence)
            await self.catalog.forget_all_but_newest(kept_catalog_entries(self.spec.checkpoint.keep), fence)
            self._unrecorded_checkpoints.pop(0)
            backoff_reset = record_after_checkpoint(self.record)
            if backoff_reset is not None:
                await self._write_record(backoff_reset, fence)
            await self._events.append(EventKind.CHECKPOINT_SAVED, f"job {self.spec.name}: checkpoint at step "
                                      f"{entry.step} ({entry.consumed_samples} samples) committed", fence,
                                      generation=entry.generation, step=entry.step, path=entry.path)

    async def _record_failed_saves(self, fence: Fence) -> None:
        while self._unrecorded_failed_saves:
            failed = self._unrecorded_failed_saves[0]
            newest = max((entry.step for entry in self.catalog.entries() if entry.good), default=None)
            await self._events.append(
                EventKind.CHECKPOINT_FAILED, f"job {self.spec.name}: the checkpoint of step {failed.step} failed on "
                f"rank {failed.rank} (node {failed.node}): {failed.reason}; training goes on, the last committed "
                f"checkpoint is {'none' if newest is None else f'step {newest}'}", fence,
                generation=failed.generation, step=failed.step, rank=failed.rank, node=failed.node,
                reason=failed.reason)
            self._unrecorded_failed_saves.popleft()

    async def _record_guard_findings(self, fence: Fence) -> None:
        while self._unrecorded_findings:
            found = self._unrecorded_findings[0]
            notice = found.notice
            if notice.kind == DEVICE_SUSPECTED:
                kind = EventKind.DEVICE_SUSPECTED
                device = "" if found.device_id is None else f" (device {found.device_id})"
                message = (f"job {self.spec.name}: rank {found.rank} on node {found.node}{device} computed step "
                           f"{notice.step} otherwise when it was replayed ({notice.detail}): its device is "
                           f"suspected; the step was taken from the replay and no samples were skipped")
            else:
                kind = EventKind.GUARD_REBASELINED
                message = (f"job {self.spec.name}: the bad-batch guard re-baselined at step {notice.step} "
                           f"({notice.detail}): more reproduced spikes than a bad batch makes, so its statistics "
                           f"are learnt afresh and none of those steps is skipped")
            await self._events.append(kind, message, fence, generation=found.generation, step=notice.step,
                                      rank=found.rank, node=found.node)
            self._unrecorded_findings.popleft()

    async def _record_warnings(self, fence: Fence) -> None:
        while self._unrecorded_warnings:
            generation, rank, node, text = self._unrecorded_warnings[0]
            await self._events.append(EventKind.JOB_WARNING, f"job {self.spec.name}: {text}", fence,
                                      generation=generation, rank=rank, node=node)
            self._unrecorded_warnings.popleft()

    async def _record_refusals(self, fence: Fence) -> None:
        """Each node whose agent refused a generation's Launch: one `launch_refused` event with the agent's
        reason (a refusal once left the job PENDING with no word of why)."""
        while self._unrecorded_refusals:
            refusal = self._unrecorded_refusals[0]
            await self._events.append(
                EventKind.LAUNCH_REFUSED, f"job {self.spec.name}: node {refusal.node} refused to launch generation "
                f"{refusal.generation}: {refusal.reason}", fence, generation=refusal.generation, node=refusal.node,
                reason=refusal.reason)
            self._unrecorded_refusals.popleft()

    async def _record_skips(self, fence: Fence) -> None:
        while self._unrecorded_skips:
            await self.add_skip(self._unrecorded_skips[0], fence)
            self._unrecorded_skips.pop(0)

    async def add_skip(self, entry: SkipEntry, fence: Fence) -> bool:
        """Record a ledger entry (and its event); later generations leave its samples out."""
        if not await self.ledger.add(entry, fence):
            return False
        await self._events.append(EventKind.SAMPLES_SKIPPED, f"job {self.spec.name}: samples {entry.start}:{entry.end} "
                                  f"are skipped from now on: {entry.reason}", fence, start=entry.start,
                                  end=entry.end, step=entry.step, generation=entry.generation)
        return True

    async def _commit(self, action: CommitRecord, fence: Fence) -> None:
        before = self.record
        await self._write_record(action.record, fence)
        now = self._clock.now()
        after = self.record
        observation = self.observation
        if after.last_failure is not None and after.last_failure is not before.last_failure:
            self.goodput.fault_detected(fault_time(after.last_failure, observation, now, self.goodput.known_until))
        self._account()
        if after.stopped_generation > before.stopped_generation and observation is not None:
            observation.stop_decided_at = now
            self._note_idle(observation)
        if action.recovery is not None:
            self.recovery = RecoveryTimeline(action.recovery, now)
            metrics.RESTARTS.labels(action.recovery).inc()
        fields: dict = {"generation": after.generation}
        if after.last_failure is not None and after.last_failure is not before.last_failure:
            fields["failure"] = after.last_failure.to_json()
        if after.state is JobState.RUNNING and before.state is not JobState.RUNNING and self.recovery is not None:
            self.recovery.running_at = now
            phases = self.recovery.phases()
            for phase, seconds in phases.items():
                metrics.RECOVERY_PHASE.labels(phase).observe(seconds)
            fields["recovery"] = {"cause": self.recovery.cause, **phases}
        await self._events.append(action.event, action.message, fence, **fields)

    async def _launch(self, action: LaunchGeneration, fence: Fence) -> None:
        placement, checkpoint, number = action.placement, action.checkpoint, action.record.generation
        if isinstance(checkpoint, CheckpointEntry) and not inside_root(self.spec.checkpoint.dir, checkpoint.path):
            # Recorded before job.checkpoint.dir moved, or written into etcd by hand: the next pass
            # chooses another.
            problem = f"{checkpoint.path} is not inside job.checkpoint.dir {self.spec.checkpoint.dir}"
            log.error("job %s: generation %d does not resume from step %d: %s", self.spec.name, number,
                      checkpoint.step, problem)
            await self.catalog.mark_bad(checkpoint.step, problem, fence)
            return
        if checkpoint is None:
            resume = None
        elif isinstance(checkpoint, MemorySnapshot):
            resume = ResumePoint(checkpoint.step, checkpoint.consumed_samples, "", ResumeSource.MEMORY,
                                 checkpoint.holders)
        else:
            resume = ResumePoint(checkpoint.step, checkpoint.consumed_samples, checkpoint.path)
        generation = GenerationRecord(number, placement, scheduler_port(self.spec, number),
                                      rank_table_json(placement), resume, action.peer_addresses)
        key = keys.generation(self.spec.name, number)
        if await self._store.compare_and_swap(key, codec.encode(generation.to_json()), 0, fence=fence) is None:
            raise LeadershipLost(f"{key} exists already: another coordinator launched it")
        if number > KEPT_GENERATION_RECORDS:
            await self._store.delete_range(keys.generation(self.spec.name, 0),
                                           keys.generation(self.spec.name, number - KEPT_GENERATION_RECORDS + 1),
                                           fence=fence)
        await self._write_record(action.record, fence)
        if checkpoint is not None:
            await self.catalog.supersede_after(checkpoint.step, fence)
        now = self._clock.now()
        if self.recovery is not None:
            previous = self.observation
            stopped_at = None if previous is None else previous.all_stopped_at
            # A resume (or a changed job run again) starts with its processes stopped long since: no stop phase.
            self.recovery.stopped_at = now if stopped_at is None else max(stopped_at, self.recovery.detected_at)
            self.recovery.launched_at = now
            # A script trainerd reads its progress from resumes from its own checkpoints, if it keeps any:
            # where it resumes and how much it redoes are not known here (its printed steps say later).
            # A leader that took the job over (running, paused or failed) may have heard no step of it: the
            # record says how its last running generation reported them.
            own_resume = resume is None and previous is not None and (
                not previous.runtime_progress if previous.progress else self.record.steps_from_output)
            self.recovery.resumed_from_step = None if own_resume else generation.start_step
            self.recovery.resumed_from = "" if resume is None else resume.source.value
            reached = None if previous is None or own_resume else previous.max_step()
            self.recovery.lost_steps = None if reached is None else max(0, reached - generation.start_step)
        self.generation = generation
        self._orders_seen[placement.world_size] = tuple(placement.nodes)
        self._remember_placement(generation)
        self.observation = GenerationObservation(number, started_at=now)
        self._checkpoint_request = None
        self._exit_request = None
        self._pause_asked_at = None
        self._account()
        if resume is None:
            where = "from scratch" if number == 1 else ("with no checkpoint of trainerd's (a script that saves its "
                                                         "own resumes from those)")
        elif resume.source is ResumeSource.MEMORY:
            holders = sorted({h.node for h in resume.holders}) or list(placement.nodes)
            where = f"from the in-memory snapshot at step {resume.step} held by {', '.join(holders)}"
        else:
            where = f"from the checkpoint at step {resume.step}"
        if action.memory_shortfall:
            where += f" ({action.memory_shortfall})"
        await self._events.append(
            EventKind.GENERATION_STARTED,
            f"job {self.spec.name}: generation {number} on {len(placement.nodes)} node(s), world size "
            f"{placement.world_size}, gradient accumulation {placement.grad_accum}, {where}", fence,
            generation=number, nodes=placement.nodes, world_size=placement.world_size,
            resume_step=generation.start_step, resumed_from="" if resume is None else resume.source.value)
        self._resend_launches()

    def _resend_launches(self) -> None:
        """Every node of a live generation gets its Launch (agents ignore a repeat)."""
        generation, observation = self.generation, self.observation
        if generation is None or observation is None or self.record.between_generations:
            return
        if observation.ran_before_takeover:
            # Sent again, it would start a node's lost processes afresh from the generation's first checkpoint,
            # beside peers far past it: such a node ends the generation instead (decide, PROCESSES_GONE).
            return
        if (generation.resume is not None and generation.resume.source is ResumeSource.DISK
                and not inside_root(self.spec.checkpoint.dir, generation.resume.path)):
            raise CheckpointOutsideRoot(
                f"job {self.spec.name}: generation {generation.number} resumes from {generation.resume.path}, "
                f"outside job.checkpoint.dir {self.spec.checkpoint.dir}; it is not launched")
        placement, peers = generation.placement, generation.peer_addresses
        peers_serve = all(node in peers for node in placement.nodes)
        for node in placement.nodes:
            if node in observation.launched:
                continue
            predecessor = ring_predecessor(placement, node)
            command = LaunchCommand(generation.number, self.spec.name,
                                    tuple(node_processes(self.spec, placement, generation.number, node,
                                                         generation.resume, peers_serve)),
                                    generation.rank_table_json,
                                    "" if generation.resume is None else generation.resume.path,
                                    self.ledger.ranges(), workdir=self.spec.workdir or "",
                                    graceful_exit_file=self.spec.graceful_exit_file or "",
                                    progress_pattern=self.spec.progress_pattern or "",
                                    snapshot_sources=() if generation.resume is None else generation.resume.holders,
                                    copy_from=(predecessor, peers[predecessor])
                                    if peers_serve and predecessor is not None else None,
                                    peer_nodes=tuple(placement.nodes))
            if self._send(node, command):
                observation.launched.add(node)

    def _stop(self, reason: str, dump_stacks: bool = False, job_completed: bool = False) -> None:
        generation, observation = self.generation, self.observation
        if generation is None or observation is None:
            return
        if observation.stop_decided_at is None:
            observation.stop_decided_at = self._clock.now()
        sent = [node for node in generation.placement.nodes if node not in observation.stop_sent
                and self._send(node, StopCommand(generation.number, self.spec.stop_grace_s, reason, dump_stacks,
                                                 job_completed))]
        for node in sent:
            observation.stop_sent[node] = self._clock.now()
        if sent:  # a node not connected yet is sent its Stop (and named here) on a later pass
            log.info("job %s: stopping generation %d on %s%s: %s", self.spec.name, generation.number,
                     ", ".join(sent), " (stacks dumped first)" if dump_stacks else "", reason)

    async def _request_checkpoint(self, action: RequestCheckpoint, fence: Fence) -> None:
        generation, observation = self.generation, self.observation
        assert generation is not None and observation is not None
        self._checkpoint_request = CheckpointRequest(action.step, self._clock.now())
        for node in generation.placement.nodes:
            self._send(node, CheckpointNowCommand(generation.number, action.step))
        await self._events.append(EventKind.CHECKPOINT_REQUESTED, f"job {self.spec.name}: checkpoint asked for at step "
                                  f"{action.step}: {action.reason}", fence, generation=generation.number,
                                  step=action.step)

    def _request_exit(self, action: RequestExit) -> None:
        generation = self.generation
        assert generation is not None
        self._exit_request = ExitRequest(action.reason, self._clock.now())
        for node in generation.placement.nodes:
            self._send(node, RequestExitCommand(generation.number))

    # ------------------------------------------------------------ operator commands

    def prepare_to_stop(self) -> asyncio.Future[str]:
        """trainerd is stopping and takes its local agents, the processes they run and their in-memory snapshots
        with it: from the next pass on, a running generation saves first and nothing new is launched
        (decide._save_before_stopping). The future is resolved with how the job became ready to stop."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_future()
        return self._stopping

    async def pause(self, fence: Fence, now: bool = False) -> str:
        """A running generation that can save (trainerd's runtime, or a script with a graceful exit file)
        saves a checkpoint or leaves at a step boundary first, and the job is PAUSED once it has
        (decide._pause); with `now`, or when it cannot, the generation is stopped at once."""
        record, name = self.record, self.spec.name
        if record.state is JobState.PAUSED:
            return f"job {name} is already PAUSED"
        if record.state in (JobState.COMPLETED, JobState.FAILED):
            raise CommandRefused(f"job {name} is {record.state.value}; nothing to pause")
        observation = self.observation
        can_save = (record.state is JobState.RUNNING and not record.between_generations and observation is not None
                    and (observation.uses_runtime or self.spec.graceful_exit_file is not None))
        first = ("saves a checkpoint" if observation is not None and observation.uses_runtime
                 else "leaves through the script's graceful exit")
        if can_save and not now:
            if record.pausing:
                return f"job {name} is already pausing: generation {record.generation} {first} first"
            asked = record.moved_to(record.state, pause_requested_generation=record.generation)
            await self._commit(CommitRecord(asked, EventKind.PAUSE_REQUESTED, f"job {name}: the operator asked for a "
                                            f"pause; generation {record.generation} {first} first, then it is PAUSED"),
                               fence)
            self._pause_asked_at = self._clock.now()
            return (f"job {name} is pausing: generation {record.generation} {first} first, then it is PAUSED (at "
                    f"most {PAUSE_SAVE_WAIT_S:g}s; `trainerctl pause --now` stops it at once)")
        await self._commit(CommitRecord(record.moved_to(JobState.PAUSED, stopped_generation=record.generation,
                                                        pause_requested_generation=0),
                                        EventKind.JOB_PAUSED, f"job {name} is PAUSED by the operator"), fence)
        self._stop("paused by the operator")
        return f"job {name} is PAUSED; generation {record.generation} is being stopped"

    async def resume(self, fence: Fence, from_step: int | None) -> str:
        record = self.record
        if record.pausing and from_step is None:
            await self._commit(CommitRecord(record.moved_to(record.state, pause_requested_generation=0),
                                            EventKind.PAUSE_CANCELLED, f"job {self.spec.name} is {record.state.value}: "
                                            f"the pause asked for is called off"), fence)
            self._pause_asked_at = None
            return f"job {self.spec.name} is {record.state.value}: the pause asked for is called off"
        if record.state not in (JobState.PAUSED, JobState.FAILED):
            hint = (": change the job in the cluster file and restart the coordinator to run it again"
                    if record.state is JobState.COMPLETED else "")
            raise CommandRefused(f"job {self.spec.name} is {record.state.value}; only a PAUSED or FAILED job "
                                 f"can be resumed{hint}")
        if from_step is not None:
            entry = self.catalog.get(from_step)
            good = sorted(c.step for c in self.catalog.entries() if c.good)
            if entry is None or not entry.good:
                raise CommandRefused(f"no usable checkpoint at step {from_step}; usable steps: "
                                     f"{', '.join(map(str, good)) or 'none'}")
        resumed = self._started_over(from_step)
        state = resumed.state
        if from_step is not None:
            where = f"the checkpoint at step {from_step}"
        else:
            newest = max((c.step for c in self.catalog.entries() if c.good), default=None)
            if newest is None and record.steps_from_output:  # a script read from its output
                where = "the script's own newest checkpoint, if it keeps one"
            elif newest is None:
                where = "its first step: no checkpoint was committed (an in-memory snapshot still held goes first)"
            else:
                where = f"the newest checkpoint, step {newest} (or a newer in-memory snapshot)"
        await self._commit(CommitRecord(resumed, EventKind.JOB_RESUMED, recovery="resume", message=
                                        f"job {self.spec.name} is {state.value}: resumed by the operator from "
                                        f"{where}"), fence)
        return f"job {self.spec.name} is {state.value}: restarting from {where}"

    async def forget_node_failures(self, node: str, fence: Fence) -> None:
        """An operator undrained the node: its crash count, and so its quarantine, is cleared."""
        if node in self.record.node_failures:
            failures = {n: c for n, c in self.record.node_failures.items() if n != node}
            await self._write_record(self.record.moved_to(self.record.state, node_failures=failures), fence)

    # ------------------------------------------------------------ goodput

    async def stand_down(self, fence: Fence) -> None:
        """This leader stops: the goodput totals are saved as of now, so the next leader accounts exactly the
        time without one, and knows the furthest step reached (lost work when it is trained again)."""
        self._account()
        await self._save_goodput(fence, at_once=True)

    def _account(self) -> None:
        """Let the goodput accountant see the job as it is now (daemon/job/goodput.py)."""
        record, generation, observation = self.record, self.generation, self.observation
        live = generation is not None and observation is not None and not record.between_generations
        progressing = live and observation is not None and (observation.progress_seen
                                                             or record.state is JobState.RUNNING)
        position = observation.newest_position if live and observation is not None else None
        self.goodput.observe(JobMoment(record.state, record.generation > 0, live, progressing, position))

    async def _save_goodput(self, fence: Fence, at_once: bool = False) -> None:
        """Save the totals every GOODPUT_SAVE_INTERVAL_S and on every change of phase; `at_once`: now."""
        now, phase = self._clock.now(), self.goodput.phase
        saved = self._goodput_saved
        if not at_once and saved is not None and saved[1] is phase and (
                phase is None or now - saved[0] < GOODPUT_SAVE_INTERVAL_S):
            return
        await self._goodput_store.put(keys.job_goodput(self.spec.name), self.goodput.snapshot(), fence)
        self._goodput_saved = (now, phase)

    def _export_metrics(self) -> None:
        view, name = self.view(), self.spec.name
        assert view.goodput is not None
        metrics.JOB_GOODPUT_RATIO.labels(name).set(view.goodput.ratio)
        for phase in Phase:
            metrics.JOB_PHASE_SECONDS.labels(name, phase.value).set(view.goodput.seconds.get(phase, 0.0))
        metrics.set_job_gauge(metrics.JOB_STEP, name, view.step)
        metrics.set_job_gauge(metrics.JOB_LOSS, name, view.loss)
        metrics.set_job_gauge(metrics.JOB_SAMPLES_PER_SECOND, name, view.samples_per_s)
        metrics.set_job_gauge(metrics.JOB_STEP_SECONDS, name, self._step_seconds(view))
        metrics.set_job_state(name, view.state.value, [state.value for state in JobState])
        metrics.JOB_RESTART_BUDGET.labels(name).set(view.restart_budget)
        metrics.JOB_RESTART_BUDGET_SPENT.labels(name).set(view.crash_restarts)
        newest = next((entry for entry in reversed(self.catalog.entries()) if entry.good), None)
        metrics.set_job_gauge(metrics.JOB_CHECKPOINT_STEP, name, None if newest is None else newest.step)
        metrics.set_job_gauge(metrics.JOB_CHECKPOINT_TIME, name, None if newest is None else newest.committed_at)

    def _step_seconds(self, view: JobView) -> float | None:
        if self.spec.global_batch is not None and view.samples_per_s:
            return self.spec.global_batch / view.samples_per_s
        steps_per_s = None if self.observation is None else self.observation.steps_per_s()
        return 1 / steps_per_s if steps_per_s else None

    def forget_metrics(self) -> None:
        """This coordinator stands down: the new leader exports the job's series."""
        metrics.forget_job(self.spec.name, [phase.value for phase in Phase], [state.value for state in JobState])

    # ------------------------------------------------------------ status

    def view(self) -> JobView:
        observation = self.observation
        ranks: tuple[RankView, ...] = ()
        step = loss = samples_per_s = epoch = grad_norm = None
        hang_detection = False
        if observation is not None and self.generation is not None:
            node_of = {slot.rank: slot.node for slot in self.generation.placement.ranks}
            ranks = tuple(RankView(p.rank, node_of.get(p.rank, ""), p.step, p.loss, p.samples_per_s, p.epoch,
                                   p.from_output, p.grad_norm)
                          for p in sorted(observation.progress.values(), key=lambda p: p.rank))
            step = observation.min_step(self.generation.placement.world_size)
            if ranks:
                loss = sum(r.loss for r in ranks) / len(ranks)
                # The runtime reports the global rate on every rank; a rate read from output is the rank's.
                runtime = [r.samples_per_s for r in ranks if not r.from_output]
                samples_per_s = max(runtime) if runtime else sum(r.samples_per_s for r in ranks)
                grad_norm = max((r.grad_norm for r in ranks if not r.from_output), default=None)
            epoch = min((r.epoch for r in ranks if r.epoch is not None), default=None)
            hang_detection = observation.progress_seen and not self.record.between_generations
        goodput = self.goodput.snapshot()
        if step is None and self.record.state is JobState.COMPLETED and goodput.high_water is not None:
            # Progress is not kept in etcd, but the furthest position reached is: a COMPLETED job taken over
            # by a new leader (a coordinator restarted) still shows where it ended.
            epoch = goodput.high_water[0] if goodput.high_water[0] >= 0 else None
            step = goodput.high_water[1]
        good = [c.step for c in self.catalog.entries() if c.good]
        return JobView(self.spec.name, self.record.state, self.record.generation, self.record.world_size,
                       self.record.restarts, self.record.crash_restarts, self.spec.restart.max, step,
                       good[-1] if good else None, loss, samples_per_s, ranks, self.record.last_failure,
                       self.recovery, self.record.quarantined(self.spec.restart.quarantine_after),
                       len(self.ledger.entries()), dict(self.record.node_failures), epoch, hang_detection, goodput,
                       grad_norm,
                       self._waiting_for if self.record.state in (JobState.PENDING, JobState.WAITING) else "",
                       self.record.pausing, tuple(self._warned))


def changed_settings(before: object, after: object, prefix: str = "") -> list[str]:
    """The dotted names of the settings that differ between two dumps of a job's settings
    (["entrypoint", "restart.max"]), in the order of `after`. A key only one dump has is a setting one
    trainerd version has and the other has not, not an operator's change: it is not counted (a dump holds
    every setting, given or default, so a key the operator adds to the file changes a value both have)."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        return [] if before == after else [prefix.rstrip(".") or "every setting"]
    return [name for key in after if key in before
            for name in changed_settings(before[key], after[key], f"{prefix}{key}.")]


def _saved_goodput(data: dict) -> GoodputSnapshot:
    """The saved totals; ones this trainerd cannot read are started over (a warning), never a reason
    for a leader not to lead."""
    try:
        return GoodputSnapshot.from_json(data)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        log.warning("the saved goodput totals cannot be read (%s); counting starts over", exc)
        return GoodputSnapshot(phase=None)
