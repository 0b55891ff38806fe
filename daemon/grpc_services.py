"""Thin gRPC servicers: translate trainerd.v1 messages and delegate to the Coordinator.

The coordinator's errors propagate out of these methods; daemon/grpc_errors.py maps them to status
codes for every method at once. An agent's message is checked field by field first
(daemon/message_checks.py): a malformed one is dropped, counted and logged (at most once a minute
per node), and nothing an agent sends ends its session loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from common.clock import Clock, SystemClock
from common.peer_text import escaped
from daemon import message_checks as check
from daemon import metrics
from daemon.admission import HelloAdmission, HelloDeferred, OpeningGate
from daemon.coordinator import (
    MAX_DEVICES_PER_NODE,
    AgentHello,
    AgentSession,
    ClusterView,
    Coordinator,
    SessionRefused,
)
from daemon.events import EVENTS_PAGE
from daemon.job.commands import (
    CheckpointNowCommand,
    LaunchCommand,
    ReadLogCommand,
    RequestExitCommand,
    StandbyCommand,
    StopCommand,
)
from daemon.job.controller import CommandRefused
from daemon.job.goodput import Phase
from daemon.job.launch_plan import ProcessPlan
from daemon.job.observation import (
    GUARD_NOTICES,
    MemorySnapshot,
    ProcessReport,
    ProgressReport,
    RootCause,
    SkippedBatch,
    WorkerNotice,
)
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
from daemon.job.view import JobView
from daemon.join_services import NodeDesk
from daemon.log_relay import MAX_LOG_READ_BYTES, LogChunk
from daemon.membership import DeviceInfo
from daemon.message_checks import MAX_RANK, MalformedMessage
from daemon.node_checks import NodeCheckCommand
from daemon.peer_auth import require_node
from daemon.rate_limited_log import RateLimitedLog
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc
from proto.progress_datagram import MAX_STARTUP_PART_S, StartupTimes
from proto.vocabulary import MAX_WELCOME_WAIT_S, NODE_NAME_PATTERN

log = logging.getLogger(__name__)

T = TypeVar("T")

HELLO_TIMEOUT_S = 10.0
DEFAULT_MAX_SESSIONS = 20000
# An agent reports a few snapshot steps (its own newest two, two copies of its ring predecessor's).
MAX_HELD_SNAPSHOTS = 8


def hello_from_proto(message: pb.Hello) -> AgentHello:
    """The Hello as plain values; SessionRefused when a field is out of bounds (the coordinator then
    checks what the values mean: distinct devices, a free node name)."""
    try:
        if not re.fullmatch(NODE_NAME_PATTERN, message.node_name):
            raise MalformedMessage(f"invalid node name {message.node_name[:80]!r}")
        for what in ("host", "agent_version", "resume_token"):  # logged, stored, printed: no control character
            check.printable(getattr(message, what), check.MAX_HELLO_TEXT_CHARS, what)
        check.count(message.devices, MAX_DEVICES_PER_NODE, "devices")
        for device in message.devices:
            check.bounded_int(device.device_id, 0, check.MAX_DEVICE_ID, "device id")
            check.printable(device.device_ip, check.MAX_HELLO_TEXT_CHARS, "device ip")
            check.printable(device.kind, 16, "device kind")
        peer_port = check.bounded_int(message.peer_port, 0, 65535, "peer port")
        next_welcome_wait_s = check.finite(message.next_welcome_wait_s, "next welcome wait", 0.0,
                                           MAX_WELCOME_WAIT_S)
    except MalformedMessage as exc:
        raise SessionRefused(f"malformed Hello: {exc}") from None
    return AgentHello(
        node_name=message.node_name,
        host=message.host,
        devices=tuple(DeviceInfo(d.device_id, d.device_ip, d.kind) for d in message.devices),
        agent_version=message.agent_version,
        resume_token=message.resume_token,
        peer_port=peer_port,
        next_welcome_wait_s=next_welcome_wait_s,
    )


def devices_to_proto(devices) -> list[pb.Device]:
    return [pb.Device(device_id=d.device_id, device_ip=d.device_ip, kind=d.kind) for d in devices]


def status_to_proto(view: ClusterView) -> pb.StatusReply:
    c = view.coordinator
    reply = pb.StatusReply(
        coordinator=pb.CoordinatorInfo(
            id=c.id, address=c.address, is_leader=c.is_leader,
            leader_id=c.leader_id or "", leader_address=c.leader_address or "",
        )
    )
    for node in view.nodes:
        entry = reply.nodes.add(name=node.name, host=node.host, state=node.state.value,
                                devices=devices_to_proto(node.devices), drained=node.drained,
                                quarantined=node.quarantined, crashes=node.crashes)
        if node.last_heartbeat_age_s is not None:
            entry.last_heartbeat_age_s = node.last_heartbeat_age_s
    if view.job is not None:
        reply.job.CopyFrom(job_to_proto(view.job))
    return reply


def job_to_proto(job: JobView) -> pb.JobStatus:
    status = pb.JobStatus(name=job.name, state=job.state.value, generation=job.generation,
                          world_size=job.world_size, restarts=job.restarts, crash_restarts=job.crash_restarts,
                          restart_budget=job.restart_budget,
                          ranks=[pb.RankStatus(rank=r.rank, node=r.node, step=r.step, loss=r.loss,
                                               samples_per_s=r.samples_per_s, epoch=r.epoch,
                                               from_output=r.from_output, grad_norm=r.grad_norm)
                                  for r in job.ranks],
                          hang_detection=job.hang_detection, waiting_for=job.waiting_for,
                          pausing=job.pausing, warnings=job.warnings, spares=job.spares)
    status.skipped_batches = job.skipped_batches
    for field in ("step", "loss", "grad_norm", "samples_per_s", "last_checkpoint_step", "epoch"):
        value = getattr(job, field)
        if value is not None:
            setattr(status, field, value)
    if job.last_recovery is not None:
        recovery = job.last_recovery
        phases = pb.RecoveryPhases(cause=recovery.cause)
        for phase, seconds in recovery.phases().items():
            setattr(phases, f"{phase}_s", seconds)
        if recovery.resumed_from_step is not None:
            phases.resumed_from_step = recovery.resumed_from_step
        phases.resumed_from = recovery.resumed_from
        if recovery.lost_steps is not None:
            phases.lost_steps = recovery.lost_steps
        lost_work_s = 0.0 if job.goodput is None else job.goodput.seconds.get(Phase.LOST_WORK, 0.0)
        phases.cost.CopyFrom(pb.RecoveryCost(**recovery.cost(lost_work_s)))
        status.last_recovery.CopyFrom(phases)
    if job.goodput is not None:
        goodput = job.goodput
        status.goodput.CopyFrom(pb.Goodput(ratio=goodput.ratio, wall_s=goodput.wall_s, **{
            f"{phase.value}_s": goodput.seconds.get(phase, 0.0) for phase in Phase}))
    if job.last_failure is not None:
        f = job.last_failure
        status.last_failure.CopyFrom(pb.Failure(cause=f.cause.value, node=f.node, rank=f.rank, exit_code=f.exit_code,
                                                signal=f.signal, message=f.message, location=f.location))
    return status


def process_status_report(node: str, status: pb.ProcessStatus) -> ProcessReport:
    """Raises MalformedMessage."""
    role, rank = check.process_rank(status.role, status.rank)
    check.step(status.step)
    return ProcessReport(node, role, rank, check.bounded_int(status.pid, 0, 1 << 31, "pid"),
                         status.state != pb.PROCESS_EXITED, status.exit_code,
                         check.bounded_int(status.signal, 0, 255, "signal"), status.expected,
                         os_state=check.one_line(status.os_state, 2))


def process_exited_report(node: str, exited: pb.ProcessExited) -> ProcessReport:
    """Raises MalformedMessage."""
    role, rank = check.process_rank(exited.role, exited.rank)
    cause = None
    if exited.cause.message:
        cause = RootCause(check.one_line(exited.cause.message, check.MAX_CAUSE_CHARS),
                          check.one_line(exited.cause.location, check.MAX_LOCATION_CHARS),
                          check.one_line(exited.cause.kind, 40))
    return ProcessReport(node, role, rank, check.bounded_int(exited.pid, 0, 1 << 31, "pid"), False,
                         exited.exit_code, check.bounded_int(exited.signal, 0, 255, "signal"), exited.expected,
                         escaped(exited.log_tail[-check.MAX_LOG_TAIL_CHARS:], keep="\n"), cause=cause)


def process_started_report(node: str, started: pb.ProcessStarted) -> ProcessReport:
    """Raises MalformedMessage."""
    role, rank = check.process_rank(started.role, started.rank)
    return ProcessReport(node, role, rank, check.bounded_int(started.pid, 0, 1 << 31, "pid"), True)


def progress_report(p: pb.Progress) -> ProgressReport:
    """Loss and gradient norm may be NaN or infinite (that is what a bad batch shows); what the
    decisions compute with is finite. Raises MalformedMessage."""
    return ProgressReport(
        check.rank(p.rank), check.step(p.step), p.loss, p.grad_norm,
        check.finite(p.samples_per_s, "samples_per_s", 0.0, check.MAX_SAMPLES_PER_S),
        check.sample_position(p.consumed_samples, "consumed_samples"),
        epoch=check.step(p.epoch, "epoch") if p.HasField("epoch") else None, from_output=p.from_output,
        checkpoint_stall_s=check.finite(p.checkpoint_stall_s, "checkpoint_stall_s", 0.0, check.MAX_STALL_S),
        evaluating=p.evaluating, training_finished=p.training_finished,
        startup=rank_startup(p.startup) if p.HasField("startup") else None)


def rank_startup(startup: pb.RankStartup) -> StartupTimes:
    """Raises MalformedMessage."""
    return StartupTimes(*(check.finite(getattr(startup, part), f"startup {part}", 0.0, MAX_STARTUP_PART_S)
                          for part in ("comm_setup_s", "load_s", "first_step_s")))


def memory_snapshot(m: pb.MemorySnapshot) -> MemorySnapshot:
    """A snapshot held whole (`ranks` empty) or in part. Raises MalformedMessage."""
    world_size = check.bounded_int(m.world_size, 0, check.MAX_RANK, "snapshot world size")
    check.count(m.ranks, world_size, "snapshot ranks")
    ranks = frozenset(check.bounded_int(r, 0, world_size - 1, "snapshot rank") for r in m.ranks)
    return MemorySnapshot(check.step(m.step, "memory snapshot step"),
                          check.sample_position(m.consumed_samples, "consumed_samples"),
                          ranks, world_size, check.generation(m.generation))


def held_snapshots(held) -> tuple[MemorySnapshot, ...]:
    """A heartbeat's or Stopped's `held_snapshots`; each must name some ranks. Raises MalformedMessage."""
    check.count(held, MAX_HELD_SNAPSHOTS, "held snapshots")
    snapshots = tuple(memory_snapshot(m) for m in held)
    if any(not s.ranks for s in snapshots):
        raise MalformedMessage("a held snapshot names no ranks")
    return snapshots


def batch_skipped(b: pb.BadBatch) -> BatchSkipped:
    """The reporting rank and what it skipped. Raises MalformedMessage."""
    start = check.sample_position(b.sample_start, "sample_start")
    end = check.sample_position(b.sample_end, "sample_end")
    if start >= end or b.step < 1:
        raise MalformedMessage(f"bad batch at step {b.step} covers samples {start}:{end}")
    if not b.reason or len(b.reason) > check.MAX_REASON_CHARS:
        raise MalformedMessage(f"a bad batch needs a reason of 1 to {check.MAX_REASON_CHARS} characters")
    rank, batch = check.rank(b.rank), SkippedBatch(check.step(b.step), start, end, check.one_line(b.reason, 100),
                                                   b.loss, b.grad_norm)
    return BatchSkipped(check.generation(b.generation), rank, batch)


def guard_noticed(found: pb.GuardNotice) -> GuardNoticed:
    """Raises MalformedMessage."""
    if found.notice not in GUARD_NOTICES or found.step < 1 or not found.detail:
        raise MalformedMessage(f"a guard notice needs a known notice, a step from 1 and a detail, got "
                               f"{check.one_line(found.notice, 40)!r} at step {found.step}")
    return GuardNoticed(check.generation(found.generation), check.rank(found.rank),
                        WorkerNotice(check.step(found.step), found.notice,
                                     check.one_line(found.detail, check.MAX_FAILURE_REASON_CHARS)))


def checkpoint_committed(saved: pb.CheckpointSaved) -> CheckpointCommitted:
    """Raises MalformedMessage."""
    if saved.step < 1 or not saved.path:
        raise MalformedMessage(f"a checkpoint needs a step from 1 and a path, got step {saved.step}")
    return CheckpointCommitted(check.generation(saved.generation), check.step(saved.step),
                               check.sample_position(saved.consumed_samples, "consumed_samples"),
                               check.printable(saved.path, check.MAX_PATH_CHARS, "path"))


def checkpoint_failed(failed: pb.CheckpointFailed) -> CheckpointFailed:
    """Raises MalformedMessage."""
    if failed.step < 1 or not failed.reason:
        raise MalformedMessage(f"a failed checkpoint needs a step from 1 and a reason, got step {failed.step}")
    reason = check.one_line(failed.reason, check.MAX_FAILURE_REASON_CHARS)
    return CheckpointFailed(check.generation(failed.generation), check.rank(failed.rank), check.step(failed.step),
                            reason)


def worker_warned(warning: pb.WorkerWarning) -> WorkerWarned:
    """Raises MalformedMessage."""
    if not warning.text:
        raise MalformedMessage("a worker warning needs a text")
    return WorkerWarned(check.generation(warning.generation), check.rank(warning.rank),
                        check.one_line(warning.text, check.MAX_WARNING_CHARS))


def agent_report(node: str, kind: str, message: pb.AgentMessage) -> AgentReport | None:
    """The report about the job (daemon/job/reports.py) that `node`'s message of `kind` carries, checked; None
    for a message of another kind (a heartbeat, log data, a node check's result, ...). Raises MalformedMessage."""
    match kind:
        case "process_exited":
            exited = message.process_exited
            return ProcessChanged(check.generation(exited.generation), process_exited_report(node, exited))
        case "process_started":
            started = message.process_started
            return ProcessChanged(check.generation(started.generation), process_started_report(node, started))
        case "progress":
            return RankProgressed(check.generation(message.progress.generation), progress_report(message.progress))
        case "stopped":
            stopped = message.stopped
            return GenerationStopped(check.generation(stopped.generation),
                                     memory_snapshot(stopped.memory_snapshot)
                                     if stopped.HasField("memory_snapshot") else None,
                                     held_snapshots(stopped.held_snapshots))
        case "bad_batch":
            return batch_skipped(message.bad_batch)
        case "guard_notice":
            return guard_noticed(message.guard_notice)
        case "checkpoint_saved":
            return checkpoint_committed(message.checkpoint_saved)
        case "checkpoint_failed":
            return checkpoint_failed(message.checkpoint_failed)
        case "worker_warning":
            return worker_warned(message.worker_warning)
    return None


def process_spec(plan: ProcessPlan) -> pb.ProcessSpec:
    return pb.ProcessSpec(role=plan.role.value, rank=plan.rank, local_rank=plan.local_rank, device_id=plan.device_id,
                          argv=list(plan.argv), env=plan.env)


def command_to_proto(command: object) -> pb.CoordinatorMessage:
    if isinstance(command, LaunchCommand):
        return pb.CoordinatorMessage(launch=pb.Launch(
            generation=command.generation, job_name=command.job_name, rank_table_json=command.rank_table_json,
            checkpoint_path=command.checkpoint_path, workdir=command.workdir,
            graceful_exit_file=command.graceful_exit_file, progress_pattern=command.progress_pattern,
            skips=[pb.SampleRange(start=start, end=end) for start, end in command.skips],
            processes=[process_spec(p) for p in command.processes],
            snapshot_sources=[pb.SnapshotSource(rank=h.rank, holder=pb.PeerAgent(node=h.node, address=h.address))
                              for h in command.snapshot_sources],
            copy_from=None if command.copy_from is None else pb.PeerAgent(node=command.copy_from[0],
                                                                          address=command.copy_from[1]),
            peer_nodes=list(command.peer_nodes),
        ))
    if isinstance(command, StandbyCommand):
        return pb.CoordinatorMessage(standby=pb.Standby(
            generation=command.generation, job_name=command.job_name, workdir=command.workdir,
            processes=[process_spec(p) for p in command.processes]))
    if isinstance(command, StopCommand):
        return pb.CoordinatorMessage(stop=pb.Stop(generation=command.generation, grace_s=command.grace_s,
                                                  reason=command.reason, dump_stacks=command.dump_stacks,
                                                  job_completed=command.job_completed))
    if isinstance(command, RequestExitCommand):
        return pb.CoordinatorMessage(request_exit=pb.RequestExit(generation=command.generation))
    if isinstance(command, ReadLogCommand):
        return pb.CoordinatorMessage(read_log=pb.ReadLog(
            request_id=command.request_id, generation=command.generation, role=command.role, rank=command.rank,
            offset=command.offset, max_bytes=command.max_bytes))
    if isinstance(command, NodeCheckCommand):
        return pb.CoordinatorMessage(node_check=pb.NodeCheck(check_id=command.check_id, argv=list(command.argv),
                                                             timeout_s=command.timeout_s))
    if isinstance(command, CheckpointNowCommand):
        return pb.CoordinatorMessage(checkpoint_now=pb.CheckpointNow(generation=command.generation,
                                                                     step=command.step))
    raise TypeError(f"no wire form for {type(command).__name__}")


class CoordinatorService(pb_grpc.CoordinatorServicer):
    def __init__(self, coordinator: Coordinator, max_sessions: int = DEFAULT_MAX_SESSIONS,
                 admission: HelloAdmission | None = None, clock: Clock | None = None,
                 gate: OpeningGate | None = None, desk: NodeDesk | None = None) -> None:
        """`desk`: node certificates (revocations, renewals); None without TLS."""
        self._coordinator = coordinator
        self._desk = desk
        self._max_sessions = max_sessions
        self._admission = admission or HelloAdmission(clock or SystemClock())
        self._gate = gate or OpeningGate(clock or SystemClock())
        self._open_streams = 0
        self._warnings = RateLimitedLog(log)

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        """One agent's stream. At most `max_sessions` streams are open at once (counted from before
        their Hello, so idle connections cannot pile up either); more are refused RESOURCE_EXHAUSTED."""
        if self._open_streams >= self._max_sessions:
            metrics.SESSIONS_REFUSED.inc()
            self._warnings.warning("sessions", "a session was refused: %d are open, the most allowed "
                                   "(cluster.coordinator.max_sessions)", self._open_streams)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this coordinator holds {self._max_sessions} sessions, the most it allows; "
                                f"retry later")
        self._open_streams += 1
        try:
            try:
                opened = await self._open(context)
            except HelloDeferred:
                metrics.HELLOS_DEFERRED.inc()
                raise
            if opened is not None:
                await self._serve(context, *opened)
        finally:
            self._open_streams -= 1

    async def _open(self, context: grpc.aio.ServicerContext) -> tuple[AgentSession, asyncio.Queue] | None:
        """Read the Hello, open the session and write the Welcome (None: the agent left first).

        The Hello is read before anything is refused: an agent whose Hello write fails because the
        stream already ended sees INTERNAL, not our status and its retry-after hint (grpc/grpc#36066)."""
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                first = await context.read()
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no Hello within 10 s")
        if first is grpc.aio.EOF:
            # The agent gave up (or closed its side) before its Hello was read: nobody to answer. Its
            # cancellation may not show in `context.cancelled()` yet, and an abort would then fail.
            return None
        if first.WhichOneof("body") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a session must start with Hello")
        hello = hello_from_proto(first.hello)
        require_node(hello.node_name)
        certificate = None if self._desk is None else self._desk.admit(context, hello.node_name)
        try:
            async with self._gate.opening_session():
                session, outbox = await self._welcome(context, hello)
                if self._desk is not None:
                    self._desk.welcomed(session, certificate)
                return session, outbox
        except HelloDeferred as deferred:
            self._coordinator.at_the_door(hello, deferred.retry_after_s)
            raise

    async def _welcome(self, context: grpc.aio.ServicerContext,
                       hello: AgentHello) -> tuple[AgentSession, asyncio.Queue]:
        """Open the session (recording the node first when it is new or changed) and write the Welcome."""
        outbox: asyncio.Queue = asyncio.Queue()
        if self._coordinator.needs_recording(hello):  # etcd writes: one at a time of `concurrent`
            async with self._admission.admit():
                session, welcome = await self._coordinator.open_session(hello, outbox.put_nowait)
        else:
            session, welcome = await self._coordinator.open_session(hello, outbox.put_nowait)
        try:
            await context.write(pb.CoordinatorMessage(welcome=pb.Welcome(
                node_name=welcome.node_name, resume_token=welcome.resume_token,
                heartbeat_interval_s=welcome.heartbeat_interval_s, coordinator_id=welcome.coordinator_id,
                heartbeat_timeout_s=welcome.heartbeat_timeout_s, stop_grace_s=welcome.stop_grace_s,
            )))
        except BaseException:
            # The agent left as it was welcomed: it never got the resume token, so the session must
            # not stay open and hold its node name against the agent's next Hello.
            self._coordinator.close_session(session)
            raise
        return session, outbox

    async def _serve(self, context: grpc.aio.ServicerContext, session: AgentSession, outbox: asyncio.Queue) -> None:
        """Carry the open session until either side ends it."""
        write_lock = asyncio.Lock()  # grpc.aio allows one write in flight per stream
        reader = asyncio.create_task(self._read(context, session, write_lock))
        writer = asyncio.create_task(self._write(context, outbox, write_lock))
        closed = asyncio.create_task(session.closed.wait())
        try:
            done, _ = await asyncio.wait({reader, writer, closed}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.error("session of node %s failed: %r", session.node, task.exception(),
                              exc_info=task.exception())
        finally:
            for task in (reader, writer, closed):
                task.cancel()
            self._coordinator.close_session(session)

    async def _read(self, context: grpc.aio.ServicerContext, session: AgentSession, write_lock: asyncio.Lock) -> None:
        """Read and hand on the agent's messages; a heartbeat's ack is written here, at once, rather
        than queued for the writer (at 10,000 agents a queue hand-off per heartbeat is a cost that counts)."""
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                return
            ack = self._dispatch(session, message)
            if ack is not None and not session.closed.is_set():  # the agent's proof it still belongs
                with metrics.ACK_WRITE.time(), metrics.ACK_WRITES_WAITING.track_inprogress():
                    async with write_lock:
                        await context.write(ack)

    def _dispatch(self, session: AgentSession, message: pb.AgentMessage) -> pb.CoordinatorMessage | None:
        """Check and hand on one message; returns the HeartbeatAck to send for a heartbeat. Nothing it
        raises leaves: a malformed message is dropped and counted; a failure below is logged with its
        traceback, and the session goes on."""
        if not session.confirmed:  # whatever it sent, it had the Welcome
            self._coordinator.confirm(session)
        kind = message.WhichOneof("body") or "empty"
        metrics.agent_message(kind).inc()
        try:
            return self._handle(session, kind, message)
        except MalformedMessage as exc:
            metrics.AGENT_MESSAGES_DROPPED.labels("malformed").inc()
            self._warnings.warning(session.node, "node %s sent a malformed %s message; dropped: %s", session.node,
                                   kind, exc)
        except Exception as exc:  # noqa: BLE001 - one message must not end the session
            metrics.AGENT_MESSAGES_DROPPED.labels("failed").inc()
            self._warnings.error(session.node, "a %s message of node %s failed; dropped: %r", kind, session.node,
                                 exc, exc_info=exc)
        return None

    def _handle(self, session: AgentSession, kind: str, message: pb.AgentMessage) -> pb.CoordinatorMessage | None:
        coordinator, node = self._coordinator, session.node
        report = agent_report(node, kind, message)
        if report is not None:
            coordinator.report(session, report)
        elif kind == "heartbeat":
            return self._heartbeat(session, message.heartbeat)
        elif kind == "log_data":
            data = message.log_data
            check.count(data.data, MAX_LOG_READ_BYTES, "bytes of log data")
            check.text(data.error, 1000, "error")
            data.error = escaped(data.error)
            coordinator.log_data(session, data.request_id, LogChunk(
                bytes(data.data), check.bounded_int(data.offset, 0, check.MAX_FILE_OFFSET, "offset"),
                check.bounded_int(data.size, 0, check.MAX_FILE_OFFSET, "size"), data.running, data.error))
        elif kind == "node_check_result":
            result = message.node_check_result
            coordinator.node_check_result(session, result.check_id, result.passed,
                                          escaped(check.text(result.detail, 1000, "detail")))
        elif kind == "renew_certificate":
            if self._desk is None:
                raise MalformedMessage("a certificate renewal without TLS")
            self._desk.renew(session, message.renew_certificate.csr_pem)
        elif kind == "hello":
            raise MalformedMessage("a second Hello")
        else:
            raise MalformedMessage("no body")
        return None

    def _heartbeat(self, session: AgentSession, heartbeat: pb.Heartbeat) -> pb.CoordinatorMessage:
        """A heartbeat is always acknowledged: it proves the agent is alive and still belongs, whatever else
        it carries. A field out of bounds drops that field's report alone (a process's status, a snapshot
        claim, the send time), counted and logged as a malformed message would be: before, one bad status
        dropped the whole heartbeat, unacknowledged, and the agent redialled every few seconds for good."""
        node = session.node
        generation = self._field(session, "heartbeat", lambda: check.generation(heartbeat.generation))
        sent_at = self._field(session, "heartbeat", lambda: check.finite(heartbeat.sent_at, "sent_at"))
        statuses = self._field(session, "heartbeat", lambda: check.bounded_list(
            heartbeat.processes, check.MAX_PROCESSES_PER_HEARTBEAT, "processes in a heartbeat")) or ()
        reports = [self._field(session, "heartbeat", functools.partial(process_status_report, node, status))
                   for status in statuses]
        memory = (self._field(session, "heartbeat", lambda: memory_snapshot(heartbeat.memory_snapshot))
                  if heartbeat.HasField("memory_snapshot") else None)
        held = self._field(session, "heartbeat", lambda: held_snapshots(heartbeat.held_snapshots)) or ()
        lag = time.time() - sent_at if sent_at is not None and sent_at > 0 else None
        self._coordinator.heartbeat(session, None if generation is None else HeartbeatReport(generation, memory, held),
                                    lag)
        metrics.HEARTBEATS.inc()
        if lag is not None:
            metrics.HEARTBEAT_LAG.observe(max(0.0, lag))
        if generation is not None:
            for report in reports:
                if report is not None:
                    self._coordinator.report(session, ProcessChanged(generation, report))
        pace = self._coordinator.pace
        return pb.CoordinatorMessage(heartbeat_ack=pb.HeartbeatAck(
            sequence=heartbeat.sequence, interval_s=pace.interval_s, timeout_s=pace.timeout_s))

    def _field(self, session: AgentSession, kind: str, read: Callable[[], T]) -> T | None:
        """`read()`, or None when the field it reads is malformed: dropped, counted and logged."""
        try:
            return read()
        except MalformedMessage as exc:
            metrics.AGENT_MESSAGES_DROPPED.labels("malformed").inc()
            self._warnings.warning(session.node, "node %s sent a malformed field in a %s message; dropped: %s",
                                   session.node, kind, exc)
            return None

    async def _write(self, context: grpc.aio.ServicerContext, outbox: asyncio.Queue, write_lock: asyncio.Lock) -> None:
        while True:
            message = await outbox.get()  # a command of the job, or a ready wire message
            wire = message if isinstance(message, pb.CoordinatorMessage) else command_to_proto(message)
            async with write_lock:
                await context.write(wire)


class ControlService(pb_grpc.ControlServicer):
    def __init__(self, coordinator: Coordinator, desk: NodeDesk | None = None) -> None:
        """`desk`: join tokens and revocations; None without TLS."""
        self._coordinator = coordinator
        self._desk = desk

    async def ListEvents(self, request: pb.EventsRequest, context: grpc.aio.ServicerContext) -> pb.EventsReply:
        """A page: the oldest `limit` (0: EVENTS_PAGE) events after `after_seq`; ask again after the last."""
        if not 0 <= request.limit <= EVENTS_PAGE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"limit must be 0 (the default, {EVENTS_PAGE}) to {EVENTS_PAGE}")
        events = await self._coordinator.events(request.after_seq, request.limit or EVENTS_PAGE)
        return pb.EventsReply(events=[
            pb.Event(seq=e.seq, at=e.at, kind=e.kind, message=e.message, fields_json=json.dumps(e.fields))
            for e in events])

    async def GetStatus(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        return status_to_proto(await self._coordinator.view())

    async def Pause(self, request: pb.PauseRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        return pb.CommandReply(message=await self._coordinator.pause(request.now))

    async def Resume(self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        from_step = request.from_step if request.HasField("from_step") else None
        return pb.CommandReply(message=await self._coordinator.resume(from_step))

    async def SetDrain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        if not re.fullmatch(NODE_NAME_PATTERN, request.node):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{request.node[:80]!r} is not a node name")
        return pb.CommandReply(message=await self._coordinator.set_drain(request.node, request.drained))

    async def AddSkip(self, request: pb.AddSkipRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        message = await self._coordinator.add_skip(request.start, request.end, request.reason)
        return pb.CommandReply(message=message)

    async def ReadLog(self, request: pb.LogRequest, context: grpc.aio.ServicerContext) -> pb.LogReply:
        valid = -1 <= request.rank < MAX_RANK and request.generation >= 0
        if not (valid and 0 < request.max_bytes <= MAX_LOG_READ_BYTES):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"rank must be -1 (the scheduler) to {MAX_RANK - 1}, generation at least 0 and "
                                f"max_bytes 1 to {MAX_LOG_READ_BYTES}")
        generation, node, chunk = await self._coordinator.read_log(request.rank, request.generation, request.offset,
                                                                   request.max_bytes)
        return pb.LogReply(data=chunk.data, offset=chunk.offset, size=chunk.size, running=chunk.running,
                           generation=generation, node=node)

    async def ListSkips(self, request: pb.SkipsRequest, context: grpc.aio.ServicerContext) -> pb.SkipsReply:
        entries = await self._coordinator.skips()
        return pb.SkipsReply(skips=[pb.SkipEntry(start=e.start, end=e.end, reason=e.reason, step=e.step,
                                                 generation=e.generation, id=e.id) for e in entries])

    async def CreateToken(self, request: pb.CreateTokenRequest,
                          context: grpc.aio.ServicerContext) -> pb.CreateTokenReply:
        return await self._node_desk(context).create_token(request)

    async def ListTokens(self, request: pb.ListTokensRequest, context: grpc.aio.ServicerContext) -> pb.ListTokensReply:
        return await self._node_desk(context).list_tokens()

    async def DeleteToken(self, request: pb.DeleteTokenRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        return pb.CommandReply(message=await self._node_desk(context).delete_token(request.id))

    async def RevokeNode(self, request: pb.RevokeNodeRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        if not re.fullmatch(NODE_NAME_PATTERN, request.node):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{request.node[:80]!r} is not a node name")
        return pb.CommandReply(message=await self._node_desk(context).revoke(request.node))

    def _node_desk(self, context: grpc.aio.ServicerContext) -> NodeDesk:
        if self._desk is None:
            raise CommandRefused("this coordinator serves no TLS: node certificates, join tokens and revocations "
                                 "need cluster.tls")
        return self._desk
