"""Fuzz the real servicers over real gRPC on 127.0.0.1: hypothesis-generated and byte-mutated
AgentMessages of every kind (extreme integers, NaN and infinite floats, huge strings and lists, wrong
generations and ranks) from a registered node that holds rank 0 of a running job, fuzzed Hellos on
fresh sessions, fuzzed Control requests, and fuzzed Health checks and watches. The Coordinator runs its real loop on the in-memory
store; after every case the session is still open, GetStatus answers, and no call failed INTERNAL.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.clock import SystemClock
from daemon.app import grpc_server
from daemon.coordinator import Coordinator
from daemon.grpc_services import ControlService, CoordinatorService
from daemon.leader import LeaderRecord
from daemon.store.memory import InMemoryStore
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc
from tests.daemon.job_sim import job_settings

CASES = 400
RPC_TIMEOUT_S = 15.0
SETTLE_TIMEOUT_S = 15.0
# gRPC refuses a message over 4 MiB before any servicer sees it (and ends that stream): not sent.
MAX_MESSAGE_BYTES = 3 << 20
FUZZ_NODE, PEER_NODE = "fuzz", "peer"  # the fuzzing node sorts first: it holds rank 0 and the scheduler

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
}
_EXTREME_INTS = [0, 1, 2, 3, -1, -2, 10, 12, 100, (1 << 20) - 1, 1 << 20, 10**15, 1 << 40, 1 << 62,
                 2**31 - 1, -(2**31), 2**32 - 1, 2**63 - 1, -(2**63), 2**64 - 1]
_EXTREME_FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, -1e308, 5e-324, 1.0, 1e12, 1e13]
_TELLING_STRINGS = ["worker", "scheduler", "", "daemon", FUZZ_NODE, PEER_NODE, "/ckpt/step_00000010",
                    "/ckpt/../etc/step_00000020", "/etc/passwd", "ckpt/rel", "nonfinite_loss", "npu", "cpu",
                    "line\nbreak\x00nul", "\u202e\u0301\U0001f600"]


def _ints(field: FieldDescriptor) -> st.SearchStrategy[int]:
    low, high = _INT_RANGES[field.type]
    return st.one_of(st.sampled_from([v for v in _EXTREME_INTS if low <= v <= high]), st.integers(low, high))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    if field.type in _INT_RANGES:
        return _ints(field)
    if field.type == FieldDescriptor.TYPE_DOUBLE:
        return st.one_of(st.sampled_from(_EXTREME_FLOATS), st.floats())
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-5, 50))
    if field.type == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(_TELLING_STRINGS), st.text(max_size=40),
                         st.sampled_from(["x" * 5000, "y" * 200_000]))
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.just(b"z" * ((1 << 20) + 1)))
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return messages(field.message_type)
    raise AssertionError(f"no strategy for {field.full_name}")


# Values an honest agent would send for fields of these names: two cases in three draw one of them,
# so that whole messages pass the checks often enough to reach the decisions behind them.
_PLAUSIBLE = {
    "rank": st.sampled_from([0, 1, -1]),
    "role": st.sampled_from(["worker", "scheduler"]),
    "step": st.integers(0, 60),
    "epoch": st.integers(0, 3),
    "pid": st.integers(1, 5000),
    "exit_code": st.sampled_from([0, 1, 2, 65, 126, 127, 137]),
    "signal": st.sampled_from([0, 6, 9, 15]),
    "samples_per_s": st.floats(0.0, 1e4),
    "consumed_samples": st.integers(0, 720),
    "sample_start": st.integers(0, 700),
    "sample_end": st.integers(1, 720),
    "reason": st.sampled_from(["nonfinite_loss", "grad_norm_spike"]),
    "path": st.integers(1, 60).map(lambda step: f"/ckpt/step_{step:08d}"),
    "state": st.sampled_from([pb.PROCESS_RUNNING, pb.PROCESS_EXITED]),
    "sent_at": st.just(0.0),
    "offset": st.integers(0, 100),
    "size": st.integers(0, 100),
}


def _field(field: FieldDescriptor) -> st.SearchStrategy:
    element = _scalar(field)
    plausible = _PLAUSIBLE.get(field.name)
    if plausible is not None:
        element = st.one_of(plausible, plausible, element)
    if not field.is_repeated:
        return element
    # Few elements, or one element repeated past every bound (300 processes, 300 devices).
    few = st.lists(element, max_size=3)
    return st.one_of(few, few, element.map(lambda value: [value] * 300))


def messages(descriptor: Descriptor) -> st.SearchStrategy[Message]:
    """Any message of `descriptor`'s type: every field set, or each set or left out."""
    kind = message_factory.GetMessageClass(descriptor)
    fields = {f.name: _field(f) for f in descriptor.fields}

    def build(values: dict) -> Message:
        message = kind()
        for name, value in values.items():
            target = getattr(message, name)
            if isinstance(value, list):
                target.extend(value)
            elif isinstance(value, Message):
                target.CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    return st.one_of(st.fixed_dictionaries(fields), st.fixed_dictionaries({}, optional=fields)).map(build)


def agent_messages(generation: int) -> st.SearchStrategy[pb.AgentMessage]:
    """One body of every kind; generations around the current one more often than not."""
    def with_body(pair: tuple[FieldDescriptor, Message, int | None]) -> pb.AgentMessage:
        field, body, wanted_generation = pair
        if wanted_generation is not None and "generation" in body.DESCRIPTOR.fields_by_name:
            body.generation = wanted_generation
        message = pb.AgentMessage()
        getattr(message, field.name).CopyFrom(body)
        return message

    bodies = st.sampled_from(list(pb.AgentMessage.DESCRIPTOR.oneofs_by_name["body"].fields)).flatmap(
        lambda field: st.tuples(st.just(field), messages(field.message_type),
                                st.one_of(st.just(generation), st.none(), st.sampled_from(
                                    [generation, generation - 1, generation + 1, 0, 1]))))
    return bodies.map(with_body)


@st.composite
def mutated_bytes(draw, original: st.SearchStrategy[bytes]) -> bytes:
    """`original`'s bytes flipped, cut or extended.

    The draws never depend on the message's length: it follows the coordinator's generation, which a
    fuzzed Pause and Resume move, and a draw that did would make hypothesis's replays inconsistent."""
    data = bytearray(draw(original))
    for _ in range(draw(st.integers(1, 4))):
        flip, where = draw(st.booleans()), draw(st.integers(0, 1 << 16))
        value, inserted = draw(st.integers(0, 255)), draw(st.binary(min_size=1, max_size=8))
        if data and flip:
            data[where % len(data)] = value
        else:
            data[where % (len(data) + 1):0] = inserted
    cut, where = draw(st.booleans()), draw(st.integers(0, 1 << 16))
    if data and cut:
        del data[where % len(data):]
    return bytes(data)


@st.composite
def mutated(draw, original: st.SearchStrategy[pb.AgentMessage]) -> pb.AgentMessage | None:
    """A message whose bytes were flipped, cut or extended; None when they no longer parse."""
    message = pb.AgentMessage()
    try:
        message.ParseFromString(draw(mutated_bytes(original.map(lambda m: m.SerializeToString()))))
    except DecodeError:
        return None
    return message


CONTROL_METHODS = [("GetStatus", pb.StatusRequest), ("ListEvents", pb.EventsRequest), ("Pause", pb.PauseRequest),
                   ("Resume", pb.ResumeRequest), ("SetDrain", pb.DrainRequest), ("ListSkips", pb.SkipsRequest),
                   ("AddSkip", pb.AddSkipRequest), ("ReadLog", pb.LogRequest)]


def control_calls() -> st.SearchStrategy[tuple[str, Message]]:
    return st.sampled_from(CONTROL_METHODS).flatmap(
        lambda method: st.tuples(st.just(method[0]), messages(method[1].DESCRIPTOR)))


# ---------------------------------------------------------------- the coordinator under test


class LiveCoordinator:
    """A Coordinator with a job, running its real loop and real gRPC servicers in a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="coordinator under fuzz", daemon=True)
        self.address = ""
        self.handled: dict[str, int] = {}  # messages each node's session handed to the servicer
        self.escaped: list[BaseException] = []

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> None:
        clock = SystemClock()
        self.coordinator = Coordinator(
            store=InMemoryStore(clock), clock=clock, me=LeaderRecord("fuzzed", "127.0.0.1:0"), job_name="job",
            # start_wait_s: the first generation waits for the peer too (it has rank 1), however late it says hello
            job=job_settings(min_nodes=1, max_nodes=2, start_wait_s=60.0, hang_timeout_s=3600.0),
            heartbeat_interval_s=1.0, heartbeat_timeout_s=3600.0, session_grace_s=3600.0, leader_lease_s=3)
        self.server = grpc_server()
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        service = CoordinatorService(self.coordinator)
        dispatch = service._dispatch

        def counted(session, message):
            try:
                return dispatch(session, message)
            except BaseException as exc:
                self.escaped.append(exc)  # must never happen: it would end the session
                raise
            finally:
                self.handled[session.node] = self.handled.get(session.node, 0) + 1

        service._dispatch = counted
        pb_grpc.add_CoordinatorServicer_to_server(service, self.server)
        pb_grpc.add_ControlServicer_to_server(ControlService(self.coordinator), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), self.server)
        await self.server.start()
        self.running = asyncio.create_task(self.coordinator.run(tick_s=0.05))
        while self.coordinator.leadership is None:
            await asyncio.sleep(0.01)

    def stop(self) -> None:
        async def stop() -> None:
            self.running.cancel()
            await asyncio.gather(self.running, return_exceptions=True)
            await self.server.stop(None)
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def alive(self) -> bool:
        return not self.running.done() and self.coordinator.leadership is not None

    @property
    def generation(self) -> int:
        return self.coordinator.job.record.generation


class AgentStream:
    """A Session stream from the test's side: messages go out through a queue, and what comes back is
    read on a thread, which answers ReadLog as an agent with no such log would. A `well_behaved` stream
    also answers as a healthy agent: its processes start and report a step after a Launch, and a Stop
    is confirmed."""

    def __init__(self, channel: grpc.Channel, hello: pb.Hello, well_behaved: bool = False) -> None:
        self.well_behaved = well_behaved
        self.outbox: queue.Queue = queue.Queue()
        self.outbox.put(pb.AgentMessage(hello=hello))
        self.kinds: list[str] = []
        self.ended: grpc.RpcError | str | None = None
        self._replies = pb_grpc.CoordinatorStub(channel).Session(iter(self.outbox.get, None))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for reply in self._replies:
                kind = reply.WhichOneof("body")
                self.kinds.append(kind)
                if kind == "read_log":
                    self.send(pb.AgentMessage(log_data=pb.LogData(request_id=reply.read_log.request_id,
                                                                  error="no such log here")))
                elif self.well_behaved and kind == "launch":
                    self._run(reply.launch)
                elif self.well_behaved and kind == "stop":
                    self.send(pb.AgentMessage(stopped=pb.Stopped(generation=reply.stop.generation)))
            self.ended = "the coordinator closed the stream"
        except grpc.RpcError as exc:
            self.ended = exc

    def send(self, message: pb.AgentMessage) -> None:
        self.outbox.put(message)

    def _run(self, launch: pb.Launch) -> None:
        for index, process in enumerate(launch.processes):
            self.send(pb.AgentMessage(process_started=pb.ProcessStarted(
                generation=launch.generation, role=process.role, rank=process.rank, pid=1000 + index)))
            if process.role == "worker":
                self.send(pb.AgentMessage(progress=pb.Progress(
                    generation=launch.generation, rank=process.rank, step=1, loss=0.5, grad_norm=1.0,
                    samples_per_s=100.0, consumed_samples=12)))

    def welcomed(self, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.kinds and self.ended is None:
            time.sleep(0.01)
        return self.kinds[:1] == ["welcome"]

    def close(self) -> None:
        self.outbox.put(None)
        self._replies.cancel()
        self._reader.join(10)


def hello(name: str) -> pb.Hello:
    return pb.Hello(node_name=name, host="127.0.0.1", devices=[pb.Device(device_id=0, kind="cpu")], agent_version="t")


@pytest.fixture(scope="module")
def live() -> tuple[LiveCoordinator, grpc.Channel, AgentStream, AgentStream]:
    coordinator = LiveCoordinator()
    coordinator.start()
    channel = grpc.insecure_channel(coordinator.address, options=[("grpc.max_send_message_length", 8 << 20)])
    fuzz, peer = AgentStream(channel, hello(FUZZ_NODE)), AgentStream(channel, hello(PEER_NODE), well_behaved=True)
    assert fuzz.welcomed() and peer.welcomed(), (fuzz.ended, peer.ended)
    deadline = time.monotonic() + 10
    while coordinator.generation < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert coordinator.generation == 1
    placement = coordinator.coordinator.job.inbox.generation.placement
    assert placement.node_of(0) == FUZZ_NODE and placement.node_of(1) == PEER_NODE
    yield coordinator, channel, fuzz, peer
    fuzz.close()
    peer.close()
    channel.close()
    coordinator.stop()


CASES_RUN = []


def status_answers(channel: grpc.Channel) -> pb.StatusReply:
    return pb_grpc.ControlStub(channel).GetStatus(pb.StatusRequest(), timeout=RPC_TIMEOUT_S)


@settings(max_examples=CASES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(data=st.data())
def test_fuzzed_agent_messages_and_control_requests_never_stop_the_coordinator(live, data) -> None:
    coordinator, channel, fuzz, _ = live
    generated = agent_messages(coordinator.generation)
    batch = data.draw(st.lists(st.one_of(generated, mutated(generated)), min_size=1, max_size=4), label="messages")
    sent = [message for message in batch if message is not None and message.ByteSize() <= MAX_MESSAGE_BYTES]
    before = coordinator.handled.get(FUZZ_NODE, 0)
    for message in sent:
        fuzz.send(message)

    if data.draw(st.integers(0, 9), label="fresh session") == 0:  # a stranger's Hello, one case in ten
        stranger = AgentStream(channel, data.draw(messages(pb.Hello.DESCRIPTOR), label="hello"))
        stranger.welcomed(timeout_s=5)
        stranger.close()

    method, request = data.draw(control_calls(), label="control")
    try:
        getattr(pb_grpc.ControlStub(channel), method)(request, timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as exc:
        assert exc.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (method, request, exc)

    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while coordinator.handled.get(FUZZ_NODE, 0) < before + len(sent):  # every message of the case was handled
        assert fuzz.ended is None, fuzz.ended
        assert time.monotonic() < deadline, f"{len(sent)} message(s) not handled within {SETTLE_TIMEOUT_S}s"
        time.sleep(0.005)
    assert fuzz.ended is None, fuzz.ended
    assert not coordinator.escaped, coordinator.escaped
    assert coordinator.alive
    assert status_answers(channel).coordinator.is_leader
    CASES_RUN.append(len(sent))


HEALTH_CASES = 100


@settings(max_examples=HEALTH_CASES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(request=messages(health_pb2.HealthCheckRequest.DESCRIPTOR), watch=st.booleans())
def test_fuzzed_health_checks_and_watches_are_answered(live, request, watch: bool) -> None:
    """A probe's Check, or the first answer of its Watch (a stream, ended by the probe)."""
    coordinator, channel, _, _ = live
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        if watch:
            stream = stub.Watch(request, timeout=RPC_TIMEOUT_S)
            next(stream)
            stream.cancel()
        else:
            stub.Check(request, timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as exc:
        assert exc.code() is grpc.StatusCode.NOT_FOUND, (request, exc)  # a service it does not know
    assert coordinator.alive and status_answers(channel).coordinator.is_leader


def test_after_the_fuzzing_the_coordinator_still_leads_and_answers(live) -> None:
    coordinator, channel, fuzz, peer = live
    assert len(CASES_RUN) == CASES, "run with the fuzz test before it"
    assert coordinator.alive and fuzz.ended is None and peer.ended is None
    reply = status_answers(channel)
    assert reply.coordinator.is_leader and {n.name for n in reply.nodes} >= {FUZZ_NODE, PEER_NODE}
    events = pb_grpc.ControlStub(channel).ListEvents(pb.EventsRequest(), timeout=RPC_TIMEOUT_S)
    assert events.events
    print(f"\nfuzz: {len(CASES_RUN)} cases, {sum(CASES_RUN)} agent messages; coordinator at generation "
          f"{coordinator.generation}, job {reply.job.state}")
