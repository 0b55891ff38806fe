"""Carries out the job's decisions: commits them to etcd (fenced compare-and-swap), then tells agents.

Level-triggered: `reconcile` runs on every coordinator pass and right after a report that matters
(a process exit, a committed checkpoint); it reads the job record, the current generation and what
agents reported, calls the pure `decide`, and applies each action so that applying it twice
changes nothing. Every decision is durable before it is acted on: a generation is written before
its Launch is sent, a stop is committed before Stop is sent, so a leader that takes over mid-way
carries on from etcd and never launches a generation twice.

The controller takes over the job (`load`, with the settings' diff), applies decisions and operator
commands, and records what reports left to record. The rooms beside it: reports come in through the
GenerationInbox (daemon/job/inbox.py), which holds the current generation and what was seen of it;
goodput is accounted and saved by the GoodputKeeper (daemon/job/goodput_keeper.py); the status view
and the job's metrics are built in daemon/job/view.py. A checkpoint's path must lie inside
job.checkpoint.dir, when it is recorded (the inbox) and again before a worker is told to resume from it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import assert_never

from common.clock import Clock
from daemon import metrics
from daemon.config import JobSettings
from daemon.errors import PermanentError
from daemon.events import EventKind, EventLog
from daemon.job.catalog import CheckpointCatalog, CheckpointEntry, inside_root
from daemon.job.commands import (
    CheckpointNowCommand,
    LaunchCommand,
    RequestExitCommand,
    StandbyCommand,
    StopCommand,
)
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
    RequestGracefulExit,
    StopGeneration,
    bad_memory_steps_after,
    decide,
    record_after_checkpoint,
    spares,
    waiting_for,
)
from daemon.job.goodput_keeper import GoodputKeeper, job_moment
from daemon.job.inbox import GenerationInbox
from daemon.job.launch_plan import node_processes, ring_predecessor, scheduler_port, standby_processes
from daemon.job.observation import GenerationObservation, MemorySnapshot
from daemon.job.placement import NodeOffer, usable_devices
from daemon.job.rank_table import rank_table_json
from daemon.job.skip_ledger import BadRange, SkipEntry, SkipLedger, checked
from daemon.job.state import (
    KEPT_GENERATION_RECORDS,
    GenerationRecord,
    JobRecord,
    ResumePoint,
    ResumeSource,
)
from daemon.job.timeline import RecoveryTimeline
from daemon.job.view import JobView, export_metrics, job_view
from daemon.store import codec, keys
from daemon.store.codec import BadValue
from daemon.store.fenced_cache import FencedCache
from daemon.store.interface import Fence, LeadershipLost, Store
from proto.vocabulary import JobState

log = logging.getLogger(__name__)


def kept_catalog_entries(keep: int) -> int:
    """Checkpoint catalog entries kept in etcd: twice the checkpoints the workers keep on disk (room for
    entries marked bad or superseded among them), at least 16."""
    return max(2 * keep, 16)


class CommandRefused(PermanentError):
    """An operator command that does not apply to the job as it is; the message says why."""


class CheckpointOutsideRoot(PermanentError):
    """The generation's checkpoint is not inside job.checkpoint.dir (etcd was changed by hand, or the
    directory was moved): no worker is told to resume from it. `trainerctl resume --from-step N`
    relaunches from a checkpoint inside it."""


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
        self._status = FencedCache(store, keys.job_status(spec.name), JobRecord.from_json)
        self.goodput = GoodputKeeper(store=store, job_name=spec.name, clock=clock, moment=lambda: job_moment(
            self.record, self.inbox.generation, self.inbox.observation))
        self.inbox = GenerationInbox(spec=spec, clock=clock, events=events, catalog=self.catalog, ledger=self.ledger,
                                     goodput=self.goodput)
        self._placeable_since: float | None = None
        self._checkpoint_request: CheckpointRequest | None = None
        self._exit_request: ExitRequest | None = None
        self._pause_asked_at: float | None = None
        self._stopping: asyncio.Future[str] | None = None  # trainerd is stopping: see prepare_to_stop
        self.recovery: RecoveryTimeline | None = None
        self._bad_memory_steps: frozenset[int] = frozenset()  # in-memory snapshots a generation could not load
        self._waiting_for = ""  # as of the last reconcile pass
        self._spares: tuple[str, ...] = ()  # as of the last reconcile pass
        # The node order of the last generation at each world size (decide.JobWorld.orders_seen).
        self._orders_seen: dict[int, tuple[str, ...]] = {}

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
        await self.goodput.load()
        self.inbox.reset()
        self._checkpoint_request = None
        self._exit_request = None
        self._pause_asked_at = None
        now = self._clock.now()
        await self._load_orders_seen()
        if self.record.generation:
            key = keys.generation(name, self.record.generation)
            kv = await self._store.get(key)
            if kv is not None:
                generation = GenerationRecord.from_json(codec.decode(kv.value, key=key))
                observation = GenerationObservation(
                    generation.number, started_at=now,
                    ran_before_takeover=self.record.state is JobState.RUNNING and not self.record.between_generations)
                if self.record.between_generations:
                    observation.stop_decided_at = now
                self.inbox.begin(generation, observation)
        if self.record.state is JobState.RECOVERING:
            self.recovery = RecoveryTimeline("takeover", now)
        if self.record.exit_requested_generation == self.record.generation and not self.record.between_generations:
            self._exit_request = ExitRequest("a graceful exit was asked for before this coordinator took over", now)
        if self.record.pausing:  # its wait for a checkpoint starts again from the takeover
            self._pause_asked_at = now
        self.goodput.account()
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
        state = JobState.PENDING if self.inbox.generation is None else JobState.RECOVERING
        return self.record.moved_to(state, crash_restarts=0, consecutive_crashes=0, node_failures={},
                                    crash_steps={}, resume_from_step=from_step)

    async def _write_record(self, record: JobRecord, fence: Fence) -> None:
        await self._status.put(keys.job_status(self.spec.name), record, fence)

    async def _load_orders_seen(self) -> None:
        """The node order of the newest kept generation at each world size, from their records: a new leader
        regrows a world on the nodes it had as the old one would, giving each node its ranks of then."""
        self._orders_seen = {}
        records, _ = await self._store.get_prefix(keys.generations(self.spec.name))
        for kv in records:  # by key: oldest generation first
            try:
                generation = GenerationRecord.from_json(codec.decode(kv.value, key=kv.key))
            except (BadValue, KeyError, TypeError, ValueError) as exc:  # a hint lost, not a reason to stop
                log.warning("job %s: skipping generation record %s: %s", self.spec.name, kv.key, exc)
                continue
            self._orders_seen[generation.placement.world_size] = tuple(generation.placement.nodes)
            self.inbox.remember_placement(generation)

    # ------------------------------------------------------------ reconcile

    async def reconcile(self, fence: Fence, facts: ClusterFacts) -> None:
        now = self._clock.now()
        await self._record_checkpoints(fence)
        await self._record_skips(fence)
        await self.inbox.record_events(fence)
        world = JobWorld(self.spec, self.record, self.inbox.generation, self.inbox.observation, tuple(facts.offers),
                         frozenset(facts.disconnected), frozenset(facts.lost), frozenset(facts.drained),
                         self.catalog.entries(), self.ledger.ranges(), self._placeable_since,
                         self._checkpoint_request, now, self._exit_request, self._bad_memory_steps,
                         dict(self._orders_seen), self.ledger.found_bad(), self._pause_asked_at,
                         stopping=self._stopping is not None)
        actions = decide(world)
        self._waiting_for = "" if any(isinstance(a, LaunchGeneration) for a in actions) else waiting_for(world)
        self._spares = spares(world)
        self._stand_by(world.offers)
        for action in actions:
            match action:
                case NotePlaceableSince():
                    self._placeable_since = action.since
                case EndStopPhase():
                    if self.inbox.observation is not None:
                        self.inbox.observation.all_stopped_at = action.at
                case CommitRecord():
                    await self._commit(action, fence)
                case StopGeneration():
                    self._stop(action.reason, action.dump_stacks, action.job_completed)
                case LaunchGeneration():
                    await self._launch(action, fence)
                case RequestCheckpoint():
                    await self._request_checkpoint(action, fence)
                case RequestGracefulExit():
                    self._request_exit(action)
                case ReadyToStop():
                    if self._stopping is not None and not self._stopping.done():
                        self._stopping.set_result(action.how)
                case MarkCheckpointBad():
                    resume = None if self.inbox.generation is None else self.inbox.generation.resume
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
        self.goodput.account()
        await self.goodput.save(fence)
        observation = self.inbox.observation
        export_metrics(self.view(), self.spec, self.catalog.entries(),
                       None if observation is None else observation.steps_per_s())

    async def _record_checkpoints(self, fence: Fence) -> None:
        while self.inbox.unrecorded_checkpoints:
            entry = self.inbox.unrecorded_checkpoints[0]
            await self.catalog.record(entry, fence)
            await self.catalog.forget_all_but_newest(kept_catalog_entries(self.spec.checkpoint.keep), fence)
            self.inbox.unrecorded_checkpoints.popleft()
            backoff_reset = record_after_checkpoint(self.record)
            if backoff_reset is not None:
                await self._write_record(backoff_reset, fence)
            await self._events.append(EventKind.CHECKPOINT_SAVED, f"job {self.spec.name}: checkpoint at step "
                                      f"{entry.step} ({entry.consumed_samples} samples) committed", fence,
                                      generation=entry.generation, step=entry.step, path=entry.path)

    async def _record_skips(self, fence: Fence) -> None:
        while self.inbox.unrecorded_skips:
            await self.add_skip(self.inbox.unrecorded_skips[0], fence)
            self.inbox.unrecorded_skips.popleft()

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
        observation = self.inbox.observation
        detect_s = 0.0
        if after.last_failure is not None and after.last_failure is not before.last_failure:
            detect_s = self.goodput.fault_detected(after.last_failure, observation, now)
        self.goodput.account()
        if after.stopped_generation > before.stopped_generation and observation is not None:
            observation.stop_decided_at = now
            self.inbox.note_idle()
        if action.recovery is not None:
            self.recovery = RecoveryTimeline(action.recovery, now, detect_s)
            metrics.RESTARTS.labels(action.recovery).inc()
        fields: dict = {"generation": after.generation}
        if after.last_failure is not None and after.last_failure is not before.last_failure:
            fields["failure"] = after.last_failure.to_json()
        if after.state is JobState.RUNNING and before.state is not JobState.RUNNING and self.recovery is not None:
            self.recovery.running_at = now
            if observation is not None:
                self.recovery.startups = dict(observation.startups)
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
            previous = self.inbox.observation
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
            self.recovery.lost_work_at_launch_s = self.goodput.lost_work_s()
        self._orders_seen[placement.world_size] = tuple(placement.nodes)
        self.inbox.begin(generation, GenerationObservation(number, started_at=now))
        self._checkpoint_request = None
        self._exit_request = None
        self._pause_asked_at = None
        self.goodput.account()
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
        generation, observation = self.inbox.generation, self.inbox.observation
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

    def _stand_by(self, offers: tuple[NodeOffer, ...]) -> None:
        """Each spare of the live generation is told once to stand by for it: the processes it would run in a lost
        node's place are then forked from warm templates, which a spare told nothing would start only then. A
        spare that leaves and comes back is told again (its agent may have started anew)."""
        generation, observation = self.inbox.generation, self.inbox.observation
        if generation is None or observation is None or self.record.between_generations:
            return
        observation.standing_by &= set(self._spares)
        by_name = {offer.name: offer for offer in offers}
        for node in self._spares:
            offer = by_name.get(node)
            if node in observation.standing_by or offer is None:
                continue
            devices = [d.device_id for d in usable_devices(self.spec, offer)]
            command = StandbyCommand(generation.number, self.spec.name,
                                     tuple(standby_processes(self.spec, generation.placement, generation.number,
                                                             devices)),
                                     workdir=self.spec.workdir or "")
            if self._send(node, command):
                observation.standing_by.add(node)
                log.info("job %s: node %s stands by for generation %d", self.spec.name, node, generation.number)

    def _stop(self, reason: str, dump_stacks: bool = False, job_completed: bool = False) -> None:
        generation, observation = self.inbox.generation, self.inbox.observation
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
        generation, observation = self.inbox.generation, self.inbox.observation
        assert generation is not None and observation is not None
        self._checkpoint_request = CheckpointRequest(action.step, self._clock.now())
        for node in generation.placement.nodes:
            self._send(node, CheckpointNowCommand(generation.number, action.step))
        await self._events.append(EventKind.CHECKPOINT_REQUESTED, f"job {self.spec.name}: checkpoint asked for at step "
                                  f"{action.step}: {action.reason}", fence, generation=generation.number,
                                  step=action.step)

    def _request_exit(self, action: RequestGracefulExit) -> None:
        generation = self.inbox.generation
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
        observation = self.inbox.observation
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

    # ------------------------------------------------------------ status

    def view(self) -> JobView:
        return job_view(spec=self.spec, record=self.record, generation=self.inbox.generation,
                        observation=self.inbox.observation, checkpoints=self.catalog.entries(),
                        skipped_batches=len(self.ledger.entries()), goodput=self.goodput.snapshot(),
                        recovery=self.recovery, waiting_for=self._waiting_for, warnings=self.inbox.warnings,
                        spares=self._spares)


def changed_settings(before: object, after: object, prefix: str = "") -> list[str]:
    """The dotted names of the settings that differ between two dumps of a job's settings
    (["entrypoint", "restart.max"]), in the order of `after`. A key only one dump has is a setting one
    trainerd version has and the other has not, not an operator's change: it is not counted (a dump holds
    every setting, given or default, so a key the operator adds to the file changes a value both have)."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        return [] if before == after else [prefix.rstrip(".") or "every setting"]
    return [name for key in after if key in before
            for name in changed_settings(before[key], after[key], f"{prefix}{key}.")]
