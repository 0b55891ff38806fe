"""Thin gRPC servicers: translate trainerd.v1 messages and delegate to the Coordinator."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from daemon.coordinator import (
    AgentHello,
    AgentSession,
    ClusterView,
    Coordinator,
    NotLeader,
    SessionRefused,
)
from daemon import metrics
from daemon.membership import DeviceInfo
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc
from proto.vocabulary import LEADER_ADDRESS_METADATA

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0


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
                                devices=devices_to_proto(node.devices))
        if node.last_heartbeat_age_s is not None:
            entry.last_heartbeat_age_s = node.last_heartbeat_age_s
    return reply


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
        try:
            session, welcome = await self._coordinator.open_session(
                hello_from_proto(first.hello), outbox.put_nowait
            )
        except NotLeader as exc:
            context.set_trailing_metadata(((LEADER_ADDRESS_METADATA, exc.leader_address or ""),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except SessionRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        await context.write(pb.CoordinatorMessage(welcome=pb.Welcome(
            node_name=welcome.node_name, resume_token=welcome.resume_token,
            heartbeat_interval_s=welcome.heartbeat_interval_s, coordinator_id=welcome.coordinator_id,
        )))
        reader = asyncio.create_task(self._read(context, session))
        writer = asyncio.create_task(self._write(context, outbox))
        closed = asyncio.create_task(session.closed.wait())
        try:
            await asyncio.wait({reader, writer, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, writer, closed):
                task.cancel()
            self._coordinator.close_session(session)

    async def _read(self, context: grpc.aio.ServicerContext, session: AgentSession) -> None:
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                return
            kind = message.WhichOneof("body")
            if kind == "heartbeat":
                self._coordinator.heartbeat(session)
                metrics.HEARTBEATS.inc()
                if message.heartbeat.sent_at > 0:
                    metrics.HEARTBEAT_LAG.observe(max(0.0, time.time() - message.heartbeat.sent_at))
            elif kind == "hello":
                log.warning("node %s sent a second Hello; ignored", session.node)

    async def _write(self, context: grpc.aio.ServicerContext, outbox: asyncio.Queue) -> None:
        while True:
            await context.write(await outbox.get())


class ControlService(pb_grpc.ControlServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    async def GetStatus(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        return status_to_proto(await self._coordinator.view())
