"""Carries out the job's decisions: commits them to etcd (fenced compare-and-swap), then tells agents.

Level-triggered: `reconcile` runs on every coordinator pass and right after a process exits; it
reads the job record, the current generation and what agents reported, calls the pure `decide`,
and applies each action so that applying it twice changes nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from daemon.clock import Clock
from daemon.config import JobSettings
from daemon.events import EventLog
from daemon.job.commands import LaunchCommand, StopCommand
from daemon.job.decide import JobWorld, LaunchGeneration, SetJobState, StopGeneration, decide
from daemon.job.launch_plan import node_processes, scheduler_port
from daemon.job.observation import GenerationObservation, ProcessReport, ProgressReport
from daemon.job.placement import NodeOffer, Placement, place
from daemon.job.rank_table import rank_table_json
from daemon.job.state import Failure, GenerationRecord, JobRecord
from daemon.leader import LeadershipLost
from daemon.store import codec, keys
from daemon.store.interface import Fence, Store
from proto.vocabulary import JobState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankView:
    rank: int
    node: str
    step: int
    loss: float
    samples_per_s: float


@dataclass(frozen=True)
class JobView:
    name: str
    state: JobState
    generation: int
    world_size: int
    restarts: int
    step: int | None
    loss: float | None
    samples_per_s: float | None
    ranks: tuple[RankView, ...]
    last_failure: Failure | None


class JobController:
    def __init__(self, *, store: Store, spec: JobSettings, events: EventLog, clock: Clock,
                 send: Callable[[str, object], bool]) -> None:
        self._store = store
        self.spec = spec
        self._events = events
        self._clock = clock
        self._send = send
        self.record = JobRecord(JobState.PENDING)
        self._record_revision = 0
        self.generation: GenerationRecord | None = None
        self.observation: GenerationObservation | None = None
        self._placeable_since: float | None = None

    # ------------------------------------------------------------ durable state

    async def load(self, fence: Fence) -> None:
        """Take over the job as etcd has it (a new leader continues, it does not restart)."""
        name = self.spec.name
        spec_key = keys.job_spec(name)
        current_spec = await self._store.get(spec_key)
        wanted = codec.encode(self.spec.model_dump(mode="json"))
        if current_spec is None or current_spec.value != wanted:
            await self._store.compare_and_swap(spec_key, wanted, 0 if current_spec is None else current_spec.mod_revision,
                                               fence=fence)
        status = await self._store.get(keys.job_status(name))
        if status is None:
            await self._write_record(JobRecord(JobState.PENDING), fence)
        else:
            self.record = JobRecord.from_json(codec.decode(status.value, key=status.key))
            self._record_revision = status.mod_revision
        self.generation = None
        self.observation = None
        if self.record.generation:
            key = keys.generation(name, self.record.generation)
            kv = await self._store.get(key)
            if kv is not None:
                self.generation = GenerationRecord.from_json(codec.decode(kv.value, key=key))
                self.observation = GenerationObservation(self.generation.number)
        log.info("job %s: %s, generation %d", name, self.record.state.value, self.record.generation)

    async def _write_record(self, record: JobRecord, fence: Fence) -> None:
        revision = await self._store.compare_and_swap(
            keys.job_status(self.spec.name), codec.encode(record.to_json()), self._record_revision, fence=fence)
        if revision is None:
            raise LeadershipLost(f"job {self.spec.name}: status write refused (another leader, or a stale read)")
        self.record, self._record_revision = record, revision

    # ------------------------------------------------------------ reports from agents

    def _current(self, generation: int) -> GenerationObservation | None:
        """Reports about another generation than the current one are ignored (DESIGN.md)."""
        observation = self.observation
        return observation if observation is not None and observation.number == generation else None

    def process_report(self, generation: int, report: ProcessReport) -> bool:
        """Record a process's state; True when it changes something the decision depends on."""
        observation = self._current(generation)
        if observation is None:
            return False
        before = observation.processes.get((report.node, report.role, report.rank))
        observation.record_process(report)
        observation.launched.add(report.node)
        return before is None or before.running != report.running

    def progress_report(self, generation: int, node: str, report: ProgressReport) -> None:
        observation = self._current(generation)
        if observation is not None:
            observation.progress[report.rank] = report

    def stopped_report(self, generation: int, node: str) -> None:
        observation = self._current(generation)
        if observation is not None:
            observation.stopped.add(node)

    # ------------------------------------------------------------ reconcile

    async def reconcile(self, fence: Fence, offers: list[NodeOffer], lost_nodes: set[str]) -> None:
        now = self._clock.now()
        if self.generation is None and place(self.spec, offers) is not None:
            self._placeable_since = self._placeable_since if self._placeable_since is not None else now
        else:
            self._placeable_since = None
        world = JobWorld(self.spec, self.record, self.generation, self.observation, tuple(offers),
                         frozenset(lost_nodes), self._placeable_since, now)
        for action in decide(world):
            if isinstance(action, LaunchGeneration):
                await self._launch(action.placement, fence)
            elif isinstance(action, StopGeneration):
                await self._stop(action.reason, fence)
            elif isinstance(action, SetJobState):
                await self._set_state(action, fence)
        self._resend_launches()

    async def _launch(self, placement: Placement, fence: Fence) -> None:
        number = self.record.generation + 1
        generation = GenerationRecord(number, placement, scheduler_port(self.spec, number), rank_table_json(placement))
        key = keys.generation(self.spec.name, number)
        if await self._store.compare_and_swap(key, codec.encode(generation.to_json()), 0, fence=fence) is None:
            raise LeadershipLost(f"{key} exists already: another coordinator launched it")
        await self._write_record(self.record.moved_to(self.record.state, generation=number,
                                                      world_size=placement.world_size), fence)
        self.generation = generation
        self.observation = GenerationObservation(number)
        self._placeable_since = None
        await self._events.append(
            "generation_started",
            f"job {self.spec.name}: generation {number} on {len(placement.nodes)} node(s), world size "
            f"{placement.world_size}, gradient accumulation {placement.grad_accum}", fence,
            generation=number, nodes=placement.nodes, world_size=placement.world_size)
        self._resend_launches()

    def _resend_launches(self) -> None:
        """Every node of an active generation gets its Launch (agents ignore a repeat)."""
        generation, observation = self.generation, self.observation
        if generation is None or observation is None or self.record.state not in (
                JobState.PENDING, JobState.RUNNING, JobState.RECOVERING):
            return
        for node in generation.placement.nodes:
            if node in observation.launched:
                continue
            command = LaunchCommand(generation.number, self.spec.name,
                                    tuple(node_processes(self.spec, generation.placement, generation.number, node)),
                                    generation.rank_table_json)
            if self._send(node, command):
                observation.launched.add(node)

    async def _stop(self, reason: str, fence: Fence) -> None:
        generation, observation = self.generation, self.observation
        if generation is None or observation is None:
            return
        nodes = [n for n in generation.placement.nodes if n not in observation.stop_sent]
        for node in nodes:
            if self._send(node, StopCommand(generation.number, self.spec.stop_grace_s, reason)):
                observation.stop_sent.add(node)
        if nodes:
            log.info("job %s: stopping generation %d on %s: %s", self.spec.name, generation.number,
                     ", ".join(nodes), reason)

    async def _set_state(self, action: SetJobState, fence: Fence) -> None:
        failure = action.failure if action.failure is not None else self.record.last_failure
        await self._write_record(self.record.moved_to(action.state, last_failure=failure), fence)
        message = f"job {self.spec.name} is {action.state.value}"
        if action.failure is not None:
            message += f": {action.failure.message}"
        fields = {"generation": self.record.generation}
        if action.failure is not None:
            fields["failure"] = action.failure.to_json()
        await self._events.append(f"job_{action.state.value.lower()}", message, fence, **fields)

    # ------------------------------------------------------------ status

    def view(self) -> JobView:
        observation = self.observation
        ranks: tuple[RankView, ...] = ()
        step = loss = samples_per_s = None
        if observation is not None and self.generation is not None:
            node_of = {slot.rank: slot.node for slot in self.generation.placement.ranks}
            ranks = tuple(RankView(p.rank, node_of.get(p.rank, ""), p.step, p.loss, p.samples_per_s)
                          for p in sorted(observation.progress.values(), key=lambda p: p.rank))
            step = observation.min_step(self.generation.placement.world_size)
            if ranks:
                loss = sum(r.loss for r in ranks) / len(ranks)
                samples_per_s = sum(r.samples_per_s for r in ranks)
        return JobView(self.spec.name, self.record.state, self.record.generation, self.record.world_size,
                       self.record.restarts, step, loss, samples_per_s, ranks, self.record.last_failure)
