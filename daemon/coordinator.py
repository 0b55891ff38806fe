"""The coordinator: leadership, agent sessions, liveness and the cluster's state.

Servicers (daemon/grpc_services.py) translate protobuf to the plain values used here and call
these methods; nothing in this module knows about gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import secrets
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from common.clock import Clock
from daemon import metrics
from daemon.config import JobSettings
from daemon.errors import PermanentError, RetryableError
from daemon.events import EVENTS_PAGE, Event, EventKind, EventLog
from daemon.heartbeat_pace import HeartbeatPacer, Pace
from daemon.job.controller import ClusterFacts, CommandRefused, JobController
from daemon.job.placement import NodeOffer
from daemon.job.reports import AgentReport, HeartbeatReport
from daemon.job.skip_ledger import SkipEntry, checked
from daemon.job.state import KEPT_GENERATION_RECORDS, GenerationRecord
from daemon.job.view import JobView, forget_metrics
from daemon.leader import LeaderElection, LeaderRecord, Leadership
from daemon.liveness import LivenessTracker
from daemon.log_relay import LogChunk, LogRelay
from daemon.membership import DeviceInfo, Membership, NodeRecord
from daemon.node_authority import KnownCertificate
from daemon.node_checks import NodeChecks
from daemon.pass_guard import PassGuard
from daemon.read_lag import ReadLag
from daemon.store import codec, keys
from daemon.store.fenced_cache import WriteConflict
from daemon.store.interface import LeadershipLost, Store, StoreError
from proto.vocabulary import MAX_RETRY_AFTER_S, NODE_NAME_PATTERN, RETRY_AFTER_SPREAD, NodeState, ProcessRole

log = logging.getLogger(__name__)

MAX_DEVICES_PER_NODE = 64
STORE_RETRY_S = 1.0
# How long a coordinator that shuts down gives the job's last save of its goodput totals before it resigns.
STAND_DOWN_SAVE_S = 2.0
# A pass woken later than this is taken as the coordinator's own stall (scheduling jitter is milliseconds).
OWN_STALL_EXCUSED_FROM_S = 0.25
# The leader deletes old events this often (and at once when it takes office).
EVENT_COMPACTION_INTERVAL_S = 60.0
DEFAULT_FORGET_LOST_AFTER_S = 86400.0
DEFAULT_STOP_GRACE_S = 5.0  # what a self-fencing agent gives its processes when no job is configured
DEFAULT_EVENTS_KEEP = 10000
DEFAULT_EVENTS_MAX_AGE_S = 7 * 86400.0


class NotLeader(RetryableError):
    """This coordinator is a standby; `leader_address` is where the leader is, if known.

    The caller should send the request to `leader_address` (or, when it is unknown, retry later)."""

    def __init__(self, leader_address: str | None) -> None:
        super().__init__(f"not the leader; the leader is at {leader_address or 'an unknown address'}")
        self.leader_address = leader_address


class SessionRefused(PermanentError):
    """The Hello is invalid, or another live agent holds the node name: the agent must fix its Hello
    (name, host, devices) or stop the other agent before it tries again."""


@dataclass(frozen=True)
class AgentHello:
    node_name: str
    host: str
    devices: tuple[DeviceInfo, ...]
    agent_version: str
    resume_token: str
    peer_port: int = 0  # its SnapshotPeer service on `host` (0: none)
    # How long its next Hello would wait for a Welcome, should this one's not reach it (0: not said).
    next_welcome_wait_s: float = 0.0


@dataclass(frozen=True)
class Welcome:
    node_name: str
    resume_token: str
    heartbeat_interval_s: float
    coordinator_id: str
    # The agent fences itself (stops its processes within stop_grace_s) after timeout_s unheard.
    heartbeat_timeout_s: float = 0.0
    stop_grace_s: float = 0.0


class AgentSession:
    """One open Session stream; `send` queues a command for that agent."""

    def __init__(self, node: str, token: str, send: Callable[[object], None]) -> None:
        self.node = node
        self.token = token
        self.send = send
        self.closed = asyncio.Event()
        # True until its Welcome is ready: the time etcd takes to record the node is not its silence.
        self.opening = True
        self.clock_offset: float | None = None  # daemon/read_lag.py
        self.peer_port = 0  # its agent's SnapshotPeer port, from its Hello
        # Whether the agent sent anything after its Hello: until then it may never have had the Welcome.
        self.confirmed = False
        self.next_welcome_wait_s = 0.0  # from its Hello: see `Coordinator.close_session`
        # The client certificate it opened with (None without TLS): revoking it closes the session.
        self.certificate: KnownCertificate | None = None


@dataclass(frozen=True)
class NodeView:
    name: str
    host: str
    state: NodeState
    devices: tuple[DeviceInfo, ...]
    last_heartbeat_age_s: float | None
    drained: bool = False
    quarantined: bool = False
    crashes: int = 0  # the job's crashes counted against it (toward job.restart.quarantine_after)


@dataclass(frozen=True)
class CoordinatorView:
    id: str
    address: str
    is_leader: bool
    leader_id: str | None
    leader_address: str | None


@dataclass(frozen=True)
class ClusterView:
    coordinator: CoordinatorView
    nodes: tuple[NodeView, ...]
    job: JobView | None


def validate_hello(hello: AgentHello) -> None:
    if not re.fullmatch(NODE_NAME_PATTERN, hello.node_name):
        raise SessionRefused(f"invalid node name {hello.node_name!r}")
    if not hello.host or len(hello.host) > 255:
        raise SessionRefused(f"node {hello.node_name}: invalid host {hello.host!r}")
    if not 0 < len(hello.devices) <= MAX_DEVICES_PER_NODE:
        raise SessionRefused(f"node {hello.node_name}: needs 1-{MAX_DEVICES_PER_NODE} devices, "
                             f"got {len(hello.devices)}")
    ids = [d.device_id for d in hello.devices]
    if len(set(ids)) != len(ids) or min(ids) < 0:
        raise SessionRefused(f"node {hello.node_name}: device ids must be distinct and >= 0")


class Coordinator:
    def __init__(
        self,
        *,
        store: Store,
        clock: Clock,
        me: LeaderRecord,
        job_name: str,
        job: JobSettings | None,
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
        leader_lease_s: int,
        heartbeat_max_per_s: float = math.inf,
        session_grace_s: float | None = None,
        forget_lost_after_s: float = DEFAULT_FORGET_LOST_AFTER_S,
        events_keep: int = DEFAULT_EVENTS_KEEP,
        events_max_age_s: float = DEFAULT_EVENTS_MAX_AGE_S,
        on_leadership_change: Callable[[bool], None] = lambda is_leader: None,
        agents_at_the_door: Callable[[], int] = lambda: 0,
    ) -> None:
        """`agents_at_the_door`: agents told when to come back, whose turn is still to come
        (daemon/admission.py OpeningGate.agents_at_the_door); the pace counts them as held."""
        self._store = store
        self._agents_at_the_door = agents_at_the_door
        self._clock = clock
        self.me = me
        self._pacer = HeartbeatPacer(clock, heartbeat_interval_s, heartbeat_timeout_s, heartbeat_max_per_s)
        self._ready_nodes = 0  # READY in the records at the last pass: agents heartbeating, or about to
        self._election = LeaderElection(store, me, leader_lease_s)
        self._liveness = LivenessTracker(clock, heartbeat_timeout_s, session_grace_s)
        self._base_timeout_s, self._base_grace_s = heartbeat_timeout_s, self._liveness.grace_s
        self._read_lag = ReadLag()
        self._membership = Membership(store)
        self._events = EventLog(store, job_name, clock)
        self._sessions: dict[str, AgentSession] = {}
        self._logs = LogRelay(self._send_to_node)
        self._job_name = job_name
        self.job = None if job is None else JobController(
            store=store, spec=job, events=self._events, clock=clock, send=self._send_to_node)
        self._node_checks = NodeChecks(None if job is None else job.node_check,
                                       0.0 if job is None else job.node_check_timeout_s)
        self._forget_lost_after_s = forget_lost_after_s
        self._events_keep = events_keep
        self._events_max_age_s = events_max_age_s
        self._next_compaction_at: float | None = None
        self._reconcile_lock = asyncio.Lock()
        self._reconcile_guard = PassGuard(f"the reconcile pass of job {job_name}", clock)
        self._tick_guard = PassGuard("the periodic pass", clock)
        self._reconcile_requested = False
        self._background: set[asyncio.Task] = set()
        self.leadership: Leadership | None = None
        self._on_leadership_change = on_leadership_change

    # ------------------------------------------------------------ leadership

    async def run(self, tick_s: float) -> None:
        """Campaign, lead until the lease is lost, stand down, campaign again. Runs until cancelled.

        etcd being unreachable is temporary: the coordinator stands down (its lease will lapse, so a
        standby that can reach etcd takes over) and campaigns again after a pause. A fenced write
        refused because another coordinator leads ends the term the same way. Any other error of a
        pass is a bug, not a reason to stand down: it is logged and the pass tried again after a
        backoff (daemon/pass_guard.py).
        """
        while True:
            try:
                await self._lead_one_term(tick_s)
            except LeadershipLost as exc:
                log.warning("%s lost leadership (%s); standing down and campaigning again in %.0fs", self.me.id,
                            exc, STORE_RETRY_S)
                await asyncio.sleep(STORE_RETRY_S)
            except StoreError as exc:
                log.error("%s: etcd failed (%s); standing down and retrying in %.0fs", self.me.id, exc,
                          STORE_RETRY_S)
                await asyncio.sleep(STORE_RETRY_S)

    async def _lead_one_term(self, tick_s: float) -> None:
        leadership = await self._election.campaign()
        try:
            await self._take_office(leadership)
            loop = asyncio.get_running_loop()
            while leadership.lease.alive:
                waited_from = loop.time()
                try:
                    async with asyncio.timeout(tick_s):
                        await leadership.lease.wait_lost()
                except TimeoutError:
                    self._excuse_own_stall(loop.time() - waited_from - tick_s)
                    started = loop.time()
                    await self._tick_guard.run(self.tick)
                    metrics.PASS_DURATION.observe(loop.time() - started)
            log.warning("%s lost its leader lease; standing down", self.me.id)
        except (asyncio.CancelledError, StoreError, LeadershipLost) as exc:
            # Shutting down, etcd failed under us, or another coordinator leads: hand over now rather
            # than keep the lease alive (our own keepalive would otherwise hold the leader key while we
            # no longer lead).
            await asyncio.shield(self._hand_over(leadership, shutting_down=isinstance(exc, asyncio.CancelledError)))
            raise
        finally:
            self._leave_office()

    async def _hand_over(self, leadership: Leadership, shutting_down: bool) -> None:
        """Resign; first, when this coordinator is shutting down (its term still good), let the job save
        what the next leader carries on from."""
        try:
            if shutting_down and self.job is not None and self.leadership is leadership:
                # Best effort, and brief: with etcd out of reach, the resignation's own wait is enough.
                async with asyncio.timeout(STAND_DOWN_SAVE_S):
                    await self.job.goodput.stand_down(leadership.fence)
        except (StoreError, LeadershipLost, TimeoutError) as exc:
            log.warning("could not save the job's goodput totals before standing down: %s",
                        str(exc) or f"no answer within {STAND_DOWN_SAVE_S:g}s")
        try:
            await self._election.resign(leadership)
        except StoreError as exc:
            log.warning("could not resign leadership (%s); the lease will expire", exc)

    def _excuse_own_stall(self, late_s: float) -> None:
        """The pass woke `late_s` (real seconds) after it was due: the event loop was that far behind,
        so heartbeats waiting to be read were not the nodes' fault. Liveness deadlines move by it."""
        if late_s > OWN_STALL_EXCUSED_FROM_S:
            self._liveness.excuse(late_s)
            metrics.COORDINATOR_STALL.inc(late_s)
            log.warning("%s's event loop ran %.2fs late; liveness deadlines moved by as much", self.me.id,
                        late_s)

    async def _take_office(self, leadership: Leadership) -> None:
        await self._membership.load()
        known = [r.name for r in self._membership.all() if r.state is NodeState.READY]
        self._liveness.adopt(known)
        self._ready_nodes = len(known)
        self._pace()  # the pace they will all be back at, before the window they get to come back in
        # Why the events go on after a gap: a failover, or a restart of trainerd (which, with local agents,
        # stopped their processes too: the job's next pass ends that generation, PROCESSES_GONE). First,
        # before what the job's load finds (a changed cluster file).
        await self._events.append(EventKind.COORDINATOR_LEADS, f"coordinator {self.me.id} at {self.me.address} leads",
                                  leadership.fence, coordinator=self.me.id)
        if self.job is not None:
            await self.job.load(leadership.fence)
        self.leadership = leadership
        self._next_compaction_at = None  # at the first pass
        self._on_leadership_change(True)
        log.info("%s leads; %d known node(s) get %.1fs to reconnect", self.me.id, len(known),
                 self._liveness.timeout_s)

    def _leave_office(self) -> None:
        self.leadership = None
        if self.job is not None:
            forget_metrics(self.job.spec.name)
        for state in NodeState:
            metrics.NODES.remove(state.value)
        self._on_leadership_change(False)
        for session in list(self._sessions.values()):
            session.closed.set()
        self._sessions.clear()

    async def _require_leadership(self) -> Leadership:
        """The current term; NotLeader, naming the leader etcd knows, on a standby."""
        if self.leadership is None:
            raise NotLeader(await self._leader_address())
        return self.leadership

    async def _leader_address(self) -> str | None:
        current = await self._election.current()
        return None if current is None else current.address

    # ------------------------------------------------------------ sessions

    async def open_session(self, hello: AgentHello, send: Callable[[object], None]) -> tuple[AgentSession, Welcome]:
        validate_hello(hello)
        if self.leadership is None:
            raise NotLeader(await self._leader_address())
        leadership = self.leadership
        name = hello.node_name
        existing = self._sessions.get(name)
        if existing is not None and not existing.closed.is_set():
            if not hello.resume_token or not secrets.compare_digest(hello.resume_token, existing.token):
                raise SessionRefused(f"node name {name} is held by a live session")
            self._note_session_end(name)
            existing.closed.set()
        token = hello.resume_token or secrets.token_hex(16)
        session = AgentSession(name, token, send)
        session.peer_port = hello.peer_port
        session.next_welcome_wait_s = hello.next_welcome_wait_s
        self._sessions[name] = session
        self._liveness.connected(name)
        returned_from_lost = (record := self._membership.get(name)) is not None and record.state is NodeState.LOST
        try:
            if self.needs_recording(hello):  # a READY node reconnecting as it was writes nothing: no task
                await self._even_if_the_agent_leaves(self._record_ready(hello, leadership))
        except BaseException:
            self.close_session(session)
            raise
        session.opening = False
        self._liveness.welcomed(name, hello.next_welcome_wait_s)  # its heartbeats start with the Welcome
        if self.job is not None and self.job.inbox.session_opened(name):
            self.request_reconcile()  # its Launch goes out again, after the Welcome
        stop_grace_s = DEFAULT_STOP_GRACE_S if self.job is None else self.job.spec.stop_grace_s
        pace = self._pace()
        welcome = Welcome(name, token, pace.interval_s, self.me.id, pace.timeout_s, stop_grace_s)
        if returned_from_lost:
            await self._check_node(session, "it returned from LOST", leadership)
        return session, welcome

    async def _even_if_the_agent_leaves(self, recording: Coroutine[Any, Any, None]) -> None:
        """Await `recording` in a task that cancelling the caller does not stop. An agent that gives up its
        Hello (its Welcome timeout, in a burst) cancels the servicer's task, but an etcd write already sent
        lands anyway: finished, the write is heard by the copy of the records and its event is written.
        Cancelled with the Hello, it left the copy behind etcd (the next Hello met a conflict) and the node
        READY without its `node_joined` event."""
        task = asyncio.get_running_loop().create_task(recording)
        self._background.add(task)
        task.add_done_callback(self._recording_done)
        await asyncio.shield(task)

    def _recording_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("recording a node failed: %s", task.exception())  # raised to the Hello, if it still waits

    async def _record_ready(self, hello: AgentHello, leadership: Leadership) -> None:
        """Write the node READY with the Hello's host and devices, and its event (`needs_recording` said so)."""
        name = hello.node_name
        record = self._membership.get(name)
        wanted = NodeRecord(name, hello.host, hello.devices, NodeState.READY, self._clock.wall(),
                            drained=record is not None and record.drained)
        try:
            await self._membership.put(wanted, leadership.fence)
        except WriteConflict:
            # The copy was re-read. A write whose answer it never heard (etcd failed after the write
            # landed, or an earlier Hello's recording still under way) may already hold what this Hello
            # wants: then it is recorded.
            if self.needs_recording(hello):
                raise
        kind = EventKind.NODE_JOINED if record is None else EventKind.NODE_READY
        await self._events.append(kind, f"node {name} is READY with {len(hello.devices)} device(s) "
                                  f"at {hello.host}", leadership.fence, node=name)

    def needs_recording(self, hello: AgentHello) -> bool:
        """Whether opening this session writes to etcd: a new node, or one coming back from LOST or
        with other devices (a READY node reconnecting as it was costs nothing)."""
        record = self._membership.get(hello.node_name)
        return record is None or record.state is not NodeState.READY or (record.host, record.devices) != (
            hello.host, hello.devices)

    async def _check_node(self, session: AgentSession, why: str, leadership: Leadership) -> None:
        """Send the node job.node_check (when the job names one); it is offered no work until it passes."""
        command = self._node_checks.start(session.node)
        if command is None:
            return
        session.send(command)  # queued: it goes out after the Welcome
        await self._events.append(EventKind.NODE_CHECK_STARTED, f"node {session.node} runs the node check before it is "
                                  f"offered work: {why}", leadership.fence, node=session.node)

    def node_check_result(self, session: AgentSession, check_id: int, passed: bool, detail: str) -> None:
        """The agent's answer to a NodeCheck: a pass puts the node back in the offers, a failure keeps it
        out (until it returns again or is undrained), with the reason in the events."""
        if session.closed.is_set() or self.leadership is None:
            return
        outcome = self._node_checks.result(session.node, check_id, passed, detail)
        if outcome is None:
            return
        leadership, node = self.leadership, session.node
        if outcome:
            recorded = self._events.append(EventKind.NODE_CHECK_PASSED, f"node {node} passed the node check",
                                           leadership.fence, node=node)
        else:
            recorded = self._events.append(EventKind.NODE_CHECK_FAILED, f"node {node} failed the node check and is "
                                           f"offered no work until it returns or is undrained: {detail}",
                                           leadership.fence, node=node, reason=detail)
        task = asyncio.get_running_loop().create_task(recorded)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        self.request_reconcile()

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    @property
    def pace(self) -> Pace:
        """The heartbeat interval and timeout agents are told now (every ack names them)."""
        return self._pacer.pace

    def _pace(self) -> Pace:
        """Fit the pace to the agents held and those at the door (or known READY: after a failover they are
        on their way back), and the liveness timeout to the pace. Counting those at the door paces the
        first agents of a burst for the whole of it: welcomed at the 1 s pace of an empty cluster, they
        would heartbeat at it until their next ack, and take the loop from the Hellos still coming. While
        any are at the door a burst is on, and the pace holds a reserve (daemon/heartbeat_pace.py)."""
        at_the_door = self._agents_at_the_door()
        pace = self._pacer.update(max(len(self._sessions) + at_the_door, self._ready_nodes), burst=at_the_door > 0)
        timeout_s = self._pacer.liveness_timeout_s()
        self._liveness.timeout_s = timeout_s
        # The session grace stretches alike: an agent's reconnect backs off up to its interval, and a
        # paced agent's interval can pass the configured grace.
        self._liveness.grace_s = self._base_grace_s * timeout_s / self._base_timeout_s
        metrics.HEARTBEAT_INTERVAL.set(pace.interval_s)
        return pace

    def heartbeat(self, session: AgentSession, report: HeartbeatReport | None,
                  handled_minus_sent_s: float | None = None) -> None:
        """`report`: the generation the agent runs and the in-memory snapshots it holds (None: its heartbeat
        named no readable generation, and counts for liveness alone); `handled_minus_sent_s`: now by our wall
        clock minus the heartbeat's `sent_at` by the agent's."""
        if not session.closed.is_set():
            self._liveness.heard_from(session.node)
            if handled_minus_sent_s is not None:
                self._read_lag.observe(session, handled_minus_sent_s)
            if report is not None:
                self.report(session, report)

    def _peer_port(self, node: str) -> int:
        session = self._sessions.get(node)
        return 0 if session is None else session.peer_port

    def _send_to_node(self, node: str, command: object) -> bool:
        session = self._sessions.get(node)
        if session is None or session.closed.is_set():
            return False
        session.send(command)
        return True

    # ------------------------------------------------------------ job reports

    def report(self, session: AgentSession, report: AgentReport) -> None:
        """An agent's report about the job, for the job's inbox (daemon/job/inbox.py); the job's reconcile
        runs at once when the report calls for it (an exit is acted on now, not at the next pass)."""
        if self.job is not None and self.job.inbox.take(session.node, report):
            self.request_reconcile()

    def request_reconcile(self) -> None:
        if not self._reconcile_requested and self.leadership is not None:
            self._reconcile_requested = True
            task = asyncio.get_running_loop().create_task(self._reconcile_job())
            self._background.add(task)  # the loop keeps only a weak reference to tasks
            task.add_done_callback(self._reconcile_done)

    def _reconcile_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # A store error or lost leadership: the periodic pass runs the same reconcile again and
            # stands down when it must.
            log.warning("reconcile after a report failed: %s", task.exception())

    async def _reconcile_job(self) -> None:
        """The job's reconcile pass; a bug in it is logged and retried after a backoff."""
        await self._reconcile_guard.run(self._reconcile_job_once)

    async def _reconcile_job_once(self) -> None:
        async with self._reconcile_lock:
            self._reconcile_requested = False
            leadership = self.leadership
            if self.job is None or leadership is None:
                return
            await self.job.reconcile(leadership.fence, self._cluster_facts())

    def _cluster_facts(self) -> ClusterFacts:
        records = self._membership.all()
        checking = self._node_checks.excluded()
        ready = [r for r in records if r.state is NodeState.READY]
        return ClusterFacts(
            offers=[NodeOffer(r.name, r.host, r.devices, self._peer_port(r.name)) for r in ready
                    if self._liveness.is_connected(r.name) and not r.drained and r.name not in checking],
            disconnected={r.name for r in ready if not self._liveness.is_connected(r.name)},
            lost={r.name for r in records if r.state is NodeState.LOST},
            drained={r.name for r in records if r.drained},
        )

    def log_data(self, session: AgentSession, request_id: int, chunk: LogChunk) -> None:
        self._logs.answer(session.node, request_id, chunk)

    # ------------------------------------------------------------ operator commands

    async def read_log(self, rank: int, generation: int, offset: int, max_bytes: int) -> tuple[int, str, LogChunk]:
        """Part of the log of `rank` (-1: the scheduler) in `generation` (0: the current one), read by
        the agent of the node it ran on: (generation, node, chunk). Raises LogUnavailable or
        CommandRefused with one line."""
        await self._require_leadership()
        if self.job is None:
            raise CommandRefused("this cluster file defines no job")
        record = await self._generation_record(generation)
        slots = record.placement.ranks
        if rank == -1:
            node, role = slots[0].node, ProcessRole.SCHEDULER
        else:
            node = next((slot.node for slot in slots if slot.rank == rank), "")
            role = ProcessRole.WORKER
            if not node:
                raise CommandRefused(f"generation {record.number} has ranks 0-{len(slots) - 1}, not {rank}")
        chunk = await self._logs.read(node, record.number, role.value, rank, offset, max_bytes)
        return record.number, node, chunk

    async def _generation_record(self, number: int) -> GenerationRecord:
        assert self.job is not None
        current = self.job.inbox.generation
        if current is None:
            raise CommandRefused(f"job {self._job_name} has not launched a generation yet")
        if number in (0, current.number):
            return current
        if not 0 < number < current.number:
            raise CommandRefused(f"no generation {number}: the job is at generation {current.number}")
        key = keys.generation(self._job_name, number)
        value = await self._store.get(key)
        if value is None:
            raise CommandRefused(f"generation {number} is not in etcd any more (only the newest "
                                 f"{KEPT_GENERATION_RECORDS} generations are kept)")
        return GenerationRecord.from_json(codec.decode(value.value, key=key))


    async def skips(self) -> tuple[SkipEntry, ...]:
        await self._require_leadership()
        if self.job is None:
            raise CommandRefused("this cluster file defines no job")
        return self.job.ledger.entries()

    async def add_skip(self, start: int, end: int, reason: str) -> str:
        """An operator's ledger entry: the samples are left out from the next generation on.
        Raises BadRange for a malformed range."""
        entry = checked(start, end, f"operator: {reason}")
        added = await self._job_command(lambda job, fence: job.add_skip(entry, fence))
        return (f"samples {start}:{end} are skipped from the next generation on" if added
                else f"samples {start}:{end} were already in the ledger")

    async def pause(self, now: bool = False) -> str:
        return await self._job_command(lambda job, fence: job.pause(fence, now))

    async def resume(self, from_step: int | None) -> str:
        return await self._job_command(lambda job, fence: job.resume(fence, from_step))

    async def save_before_stopping(self, timeout_s: float) -> None:
        """trainerd stops and its local agents with it: the running generation saves a checkpoint, or leaves
        through the script's graceful exit, first (JobController.prepare_to_stop); wait for that, at most
        `timeout_s`. A standby, or a job with nothing running that could save, returns at once."""
        leadership = self.leadership
        if leadership is None or self.job is None:
            return
        job = self.job
        async with self._reconcile_lock:
            ready = job.prepare_to_stop()
            await job.reconcile(leadership.fence, self._cluster_facts())
        if not ready.done():
            log.info("job %s saves before trainerd stops (at most %.0fs; stop again to stop at once)",
                     job.spec.name, timeout_s)
        try:  # wall time, not the coordinator's clock: the bound is the operator's (and systemd's) patience
            async with asyncio.timeout(timeout_s):
                how = await ready
        except TimeoutError:
            log.warning("job %s saved nothing within %.0fs; stopping without it", job.spec.name, timeout_s)
        else:
            log.info("job %s: %s; stopping", job.spec.name, how)

    async def _job_command(self, command):
        leadership = await self._require_leadership()
        if self.job is None:
            raise CommandRefused("this cluster file defines no job")
        async with self._reconcile_lock:
            message = await command(self.job, leadership.fence)
            await self.job.reconcile(leadership.fence, self._cluster_facts())
        return message

    async def set_drain(self, node: str, drained: bool) -> str:
        """Drain: no later generation uses the node (a running one lets it go at a checkpoint).
        Undrain: it may be used again, and a quarantine is lifted."""
        leadership = await self._require_leadership()
        record = self._membership.get(node)
        if record is None:
            names = [r.name for r in self._membership.all()]
            known = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
            raise CommandRefused(f"no node named {node!r} (known: {known or 'none'})")
        async with self._reconcile_lock:
            if record.drained != drained:
                await self._membership.set_drained(node, drained, leadership.fence)
                await self._events.append(EventKind.NODE_DRAINED if drained else EventKind.NODE_UNDRAINED,
                                          f"node {node} is {'drained' if drained else 'back in service'}",
                                          leadership.fence, node=node)
            if not drained and self.job is not None:
                quarantined = node in self.job.record.quarantined(self.job.spec.restart.quarantine_after)
                await self.job.forget_node_failures(node, leadership.fence)
                session = self._sessions.get(node)
                failed_check = node in self._node_checks.failed
                if (quarantined or failed_check) and session is not None and not session.closed.is_set():
                    why = "its quarantine was lifted" if quarantined else "it was undrained after a failed check"
                    await self._check_node(session, why, leadership)
        self.request_reconcile()
        return f"node {node} is {'drained' if drained else 'in service'}"

    def confirm(self, session: AgentSession) -> None:
        """Its agent sent something after the Welcome, so it had it (daemon/liveness.py `welcomed`)."""
        session.confirmed = True
        if self._sessions.get(session.node) is session:
            self._liveness.confirmed(session.node)

    def at_the_door(self, hello: AgentHello, retry_after_s: float) -> None:
        """`hello` was turned away, its agent told to come back after `retry_after_s`. Its node is not
        silent meanwhile: the agent comes back within RETRY_AFTER_SPREAD times that, its next Hello may
        wait in our gRPC queue as long as its agent waits for a Welcome (at most the next wait the Hello
        named), and the grace of any ended session comes on top. Without this, in a connect burst an agent
        whose session broke and whose next Hello was given a turn further off than the grace could go LOST
        while it waited for the turn we gave it (bench/heartbeats.md). A host
        that dies right after its Hello was deferred is LOST that much later."""
        turn_s = min(retry_after_s, MAX_RETRY_AFTER_S)  # an agent honours no more (HelloAdmission names any)
        for_s = RETRY_AFTER_SPREAD * turn_s + hello.next_welcome_wait_s + self._liveness.grace_s
        self._liveness.at_the_door(hello.node_name, for_s)

    def open_sessions(self) -> list[AgentSession]:
        return list(self._sessions.values())

    def session_of(self, node: str) -> AgentSession | None:
        return self._sessions.get(node)

    def close_session(self, session: AgentSession) -> None:
        """The session's stream ended. A session whose agent sent nothing after its Hello gives the node
        two of the agent's next Welcome waits on top of the grace: in a connect burst an agent can give up
        its Hello just as the Welcome is written (the call waited that long in the gRPC queue). Its next
        Hello may first go to the other coordinator, as slow to answer in a burst, then waits in our queue.
        Without this, such nodes went LOST while their agents waited to be let back in
        (docs/operations/scaling.md). A host that truly dies between its Hello and its first heartbeat
        (milliseconds apart) is LOST that much later."""
        session.closed.set()
        if self._sessions.get(session.node) is session:
            del self._sessions[session.node]
            self._note_session_end(session.node)
            unconfirmed_s = 0.0 if session.confirmed else 2 * session.next_welcome_wait_s
            self._liveness.disconnected(session.node, unconfirmed_s)
            log.info("session of node %s closed%s; it has %.1fs to come back", session.node,
                     "" if session.confirmed else " before its agent confirmed the Welcome",
                     self._liveness.grace_s + unconfirmed_s)

    def _note_session_end(self, node: str) -> None:
        heard_s = self._liveness.age(node)
        if heard_s is not None:
            metrics.SESSION_END_HEARD.observe(heard_s)

    # ------------------------------------------------------------ periodic pass

    async def tick(self) -> None:
        leadership = await self._require_leadership()
        self._ready_nodes = sum(1 for r in self._membership.all() if r.state is NodeState.READY)
        self._pace()
        read_lag_s = self._read_lag.take()
        metrics.READ_LAG.set(read_lag_s)
        for name in self._liveness.overdue(read_lag_s):
            if not self._liveness.is_overdue(name, read_lag_s):
                continue  # back while the LOST before it were written (in a collapse, thousands of writes)
            record = self._membership.get(name)
            if record is None or record.state is not NodeState.READY:
                continue
            opening = self._sessions.get(name)
            if opening is not None and opening.opening and not opening.closed.is_set():
                continue  # waiting for etcd to record it, not silent
            age = self._liveness.age(name)
            await self._membership.set_state(name, NodeState.LOST, self._clock.wall(), leadership.fence)
            metrics.NODES_LOST.inc()
            session = self._sessions.pop(name, None)
            if session is not None:
                session.closed.set()
            await self._events.append(EventKind.NODE_LOST, f"node {name} is LOST: nothing heard for {age:.1f}s",
                                      leadership.fence, node=name)
        await self._forget_departed_nodes(leadership)
        self._export_nodes()
        await self._compact_events(leadership)
        await self._reconcile_job()

    def _export_nodes(self) -> None:
        records = self._membership.all()
        metrics.set_nodes({state.value: sum(1 for r in records if r.state is state) for state in NodeState})

    async def _forget_departed_nodes(self, leadership: Leadership) -> None:
        """A node LOST for longer than forget_lost_after_s leaves the records (its events stay)."""
        now = self._clock.wall()
        for record in self._membership.all():
            lost_for = now - record.changed_at
            if record.state is not NodeState.LOST or lost_for <= self._forget_lost_after_s:
                continue
            if await self._membership.forget(record.name, leadership.fence):
                self._liveness.forget(record.name)
                self._node_checks.forget(record.name)
                await self._events.append(
                    EventKind.NODE_FORGOTTEN, f"node {record.name} is forgotten: LOST for {lost_for / 3600:.1f}h "
                    f"(forget_lost_after_s {self._forget_lost_after_s:g})", leadership.fence, node=record.name)

    async def _compact_events(self, leadership: Leadership) -> None:
        """Every EVENT_COMPACTION_INTERVAL_S, the oldest events beyond the kept count or age go."""
        now = self._clock.now()
        if self._next_compaction_at is not None and now < self._next_compaction_at:
            return
        self._next_compaction_at = now + EVENT_COMPACTION_INTERVAL_S
        await self._events.compact(self._events_keep, self._events_max_age_s, leadership.fence)

    # ------------------------------------------------------------ status

    async def events(self, after_seq: int, limit: int = EVENTS_PAGE) -> list[Event]:
        """The oldest `limit` (at most EVENTS_PAGE) events after `after_seq`: a page."""
        return await self._events.read(after_seq, limit)

    async def view(self) -> ClusterView:
        leader = await self._election.current()
        coordinator = CoordinatorView(
            id=self.me.id,
            address=self.me.address,
            is_leader=self.leadership is not None,
            leader_id=None if leader is None else leader.id,
            leader_address=None if leader is None else leader.address,
        )
        if self.leadership is None:
            # A standby reads the nodes etcd has; only the leader knows heartbeat ages.
            standby_view = Membership(self._store)
            await standby_view.load()
            records, ages = standby_view.all(), {}
        else:
            records = self._membership.all()
            ages = {r.name: self._liveness.age(r.name) for r in records}
        job = None if self.job is None or self.leadership is None else self.job.view()
        quarantined = job.quarantined if job is not None else frozenset()
        crashes = job.node_crashes if job is not None else {}
        nodes = tuple(NodeView(r.name, r.host, r.state, r.devices, ages.get(r.name), r.drained,
                               r.name in quarantined, crashes.get(r.name, 0)) for r in records)
        return ClusterView(coordinator, nodes, job)
