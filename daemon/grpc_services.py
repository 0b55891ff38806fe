"""Thin gRPC servicers: translate trainerd.v1 messages and delegate to the Coordinator.

The coordinator's errors propagate out of these methods; daemon/grpc_errors.py maps them to status
codes for every method at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc

from daemon.job.controller import JobView
from daemon.coordinator import AgentHello, AgentSession, ClusterView, Coordinator
from daemon import metrics
from daemon.job.commands import (
    CheckpointNowCommand,
    LaunchCommand,
    ReadLogCommand,
    RequestExitCommand,
    StopCommand,
)
from daemon.log_relay import MAX_LOG_READ_BYTES, LogChunk
from daemon.job.observation import SkippedBatch, ProcessReport, ProgressReport, RootCause
from daemon.membership import DeviceInfo
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc
from proto.vocabulary import ProcessRole

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
MAX_PATH_CHARS = 4096
MAX_RANK = 1 << 20
MAX_CAUSE_CHARS = 500


def hello_from_proto(message: pb.Hello) -> AgentHello:
    return AgentHello(
        node_name=message.node_name,
        host=message.host,
        devices=tuple(DeviceInfo(d.device_id, d.device_ip, d.kind) for d in message.devices),
        agent_version=message.agent_version,
        resume_token=message.resume_token,
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
                                quarantined=node.quarantined)
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
                                               from_output=r.from_output) for r in job.ranks],
                          hang_detection=job.hang_detection)
    status.skipped_batches = job.skipped_batches
    for field in ("step", "loss", "samples_per_s", "last_checkpoint_step", "epoch"):
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
        status.last_recovery.CopyFrom(phases)
    if job.last_failure is not None:
        f = job.last_failure
        status.last_failure.CopyFrom(pb.Failure(cause=f.cause.value, node=f.node, rank=f.rank, exit_code=f.exit_code,
                                                signal=f.signal, message=f.message, location=f.location))
    return status


def _role(text: str) -> ProcessRole | None:
    try:
        return ProcessRole(text)
    except ValueError:
        return None


def process_status_report(node: str, status: pb.ProcessStatus) -> ProcessReport | None:
    role = _role(status.role)
    if role is None:
        return None
    return ProcessReport(node, role, status.rank, status.pid, status.state != pb.PROCESS_EXITED,
                         status.exit_code, status.signal, status.expected, os_state=status.os_state[:2])


def process_exited_report(node: str, exited: pb.ProcessExited) -> ProcessReport | None:
    role = _role(exited.role)
    if role is None:
        return None
    cause = None
    if exited.cause.message:
        cause = RootCause(_one_line(exited.cause.message, MAX_CAUSE_CHARS), _one_line(exited.cause.location, 300),
                          _one_line(exited.cause.kind, 40))
    return ProcessReport(node, role, exited.rank, exited.pid, False, exited.exit_code, exited.signal,
                         exited.expected, exited.log_tail[-4000:], cause=cause)


def _one_line(text: str, limit: int) -> str:
    """A peer's text as one printable line: it goes into logs, events and status."""
    return "".join(c if c.isprintable() else " " for c in text[:limit]).strip()


def command_to_proto(command: object) -> pb.CoordinatorMessage:
    if isinstance(command, LaunchCommand):
        return pb.CoordinatorMessage(launch=pb.Launch(
            generation=command.generation, job_name=command.job_name, rank_table_json=command.rank_table_json,
            checkpoint_path=command.checkpoint_path, workdir=command.workdir,
            graceful_exit_file=command.graceful_exit_file, progress_pattern=command.progress_pattern,
            skips=[pb.SampleRange(start=start, end=end) for start, end in command.skips],
            processes=[pb.ProcessSpec(role=p.role.value, rank=p.rank, local_rank=p.local_rank,
                                      device_id=p.device_id, argv=list(p.argv), env=p.env)
                       for p in command.processes],
        ))
    if isinstance(command, StopCommand):
        return pb.CoordinatorMessage(stop=pb.Stop(generation=command.generation, grace_s=command.grace_s,
                                                  reason=command.reason, dump_stacks=command.dump_stacks))
    if isinstance(command, RequestExitCommand):
        return pb.CoordinatorMessage(request_exit=pb.RequestExit(generation=command.generation))
    if isinstance(command, ReadLogCommand):
        return pb.CoordinatorMessage(read_log=pb.ReadLog(
            request_id=command.request_id, generation=command.generation, role=command.role, rank=command.rank,
            offset=command.offset, max_bytes=command.max_bytes))
    if isinstance(command, CheckpointNowCommand):
        return pb.CoordinatorMessage(checkpoint_now=pb.CheckpointNow(generation=command.generation,
                                                                     step=command.step))
    raise TypeError(f"no wire form for {type(command).__name__}")


class CoordinatorService(pb_grpc.CoordinatorServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        try:
            first = await asyncio.wait_for(context.read(), HELLO_TIMEOUT_S)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no Hello within 10 s")
        if first is grpc.aio.EOF or first.WhichOneof("body") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a session must start with Hello")
        outbox: asyncio.Queue = asyncio.Queue()
        session, welcome = await self._coordinator.open_session(hello_from_proto(first.hello), outbox.put_nowait)
        await context.write(pb.CoordinatorMessage(welcome=pb.Welcome(
            node_name=welcome.node_name, resume_token=welcome.resume_token,
            heartbeat_interval_s=welcome.heartbeat_interval_s, coordinator_id=welcome.coordinator_id,
        )))
        reader = asyncio.create_task(self._read(context, session))
        writer = asyncio.create_task(self._write(context, outbox))
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

    async def _read(self, context: grpc.aio.ServicerContext, session: AgentSession) -> None:
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                return
            self._dispatch(session, message)

    def _dispatch(self, session: AgentSession, message: pb.AgentMessage) -> None:
        coordinator = self._coordinator
        kind = message.WhichOneof("body")
        if kind == "heartbeat":
            heartbeat = message.heartbeat
            coordinator.heartbeat(session, heartbeat.generation)
            metrics.HEARTBEATS.inc()
            if heartbeat.sent_at > 0:
                metrics.HEARTBEAT_LAG.observe(max(0.0, time.time() - heartbeat.sent_at))
            for status in heartbeat.processes:
                report = process_status_report(session.node, status)
                if report is not None:
                    coordinator.process_report(session, heartbeat.generation, report)
        elif kind == "process_exited":
            report = process_exited_report(session.node, message.process_exited)
            if report is not None:
                coordinator.process_report(session, message.process_exited.generation, report)
        elif kind == "process_started":
            started = message.process_started
            role = _role(started.role)
            if role is not None:
                coordinator.process_report(session, started.generation,
                                           ProcessReport(session.node, role, started.rank, started.pid, True))
        elif kind == "progress":
            p = message.progress
            coordinator.progress_report(session, p.generation, ProgressReport(
                p.rank, p.step, p.loss, p.grad_norm, p.samples_per_s, p.consumed_samples,
                epoch=p.epoch if p.HasField("epoch") else None, from_output=p.from_output))
        elif kind == "stopped":
            coordinator.stopped_report(session, message.stopped.generation)
        elif kind == "bad_batch":
            b = message.bad_batch
            if 0 <= b.sample_start < b.sample_end and b.step > 0 and 0 < len(b.reason) <= 100:
                coordinator.bad_batch(session, b.generation, SkippedBatch(
                    b.step, b.sample_start, b.sample_end, b.reason, b.loss, b.grad_norm))
            else:
                log.warning("node %s reported a malformed bad batch (step %d); ignored", session.node, b.step)
        elif kind == "checkpoint_saved":
            saved = message.checkpoint_saved
            if saved.step > 0 and saved.path and len(saved.path) <= MAX_PATH_CHARS and saved.consumed_samples >= 0:
                coordinator.checkpoint_saved(session, saved.generation, saved.step, saved.consumed_samples,
                                             saved.path)
            else:
                log.warning("node %s reported a malformed checkpoint (step %d); ignored", session.node, saved.step)
        elif kind == "log_data":
            data = message.log_data
            if len(data.data) <= MAX_LOG_READ_BYTES and data.offset >= 0 and data.size >= 0 and len(data.error) <= 1000:
                coordinator.log_data(session, data.request_id, LogChunk(bytes(data.data), data.offset, data.size,
                                                                        data.running, data.error))
            else:
                log.warning("node %s sent malformed log data; ignored", session.node)
        elif kind == "hello":
            log.warning("node %s sent a second Hello; ignored", session.node)

    async def _write(self, context: grpc.aio.ServicerContext, outbox: asyncio.Queue) -> None:
        while True:
            await context.write(command_to_proto(await outbox.get()))


class ControlService(pb_grpc.ControlServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    async def ListEvents(self, request: pb.EventsRequest, context: grpc.aio.ServicerContext) -> pb.EventsReply:
        events = await self._coordinator.events(request.after_seq)
        return pb.EventsReply(events=[
            pb.Event(seq=e.seq, at=e.at, kind=e.kind, message=e.message, fields_json=json.dumps(e.fields))
            for e in events])

    async def GetStatus(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        return status_to_proto(await self._coordinator.view())

    async def Pause(self, request: pb.PauseRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        return pb.CommandReply(message=await self._coordinator.pause())

    async def Resume(self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
        from_step = request.from_step if request.HasField("from_step") else None
        return pb.CommandReply(message=await self._coordinator.resume(from_step))

    async def SetDrain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.CommandReply:
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
