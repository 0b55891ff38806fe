"""The current generation's inbox: every report an agent sends about the job (daemon/job/reports.py) comes
in here, is bound to the generation's placement, and updates what the leader has seen of the generation
(its GenerationObservation, which the inbox holds with the generation's record).

Reports are bound to the placement: a worker's report counts only from the node its rank runs on in
that generation, the scheduler's and a checkpoint commit only from rank 0's node; anything else is
dropped with a warning (at most one a minute per node). A checkpoint's path must lie inside
job.checkpoint.dir. Reports about another generation than the current one are ignored.

What a report leaves to be made durable waits here for the controller's next reconcile: checkpoint
commits (for the catalog) and bad batches (for the skip ledger) the controller records itself; failed
saves, guard findings, worker warnings and refused launches become events through `record_events`.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, replace
from typing import assert_never

from common.clock import Clock
from daemon import metrics
from daemon.config import JobSettings
from daemon.events import EventKind, EventLog
from daemon.job.catalog import CheckpointCatalog, CheckpointEntry, inside_root
from daemon.job.goodput_keeper import GoodputKeeper
from daemon.job.observation import DEVICE_SUSPECTED, GenerationObservation, MemorySnapshot, WorkerNotice
from daemon.job.placement import Placement
from daemon.job.reports import (
    AgentReport,
    BatchSkipped,
    CheckpointCommitted,
    CheckpointFailed,
    GenerationStopped,
    GuardNoticed,
    HeartbeatReport,
    ProcessChanged,
    RankProgressed,
    WorkerWarned,
)
from daemon.job.skip_ledger import SkipEntry, SkipLedger, checked, samples_not_skipped
from daemon.job.snapshot_claims import admitted
from daemon.job.state import KEPT_GENERATION_RECORDS, GenerationRecord
from daemon.rate_limited_log import RateLimitedLog
from daemon.store.interface import Fence
from proto.vocabulary import CauseKind, ProcessRole

log = logging.getLogger(__name__)

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


class GenerationInbox:
    def __init__(self, *, spec: JobSettings, clock: Clock, events: EventLog, catalog: CheckpointCatalog,
                 ledger: SkipLedger, goodput: GoodputKeeper) -> None:
        self._spec = spec
        self._clock = clock
        self._events = events
        self._catalog = catalog
        self._ledger = ledger
        self._goodput = goodput
        self.generation: GenerationRecord | None = None
        self.observation: GenerationObservation | None = None
        # Taken by the controller's reconcile, oldest first, each once it is recorded.
        self.unrecorded_checkpoints: deque[CheckpointEntry] = deque()
        self.unrecorded_skips: deque[SkipEntry] = deque()
        # Failed saves (the first report of each step) and warnings (each text's first), with their node.
        self._unrecorded_failed_saves: deque[tuple[str, CheckpointFailed]] = deque()
        self._unrecorded_findings: deque[GuardFinding] = deque()
        self._unrecorded_warnings: deque[tuple[str, WorkerWarned]] = deque()
        self._unrecorded_refusals: deque[LaunchRefusal] = deque()
        self._warned: dict[str, None] = {}  # the warning texts in the order told (a dict keeps it)
        # The placement of each kept generation: whom it told to hold which in-memory snapshots.
        self._placements: dict[int, Placement] = {}
        self._dropped = RateLimitedLog(log, clock)

    @property
    def warnings(self) -> tuple[str, ...]:
        """The distinct worker warnings told while this coordinator led, oldest first."""
        return tuple(self._warned)

    def reset(self) -> None:
        """A takeover: no generation yet, nothing waiting to be recorded, no placement remembered."""
        self.generation = None
        self.observation = None
        self.unrecorded_checkpoints.clear()
        self.unrecorded_skips.clear()
        self._unrecorded_failed_saves.clear()
        self._unrecorded_findings.clear()
        self._unrecorded_warnings.clear()
        self._unrecorded_refusals.clear()
        self._placements = {}

    def begin(self, generation: GenerationRecord, observation: GenerationObservation) -> None:
        """`generation` is the current one from now on (launched, or found at a takeover)."""
        self.generation = generation
        self.observation = observation
        self.remember_placement(generation)

    def remember_placement(self, generation: GenerationRecord) -> None:
        """Whom each kept generation told to hold which snapshots: its placement (as many as etcd keeps)."""
        self._placements[generation.number] = generation.placement
        for number in [n for n in self._placements if n <= generation.number - KEPT_GENERATION_RECORDS]:
            del self._placements[number]

    # ------------------------------------------------------------ reports

    def take(self, node: str, report: AgentReport) -> bool:
        """Take `node`'s report; True when the job's reconcile should run now rather than at the next pass
        (a process exit, a stop confirmed, a new commit, a failed save, a guard's finding, a new warning,
        a bad batch)."""
        match report:
            case HeartbeatReport():
                self._heartbeat(node, report)
                return False
            case ProcessChanged():
                return self._process_changed(node, report) and not report.process.running
            case RankProgressed():
                self._progressed(node, report)
                return False
            case GenerationStopped():
                self._stopped(node, report)
                return True
            case CheckpointCommitted():
                return self._checkpoint_committed(node, report)
            case CheckpointFailed():
                return self._checkpoint_failed(node, report)
            case GuardNoticed():
                self._guard_noticed(node, report)
                return True
            case WorkerWarned():
                return self._worker_warned(node, report)
            case BatchSkipped():
                self._batch_skipped(node, report)
                return True
            case _:
                assert_never(report)

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
                              self._spec.name, node, what, "the scheduler" if rank == -1 else f"rank {rank}",
                              generation, where)
        return None

    def _heartbeat(self, node: str, report: HeartbeatReport) -> None:
        """The snapshots a heartbeat names count only once the agent runs the current generation (at its
        Launch it dropped those of an abandoned future)."""
        observation = self.observation
        if observation is not None:
            observation.heard(node, report.generation)
            observation.heard_at[node] = self._clock.now()
            memory, held = report.memory, report.held
            if report.generation != observation.number:
                # An agent on another generation (a restarted one runs none) holds nothing of this one.
                memory, held = None, ()
            self._note_snapshots(observation, node, memory, held)
            self.note_idle()

    def _process_changed(self, node: str, report: ProcessChanged) -> bool:
        """Record a process's state (stamped with when it arrived: the first failure is the
        earliest); True when it changes something the decision depends on."""
        process, generation = report.process, report.generation
        rank = -1 if process.role is ProcessRole.SCHEDULER else process.rank
        observation = self._placed(generation, node, rank, "a process report")
        if observation is None:
            return False
        before = observation.processes.get((process.node, process.role, process.rank))
        observation.record_process(replace(process, observed_at=self._clock.now()))
        refused = process.cause is not None and process.cause.kind == CauseKind.LAUNCH_REFUSED and not process.running
        if refused and node not in observation.launch_refused:
            assert process.cause is not None
            observation.launch_refused.add(node)
            self._unrecorded_refusals.append(LaunchRefusal(generation, node, process.cause.message))
        observation.launched.add(node)
        self.note_idle()
        return before is None or before.running != process.running

    def _progressed(self, node: str, report: RankProgressed) -> None:
        progress = report.progress
        observation = self._placed(report.generation, node, progress.rank, "progress")
        if observation is not None:
            observation.record_progress(progress, self._clock.now())
            self._goodput.progressed(report.generation, progress.checkpoint_stall_s)

    def _stopped(self, node: str, report: GenerationStopped) -> None:
        observation = self._current(report.generation)
        if observation is not None:
            observation.stopped.add(node)
            if report.memory is not None or report.held:
                self._note_snapshots(observation, node, report.memory, report.held)
            self.note_idle()

    def _checkpoint_committed(self, node: str, report: CheckpointCommitted) -> bool:
        """Rank 0 committed a checkpoint; it is recorded in etcd by the next reconcile. True when new.
        Only rank 0's node reports commits, and only of paths inside job.checkpoint.dir.

        An agent sends its newest commit again on every new session (a leader may have lost it): a
        commit of this generation that this leader was told of, or that the catalog already holds
        (recorded by the leader before), changes nothing; one it never heard of is recorded as new."""
        generation, step, path = report.generation, report.step, report.path
        observation = self._placed(generation, node, 0, "a checkpoint commit")
        if observation is None or self.generation is None:
            return False
        if not inside_root(self._spec.checkpoint.dir, path):
            metrics.AGENT_MESSAGES_DROPPED.labels("outside_checkpoint_dir").inc()
            self._dropped.warning(node, "job %s: node %s reported a checkpoint of step %d at %r, outside "
                                  "job.checkpoint.dir %s; dropped", self._spec.name, node, step, path[:200],
                                  self._spec.checkpoint.dir)
            return False
        reached = self.reached_step(observation)
        if step > reached:
            metrics.AGENT_MESSAGES_DROPPED.labels("beyond_progress").inc()
            self._dropped.warning(node, "job %s: node %s reported a checkpoint of step %d, beyond step %d, the "
                                  "newest the job reported; dropped", self._spec.name, node, step, reached)
            return False
        if not observation.add_checkpoint(step):
            return False
        recorded = self._catalog.get(step)
        if recorded is not None and recorded.generation == generation:
            return False
        self.unrecorded_checkpoints.append(CheckpointEntry(step, report.consumed_samples, path, generation,
                                                           self.generation.placement.world_size,
                                                           committed_at=self._clock.wall()))
        return True

    def _checkpoint_failed(self, node: str, report: CheckpointFailed) -> bool:
        """A rank's save failed: recorded as an event by the next reconcile (the first report of each step
        only: on a full disk every rank fails). True when new."""
        observation = self._placed(report.generation, node, report.rank, "a failed checkpoint")
        if observation is None or not observation.add_failed_checkpoint(report.step):
            return False
        self._unrecorded_failed_saves.append((node, report))
        return True

    def _guard_noticed(self, node: str, report: GuardNoticed) -> None:
        """A worker's replay of a refused step found a device fault or re-baselined its guard: an event."""
        generation, rank, notice = report.generation, report.rank, report.notice
        observation = self._placed(generation, node, rank, "a guard notice")
        if observation is None or self.generation is None or not observation.add_guard_notice(rank, notice.step):
            return
        if notice.kind == DEVICE_SUSPECTED:
            observation.suspect_device(node, self._clock.now())
        slot = next((s for s in self.generation.placement.ranks if s.rank == rank), None)
        self._unrecorded_findings.append(GuardFinding(generation, rank, node, None if slot is None else slot.device_id,
                                                      notice))

    def _worker_warned(self, node: str, report: WorkerWarned) -> bool:
        """Recorded as a job_warning event by the next reconcile, once per text while this coordinator leads
        (each generation finds it again). True when new."""
        text = report.text
        if self._placed(report.generation, node, report.rank, "a warning") is None or text in self._warned:
            return False
        if len(self._warned) >= MAX_JOB_WARNINGS:  # an agent sending text after text cannot grow the memory
            self._dropped.warning(node, "job %s: node %s sent more than %d distinct warnings; dropped",
                                  self._spec.name, node, MAX_JOB_WARNINGS)
            return False
        self._warned[text] = None
        self._unrecorded_warnings.append((node, report))
        return True

    def _batch_skipped(self, node: str, report: BatchSkipped) -> None:
        """A worker's guard skipped a step: its samples go into the ledger at the next reconcile."""
        generation, batch = report.generation, report.batch
        observation = self._placed(generation, node, report.rank, "a bad batch")
        if observation is None:
            return
        global_batch = self._spec.global_batch
        if global_batch is not None and samples_not_skipped(batch.sample_start, batch.sample_end,
                                                            self._ledger.ranges()) > global_batch:
            # A worker skips one global batch at a time: a wider range would drop good data for good.
            log.warning("node %s reported a bad batch at step %d of samples %d:%d, more than one global batch "
                        "(%d) not already skipped: ignored", node, batch.step, batch.sample_start,
                        batch.sample_end, global_batch)
            return
        if not observation.add_bad_batch(batch):
            return
        try:
            entry = checked(batch.sample_start, batch.sample_end, f"{batch.reason} (loss {batch.loss:.4g}, "
                            f"grad norm {batch.grad_norm:.4g})", batch.step, generation)
        except ValueError as exc:
            log.warning("node %s reported an unusable bad batch at step %d: %s", node, batch.step, exc)
            return
        self.unrecorded_skips.append(entry)

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

    def reached_step(self, observation: GenerationObservation) -> int:
        """The newest step the job can have reached: the furthest any rank of this generation reported, where
        the generation resumed from, or the newest checkpoint recorded. No node's claim goes beyond it (an
        agent sends its ranks' progress before a commit or a heartbeat that names a snapshot of it)."""
        start = 0 if self.generation is None else self.generation.start_step
        committed = max((entry.step for entry in self._catalog.entries()), default=0)
        return max(observation.max_step() or 0, start, committed)

    def _note_snapshots(self, observation: GenerationObservation, node: str, memory: MemorySnapshot | None,
                        held: tuple[MemorySnapshot, ...]) -> None:
        """What the node's agent holds now replaces what it held before, as far as it binds
        (daemon/job/snapshot_claims.py): a claim the coordinator never asked for is dropped, with a warning."""
        claims = admitted(node, memory, held, self._placements, observation.number, self.reached_step(observation))
        if claims.refused:
            metrics.AGENT_MESSAGES_DROPPED.labels("unbound_snapshot").inc(len(claims.refused))
            self._dropped.warning(node, "job %s: node %s claimed in-memory snapshots it cannot hold; dropped: %s",
                                  self._spec.name, node, "; ".join(claims.refused))
        if claims.memory is None:
            observation.memory_snapshots.pop(node, None)
        else:
            observation.memory_snapshots[node] = claims.memory
        if claims.held:
            observation.held_snapshots[node] = claims.held
        else:
            observation.held_snapshots.pop(node, None)

    def note_idle(self) -> None:
        """Once the generation's stop was decided, the moment every one of its nodes is idle ends the stop phase."""
        observation, generation = self.observation, self.generation
        if (observation is None or observation.stop_decided_at is None or observation.all_stopped_at is not None
                or generation is None or generation.number != observation.number):
            return
        if all(observation.node_idle(n) for n in generation.placement.nodes):
            observation.all_stopped_at = self._clock.now()

    # ------------------------------------------------------------ events

    async def record_events(self, fence: Fence) -> None:
        """The events of what reports told since the last reconcile: failed saves, guard findings, worker
        warnings, refused launches (each removed once written: a store error leaves it for the next pass)."""
        await self._record_failed_saves(fence)
        await self._record_guard_findings(fence)
        await self._record_warnings(fence)
        await self._record_refusals(fence)

    async def _record_failed_saves(self, fence: Fence) -> None:
        name = self._spec.name
        while self._unrecorded_failed_saves:
            node, failed = self._unrecorded_failed_saves[0]
            newest = max((entry.step for entry in self._catalog.entries() if entry.good), default=None)
            await self._events.append(
                EventKind.CHECKPOINT_FAILED, f"job {name}: the checkpoint of step {failed.step} failed on "
                f"rank {failed.rank} (node {node}): {failed.reason}; training goes on, the last committed "
                f"checkpoint is {'none' if newest is None else f'step {newest}'}", fence,
                generation=failed.generation, step=failed.step, rank=failed.rank, node=node, reason=failed.reason)
            self._unrecorded_failed_saves.popleft()

    async def _record_guard_findings(self, fence: Fence) -> None:
        name = self._spec.name
        while self._unrecorded_findings:
            found = self._unrecorded_findings[0]
            notice = found.notice
            if notice.kind == DEVICE_SUSPECTED:
                kind = EventKind.DEVICE_SUSPECTED
                device = "" if found.device_id is None else f" (device {found.device_id})"
                message = (f"job {name}: rank {found.rank} on node {found.node}{device} computed step "
                           f"{notice.step} otherwise when it was replayed ({notice.detail}): its device is "
                           f"suspected; the step was taken from the replay and no samples were skipped")
            else:
                kind = EventKind.GUARD_REBASELINED
                message = (f"job {name}: the bad-batch guard re-baselined at step {notice.step} "
                           f"({notice.detail}): more reproduced spikes than a bad batch makes, so its statistics "
                           f"are learnt afresh and none of those steps is skipped")
            await self._events.append(kind, message, fence, generation=found.generation, step=notice.step,
                                      rank=found.rank, node=found.node)
            self._unrecorded_findings.popleft()

    async def _record_warnings(self, fence: Fence) -> None:
        while self._unrecorded_warnings:
            node, warning = self._unrecorded_warnings[0]
            await self._events.append(EventKind.JOB_WARNING, f"job {self._spec.name}: {warning.text}", fence,
                                      generation=warning.generation, rank=warning.rank, node=node)
            self._unrecorded_warnings.popleft()

    async def _record_refusals(self, fence: Fence) -> None:
        """Each node whose agent refused a generation's Launch: one `launch_refused` event with the agent's
        reason (a refusal once left the job PENDING with no word of why)."""
        while self._unrecorded_refusals:
            refusal = self._unrecorded_refusals[0]
            await self._events.append(
                EventKind.LAUNCH_REFUSED, f"job {self._spec.name}: node {refusal.node} refused to launch "
                f"generation {refusal.generation}: {refusal.reason}", fence, generation=refusal.generation,
                node=refusal.node, reason=refusal.reason)
            self._unrecorded_refusals.popleft()
