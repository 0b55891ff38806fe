"""A simulated cluster for the job's decision logic: the real Coordinator and JobController on the
in-memory store with a fake clock, and scripted agents that record the commands they get and send
the reports a test tells them to. No processes, no sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from common.clock import FakeClock
from daemon.config import JobSettings
from daemon.coordinator import AgentHello, AgentSession, Coordinator
from daemon.job.commands import CheckpointNowCommand, LaunchCommand, RequestExitCommand, StopCommand
from daemon.job.observation import MemorySnapshot, ProcessReport, ProgressReport, RootCause, SkippedBatch
from daemon.job.reports import (
    BatchSkipped,
    CheckpointCommitted,
    GenerationStopped,
    HeartbeatReport,
    ProcessChanged,
    RankProgressed,
)
from daemon.leader import LeaderRecord
from daemon.membership import DeviceInfo
from daemon.store.memory import InMemoryStore
from proto.progress_datagram import StartupTimes
from proto.vocabulary import JobState, ProcessRole

HEARTBEAT_TIMEOUT_S = 5.0
SESSION_GRACE_S = 2.0
GLOBAL_BATCH = 12


def job_settings(**overrides) -> JobSettings:
    settings = dict(name="job", entrypoint=["{python}", "-m", "train"], min_nodes=1, max_nodes=3,
                    global_batch=GLOBAL_BATCH, micro_batch=1, start_wait_s=0, stop_grace_s=5.0,
                    hang_timeout_s=60.0, checkpoint={"dir": "/ckpt", "every_steps": 10},
                    restart={"max": 3, "backoff_s": 1.0, "max_backoff_s": 8.0, "quarantine_after": 3})
    settings.update(overrides)
    return JobSettings.model_validate(settings)


@dataclass
class SimAgent:
    name: str
    session: AgentSession | None = None
    token: str = ""
    commands: list[object] = field(default_factory=list)
    generation: int = 0
    memory: MemorySnapshot | None = None  # the in-memory snapshot its heartbeats report
    held: tuple[MemorySnapshot, ...] = ()  # the snapshots of which its heartbeats report holding some ranks

    def launches(self) -> list[LaunchCommand]:
        return [c for c in self.commands if isinstance(c, LaunchCommand)]

    def stops(self) -> list[StopCommand]:
        return [c for c in self.commands if isinstance(c, StopCommand)]

    def checkpoint_requests(self) -> list[CheckpointNowCommand]:
        return [c for c in self.commands if isinstance(c, CheckpointNowCommand)]

    def exit_requests(self) -> list[RequestExitCommand]:
        return [c for c in self.commands if isinstance(c, RequestExitCommand)]


class SimCluster:
    def __init__(self, spec: JobSettings, store: InMemoryStore | None = None, clock: FakeClock | None = None,
                 name: str = "c1", peer_port: int = 0, **coordinator_options) -> None:
        self.clock = clock or FakeClock(start=1000.0)
        self.store = store or InMemoryStore(self.clock)
        self.spec = spec
        self.coordinator = Coordinator(
            store=self.store, clock=self.clock, me=LeaderRecord(name, f"{name}:7420"), job_name=spec.name, job=spec,
            heartbeat_interval_s=1.0, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, leader_lease_s=3,
            session_grace_s=SESSION_GRACE_S, **coordinator_options)
        self.agents: dict[str, SimAgent] = {}
        self.peer_port = peer_port  # every agent's SnapshotPeer port (0: none serves)

    @property
    def job(self):
        return self.coordinator.job

    async def lead(self) -> None:
        leadership = await self.coordinator._election.campaign()
        await self.coordinator._take_office(leadership)

    async def connect(self, name: str, devices: int = 1, restarted: bool = True) -> SimAgent:
        """A new agent, or one that comes back after `disconnect` as a restarted agent (no generation), or
        (`restarted=False`) as the same agent, still running its generation."""
        agent = self.agents.setdefault(name, SimAgent(name))
        if restarted:
            agent.generation = 0
        hello = AgentHello(name, f"10.0.0.{len(self.agents)}", tuple(DeviceInfo(i, "", "cpu") for i in range(devices)),
                           "t", agent.token, self.peer_port)
        agent.session, welcome = await self.coordinator.open_session(hello, self._sender(agent))
        agent.token = welcome.resume_token
        return agent

    def _sender(self, agent: SimAgent):
        def send(command: object) -> None:
            agent.commands.append(command)
            if isinstance(command, LaunchCommand):
                agent.generation = max(agent.generation, command.generation)
        return send

    def disconnect(self, name: str) -> None:
        agent = self.agents[name]
        self.coordinator.close_session(agent.session)
        agent.session = None

    async def tick(self, seconds: float = 0.0) -> None:
        """Let time pass (with heartbeats from connected agents), then run one coordinator pass."""
        self.clock.advance(seconds)
        for agent in self.agents.values():
            if agent.session is not None and not agent.session.closed.is_set():
                self.coordinator.heartbeat(agent.session, HeartbeatReport(agent.generation, agent.memory, agent.held))
        await self.coordinator.tick()
        await asyncio.sleep(0)

    # ------------------------------------------------------------ what agents report

    def _ranks_of(self, name: str) -> list[int]:
        generation = self.job.inbox.generation
        return [slot.rank for slot in generation.placement.ranks if slot.node == name]

    def started(self) -> None:
        """Every node of the current generation reports its processes running."""
        generation = self.job.inbox.generation
        for name in generation.placement.nodes:
            agent = self.agents[name]
            if name == generation.placement.nodes[0]:
                self._report(agent, ProcessReport(name, ProcessRole.SCHEDULER, -1, 100, True))
            for rank in self._ranks_of(name):
                self._report(agent, ProcessReport(name, ProcessRole.WORKER, rank, 200 + rank, True))

    def step(self, step: int, samples_per_s: float = 120.0, *, epoch: int | None = None, from_output: bool = False,
             ranks: tuple[int, ...] | None = None, checkpoint_stall_s: float = 0.0, loss: float = 0.5,
             grad_norm: float = 1.0, evaluating: bool = False,
             startup: Mapping[int, StartupTimes] | None = None) -> None:
        """Every rank (or `ranks`) reports `step`: from the trainer runtime, or read from its output;
        `checkpoint_stall_s`: how long in all its step loop blocked on checkpoint saves; `evaluating`: it
        evaluates after `step`; `startup`: the start-up times the ranks named tell with it."""
        generation = self.job.inbox.generation
        for name in generation.placement.nodes:
            for rank in self._ranks_of(name):
                if ranks is None or rank in ranks:
                    self.coordinator.report(self.agents[name].session, RankProgressed(generation.number, ProgressReport(
                        rank, step, loss, grad_norm, samples_per_s, step * GLOBAL_BATCH, epoch, from_output,
                        checkpoint_stall_s, evaluating, startup=(startup or {}).get(rank))))

    def crash(self, name: str, rank: int, exit_code: int = 1, signal: int = 0, cause: RootCause | None = None) -> None:
        self._report(self.agents[name], ProcessReport(name, ProcessRole.WORKER, rank, 200 + rank, False,
                                                      exit_code, signal, log_tail="boom", cause=cause))

    def finish_all(self) -> None:
        generation = self.job.inbox.generation
        for name in generation.placement.nodes:
            for rank in self._ranks_of(name):
                self._report(self.agents[name], ProcessReport(name, ProcessRole.WORKER, rank, 200 + rank, False))

    def exit_on_stop(self, name: str) -> None:
        """The node's processes that still ran exit on the Stop (their reports come before its confirmation)."""
        for process in list(self.job.inbox.observation.processes.values()):
            if process.node == name and process.running:
                self._report(self.agents[name], replace(process, running=False, signal=15, expected=True))

    def confirm_stop(self, *names: str, memory: MemorySnapshot | None = None) -> None:
        """`memory`: the newest in-memory snapshot each confirmation names."""
        generation = self.job.inbox.generation
        for name in names or generation.placement.nodes:
            self.coordinator.report(self.agents[name].session, GenerationStopped(generation.number, memory))

    def checkpoint(self, step: int) -> None:
        """Rank 0's node commits `step`. No commit beyond the steps the job reported is believed, and an agent
        sends its ranks' progress before a commit: a step no rank reported yet is rank 0's first."""
        generation = self.job.inbox.generation
        first = self.agents[generation.placement.nodes[0]]
        if (self.job.inbox.observation.max_step() or 0) < step:
            self.step(step, ranks=(0,))
        self.coordinator.report(first.session, CheckpointCommitted(generation.number, step, step * GLOBAL_BATCH,
                                                                   f"/ckpt/step_{step:08d}"))

    def bad_batch(self, step: int, reason: str = "grad_norm_spike") -> None:
        """Rank 0's guard skipped `step` (its samples: the step's global batch)."""
        generation = self.job.inbox.generation
        first = self.agents[generation.placement.nodes[0]]
        self.coordinator.report(first.session, BatchSkipped(generation.number, 0, SkippedBatch(
            step, (step - 1) * GLOBAL_BATCH, step * GLOBAL_BATCH, reason, 2.0, 99.0)))

    def _report(self, agent: SimAgent, report: ProcessReport) -> None:
        self.coordinator.report(agent.session, ProcessChanged(self.job.inbox.generation.number, report))

    # ------------------------------------------------------------ what a test reads

    @property
    def state(self) -> JobState:
        return self.job.record.state

    def world(self) -> list[str]:
        return list(self.job.inbox.generation.placement.nodes)

    async def event_kinds(self) -> list[str]:
        return [e.kind for e in await self.coordinator.events(0)]


async def take_over(sim: SimCluster, spec: JobSettings | None = None, agents_restarted: bool = False,
                    returning: Collection[str] | None = None) -> SimCluster:
    """The leader dies; a standby on the same etcd (with `spec`, default the leader's) takes over and every
    agent (or those `returning`) reconnects to it: still running its generation, or (`agents_restarted`, as
    trainerd's local agents when trainerd restarts) running none."""
    standby = SimCluster(spec or sim.spec, store=sim.store, clock=sim.clock, name="c2", peer_port=sim.peer_port)
    if sim.coordinator.leadership is not None:  # it dies leading (one that stood down resigned its lease)
        sim.store.stop_keepalive(sim.coordinator.leadership.lease)
    sim.clock.advance(3.5)
    sim.store.expire_leases()
    await standby.lead()
    for name, agent in sim.agents.items():
        if returning is not None and name not in returning:
            continue
        standby.agents[name] = SimAgent(name, generation=agent.generation, memory=agent.memory, held=agent.held)
        await standby.connect(name, restarted=agents_restarted)
    return standby


async def launched_cluster(nodes=("a", "b", "c"), peer_port: int = 0, **overrides) -> SimCluster:
    """A job whose generation 1 was launched on `nodes` and whose processes started (PENDING)."""
    sim = SimCluster(job_settings(**overrides), peer_port=peer_port)
    await sim.lead()
    for name in nodes:
        await sim.connect(name)
    await sim.tick()
    assert sim.job.record.generation == 1 and sim.state is JobState.PENDING
    sim.started()
    return sim


async def running_cluster(nodes=("a", "b", "c"), peer_port: int = 0, **overrides) -> SimCluster:
    """A job RUNNING generation 1 on `nodes`, with a checkpoint committed at step 10."""
    sim = await launched_cluster(nodes, peer_port, **overrides)
    sim.step(1)
    await sim.tick()
    assert sim.state is JobState.RUNNING
    sim.step(10)
    sim.checkpoint(10)
    await sim.tick()
    return sim


async def crash_and_relaunch(sim: SimCluster) -> None:
    """Rank 1 crashes; every node confirms the stop; generation 2 is launched after the backoff."""
    sim.crash("b", 1)
    await sim.tick()
    sim.confirm_stop()
    await sim.tick(1.0)
    assert sim.job.record.generation == 2
