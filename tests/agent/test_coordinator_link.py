"""The agent's CoordinatorLink against real grpc.aio servers on 127.0.0.1 that implement the
Coordinator service the way trainerd does: Welcome first, then commands; a standby refuses with
the leader's address in the trailing metadata."""

from __future__ import annotations

import asyncio
import math
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc

from agent.commands import Command, Stop
from agent.session import CoordinatorLink, IdentityFile, _write_first
from common.clock import SystemClock
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc
from proto.vocabulary import LEADER_ADDRESS_METADATA, MAX_WELCOME_WAIT_S, RETRY_AFTER_MS_METADATA

REPO = Path(__file__).resolve().parents[2]
HEARTBEAT_INTERVAL_S = 0.05
WAIT_S = 5.0


class LeaderCoordinator(pb_grpc.CoordinatorServicer):
    """Welcomes every Hello, records what the agent sends and sends the commands a test queues
    (None ends the session)."""

    def __init__(self, coordinator_id: str) -> None:
        self.coordinator_id = coordinator_id
        self.hellos: asyncio.Queue[pb.Hello] = asyncio.Queue()
        self.received: asyncio.Queue[pb.AgentMessage] = asyncio.Queue()
        self.commands: asyncio.Queue[pb.CoordinatorMessage | None] = asyncio.Queue()
        self._sessions = 0

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        await self.hellos.put(first.hello)
        self._sessions += 1
        await context.write(pb.CoordinatorMessage(welcome=pb.Welcome(
            node_name=first.hello.node_name, resume_token=f"token-{self._sessions}",
            heartbeat_interval_s=HEARTBEAT_INTERVAL_S, coordinator_id=self.coordinator_id)))
        reader = asyncio.create_task(self._read(context))
        try:
            while (command := await self.commands.get()) is not None:
                await context.write(command)
        finally:
            reader.cancel()

    async def _read(self, context: grpc.aio.ServicerContext) -> None:
        while (message := await context.read()) is not grpc.aio.EOF:
            await self.received.put(message)

    async def next_received(self, kind: str) -> pb.AgentMessage:
        """The next message of this kind the agent sent (heartbeats interleave with everything)."""
        while True:
            message = await asyncio.wait_for(self.received.get(), WAIT_S)
            if message.WhichOneof("body") == kind:
                return message


class StandbyCoordinator(pb_grpc.CoordinatorServicer):
    def __init__(self, leader_address: str) -> None:
        self.leader_address = leader_address
        self.refused = 0

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        await context.read()
        self.refused += 1
        context.set_trailing_metadata(((LEADER_ADDRESS_METADATA, self.leader_address),))
        await context.abort(grpc.StatusCode.UNAVAILABLE, "not the leader")


class DeferringCoordinator(LeaderCoordinator):
    """Turns the first `deferrals` Hellos away (RESOURCE_EXHAUSTED, come back in 10 ms), then welcomes; notes
    the connection (the client's address and port) each Hello came on."""

    def __init__(self, deferrals: int) -> None:
        super().__init__("deferring")
        self.deferrals = deferrals
        self.connections: list[str] = []

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        self.connections.append(context.peer())
        if self.deferrals:
            await context.read()
            self.deferrals -= 1
            context.set_trailing_metadata(((RETRY_AFTER_MS_METADATA, "10"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many sessions being opened")
        await super().Session(request_iterator, context)


class SlowToWelcomeCoordinator(LeaderCoordinator):
    """Leaves the first `unanswered` Hellos without a Welcome, as a coordinator behind a connect burst
    does, and notes how long each such call stayed open before the agent gave it up."""

    def __init__(self, unanswered: int) -> None:
        super().__init__("slow")
        self.unanswered = unanswered
        self.held_s: list[float] = []
        self.next_waits_named: list[float] = []  # by the unanswered Hellos

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        if self.unanswered:
            self.unanswered -= 1
            self.next_waits_named.append((await context.read()).hello.next_welcome_wait_s)
            started = time.monotonic()
            try:
                await asyncio.Event().wait()  # until the agent cancels the call
            finally:
                self.held_s.append(time.monotonic() - started)
        await super().Session(request_iterator, context)


class RecordingHandler:
    def __init__(self) -> None:
        self.commands: asyncio.Queue[Command] = asyncio.Queue()
        self.connected: list[bool] = []

    def on_command(self, command: Command) -> None:
        self.commands.put_nowait(command)

    def heartbeat_body(self) -> pb.Heartbeat:
        return pb.Heartbeat(generation=7)

    def on_connected(self, connected: bool) -> None:
        self.connected.append(connected)


@asynccontextmanager
async def serving(servicer: pb_grpc.CoordinatorServicer) -> AsyncIterator[str]:
    server = grpc.aio.server()
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def make_link(addresses: list[str], work_dir: Path, **options: float) -> CoordinatorLink:
    """A link with the agent's defaults but for `options` (the link's own keyword arguments)."""
    hello = pb.Hello(node_name="n1", host="10.0.0.1", agent_version="test",
                     devices=[pb.Device(device_id=0, kind="cpu")])
    return CoordinatorLink(addresses=addresses, hello=hello, identity=IdentityFile(work_dir / "identity.json"),
                           clock=SystemClock(), **options)


@asynccontextmanager
async def running(link: CoordinatorLink, handler: RecordingHandler) -> AsyncIterator[None]:
    task = asyncio.create_task(link.run(handler))
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_hello_welcome_heartbeats_reports_and_commands(tmp_path: Path) -> None:
    leader = LeaderCoordinator("c1")
    handler = RecordingHandler()

    async def scenario() -> None:
        async with serving(leader) as address:
            link = make_link([address], tmp_path)
            async with running(link, handler):
                hello = await asyncio.wait_for(leader.hellos.get(), WAIT_S)
                assert (hello.node_name, hello.host, hello.resume_token) == ("n1", "10.0.0.1", "")
                await asyncio.wait_for(link.connected.wait(), WAIT_S)
                assert link.welcome is not None and link.welcome.coordinator_id == "c1"
                assert handler.connected == [True]

                beats = [(await leader.next_received("heartbeat")).heartbeat for _ in range(3)]
                assert [(b.sequence, b.generation) for b in beats] == [(1, 7), (2, 7), (3, 7)]

                link.send(pb.AgentMessage(process_started=pb.ProcessStarted(generation=7, rank=0, pid=42)))
                report = await leader.next_received("process_started")
                assert report.process_started.pid == 42

                await leader.commands.put(pb.CoordinatorMessage(stop=pb.Stop(generation=7, grace_s=3.0)))
                command = await asyncio.wait_for(handler.commands.get(), WAIT_S)
                assert command == Stop(generation=7, grace_s=3.0)  # converted by the link (agent/commands.py)

                # The coordinator ends the session: the link comes back with the token it was given.
                await leader.commands.put(None)
                hello = await asyncio.wait_for(leader.hellos.get(), WAIT_S)
                assert hello.resume_token == "token-1"
                while (await leader.next_received("heartbeat")).heartbeat.sequence != 1:
                    pass  # heartbeats of the first session still in the queue
                assert handler.connected == [True, False, True]

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_a_standby_refusal_makes_the_link_dial_the_leader_it_names(tmp_path: Path) -> None:
    leader = LeaderCoordinator("leader")
    handler = RecordingHandler()

    async def scenario() -> None:
        async with serving(leader) as leader_address:
            standby = StandbyCoordinator(leader_address)
            async with serving(standby) as standby_address:
                # Only the standby is configured: reaching the leader proves the hint was followed.
                link = make_link([standby_address], tmp_path)
                async with running(link, handler):
                    hello = await asyncio.wait_for(leader.hellos.get(), WAIT_S)
                    assert hello.node_name == "n1"
                    await asyncio.wait_for(link.connected.wait(), WAIT_S)
                    assert link.welcome is not None and link.welcome.coordinator_id == "leader"
                    assert standby.refused == 1
                    await leader.next_received("heartbeat")

    asyncio.run(asyncio.wait_for(scenario(), 20))


class HostileWelcomes(LeaderCoordinator):
    """Answers the first Hellos with Welcomes whose terms cannot be kept, then welcomes as a leader."""

    BAD_TERMS = [{"heartbeat_interval_s": math.nan}, {"heartbeat_interval_s": -1.0},
                 {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": math.inf},
                 {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 1.5},
                 {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 5.0, "stop_grace_s": math.nan}]

    def __init__(self) -> None:
        super().__init__("hostile")
        self.bad = list(self.BAD_TERMS)

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        if self.bad:
            first = await context.read()
            await context.write(pb.CoordinatorMessage(welcome=pb.Welcome(
                node_name=first.hello.node_name, coordinator_id="hostile", **self.bad.pop(0))))
            await asyncio.Event().wait()  # held open: the agent must leave by itself
        await super().Session(request_iterator, context)


def test_a_welcome_whose_terms_cannot_be_kept_is_left_and_the_agent_tries_again(tmp_path: Path, caplog) -> None:
    coordinator = HostileWelcomes()
    handler = RecordingHandler()

    async def scenario() -> None:
        async with serving(coordinator) as address:
            link = make_link([address], tmp_path)
            async with running(link, handler):
                await asyncio.wait_for(link.connected.wait(), 20)  # after five backoffs
                assert link.interval_s == HEARTBEAT_INTERVAL_S
                await coordinator.next_received("heartbeat")

    asyncio.run(asyncio.wait_for(scenario(), 30))
    left = [r.getMessage() for r in caplog.records if "cannot keep to" in r.getMessage()]
    assert [message.split("Welcome whose ")[1].split(" the agent")[0] for message in left] == [
        "heartbeat interval nan and timeout 0.0", "heartbeat interval -1.0 and timeout 0.0",
        "heartbeat interval 1.0 and timeout inf", "heartbeat interval 1.0 and timeout 1.5", "stop grace nan"]
    assert handler.connected.count(True) == 1  # no bad Welcome was taken for a session


class HastyStandby(pb_grpc.CoordinatorServicer):
    """A standby that refuses a session without reading its Hello."""

    def __init__(self, leader_address: str) -> None:
        self.leader_address = leader_address

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        context.set_trailing_metadata(((LEADER_ADDRESS_METADATA, self.leader_address),))
        await context.abort(grpc.StatusCode.UNAVAILABLE, "not the leader")


def test_a_session_refused_before_its_hello_was_written_is_told_as_the_refusal() -> None:
    """grpc.aio answers a write on a call that already ended with InvalidStateError, which names neither the
    status nor the leader to dial; the link's first write raises the call's status instead."""
    async def scenario() -> grpc.aio.AioRpcError:
        async with serving(HastyStandby("10.0.0.9:7420")) as address, grpc.aio.insecure_channel(address) as ch:
            call = pb_grpc.CoordinatorStub(ch).Session()
            await call.code()  # the refusal has arrived: the Hello comes too late
            try:
                await _write_first(call, pb.AgentMessage(hello=pb.Hello(node_name="n1")))
            except grpc.aio.AioRpcError as exc:
                return exc
            raise AssertionError("the write of a finished call succeeded")

    refusal = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert (refusal.code(), refusal.details()) == (grpc.StatusCode.UNAVAILABLE, "not the leader")
    assert dict(refusal.trailing_metadata())[LEADER_ADDRESS_METADATA] == "10.0.0.9:7420"


def test_a_deferred_hello_comes_back_on_the_same_connection_and_any_other_failure_on_a_new_one(
        tmp_path: Path) -> None:
    """In a connect burst most Hellos are deferred: coming back costs the coordinator a stream, not a
    connection. A session that ends any other way is dialled again afresh (the connection may be dead)."""
    coordinator = DeferringCoordinator(deferrals=3)
    handler = RecordingHandler()

    async def scenario() -> None:
        async with serving(coordinator) as address:
            link = make_link([address], tmp_path)
            async with running(link, handler):
                await asyncio.wait_for(link.connected.wait(), WAIT_S)
                assert len(coordinator.connections) == 4 and len(set(coordinator.connections)) == 1
                await coordinator.commands.put(None)  # the coordinator ends the session
                await asyncio.wait_for(coordinator.hellos.get(), WAIT_S)
                await asyncio.wait_for(coordinator.hellos.get(), WAIT_S)
                assert len(coordinator.connections) == 5 and coordinator.connections[4] != coordinator.connections[0]

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_every_attempt_waits_the_whole_welcome_wait_and_names_it_in_its_hello(tmp_path: Path) -> None:
    """A Hello left unanswered most often waits in the coordinator's queue behind a burst: an agent that
    gives up early only goes to the back of it again. Each attempt waits the same, and its Hello names
    that wait: what the coordinator allows a node whose Welcome went unconfirmed."""
    coordinator = SlowToWelcomeCoordinator(unanswered=2)
    handler = RecordingHandler()
    wait_s = 0.4

    async def scenario() -> None:
        async with serving(coordinator) as address:
            link = make_link([address], tmp_path, welcome_timeout_s=wait_s)
            async with running(link, handler):
                await asyncio.wait_for(link.connected.wait(), 15)
                assert len(coordinator.held_s) == 2
                for held in coordinator.held_s:
                    assert wait_s - 0.05 <= held <= wait_s + 0.3, coordinator.held_s
                assert coordinator.next_waits_named == [wait_s, wait_s]

    asyncio.run(asyncio.wait_for(scenario(), 20))


class SlowWriteCall:
    """A session call whose writes of reports wait until `release` is set (a stream under back-pressure);
    notes every message written."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.written: list[pb.AgentMessage] = []

    async def write(self, message: pb.AgentMessage) -> None:
        if message.WhichOneof("body") != "heartbeat":
            await self.release.wait()
        self.written.append(message)


class SwitchingHandler(RecordingHandler):
    def __init__(self) -> None:
        super().__init__()
        self.generation = 7

    def heartbeat_body(self) -> pb.Heartbeat:
        return pb.Heartbeat(generation=self.generation)


def heartbeat_behind_a_report(tmp_path: Path, handler: RecordingHandler, first: pb.AgentMessage,
                              meanwhile) -> list[pb.AgentMessage]:
    """`first`'s write holds the turn and waits (a stream under back-pressure) while a heartbeat waits for its
    turn; then `meanwhile()` runs (what the agent does in that time) and the write goes through. Returns what
    was written, up to and with the first heartbeat."""
    call = SlowWriteCall()

    async def scenario() -> list[pb.AgentMessage]:
        link = make_link(["127.0.0.1:1"], tmp_path)
        link.interval_s = 0.01
        lock = asyncio.Lock()
        forwarder = asyncio.create_task(link._forward_outbox(call, lock))
        link.send(first)
        while not lock.locked():  # the report's write has the turn and waits
            await asyncio.sleep(0)
        beats = asyncio.create_task(link._heartbeats(call, lock, handler))
        await asyncio.sleep(0.05)  # the heartbeat waits for its turn
        meanwhile(link)
        call.release.set()
        while not any(m.WhichOneof("body") == "heartbeat" for m in call.written):
            await asyncio.sleep(0.01)
        forwarder.cancel()
        beats.cancel()
        await asyncio.gather(forwarder, beats, return_exceptions=True)
        return call.written[:[m.WhichOneof("body") for m in call.written].index("heartbeat") + 1]

    return asyncio.run(asyncio.wait_for(scenario(), 20))


def test_a_heartbeat_written_after_a_generations_reports_names_that_generation(tmp_path: Path) -> None:
    """A heartbeat waits its turn behind the reports queued before it. It must say what the agent runs
    when it is written: the coordinator ends a generation whose node names another one in its heartbeats
    after its processes reported (processes_gone), so one built before a launch and written after its
    reports would tell of a node that lost its processes."""
    handler = SwitchingHandler()

    def launch(link: CoordinatorLink) -> None:
        handler.generation = 8  # the launch of generation 8, whose report is being written

    written = heartbeat_behind_a_report(
        tmp_path, handler, pb.AgentMessage(process_started=pb.ProcessStarted(generation=8, rank=0, pid=42)), launch)
    assert [m.WhichOneof("body") for m in written] == ["process_started", "heartbeat"]
    assert written[1].heartbeat.generation == 8


class ExitingHandler(RecordingHandler):
    """Its heartbeats show rank 0 running until `exited`, then exited (the supervisor's process table)."""

    def __init__(self) -> None:
        super().__init__()
        self.exited = False

    def heartbeat_body(self) -> pb.Heartbeat:
        state = pb.PROCESS_EXITED if self.exited else pb.PROCESS_RUNNING
        return pb.Heartbeat(generation=7, processes=[pb.ProcessStatus(rank=0, pid=42, state=state, exit_code=1)])


def test_a_heartbeat_never_tells_an_exit_before_the_exit_report_queued_ahead_of_it(tmp_path: Path) -> None:
    """A worker reports its last step, then exits: the exit report (its log tail and root cause) is queued
    while the step's write holds the turn and a heartbeat waits for it. The coordinator judges a failure by
    the first report of it, so a heartbeat built after the exit must not be written before the exit report:
    the job then failed as "rank 0 exited with code 1", without why (seen in CI under load)."""
    handler = ExitingHandler()

    def exit_(link: CoordinatorLink) -> None:
        handler.exited = True
        link.send(pb.AgentMessage(process_exited=pb.ProcessExited(generation=7, rank=0, pid=42, exit_code=1,
                                                                  log_tail="crashing after step 2\n")))

    written = heartbeat_behind_a_report(
        tmp_path, handler, pb.AgentMessage(progress=pb.Progress(generation=7, rank=0, step=2)), exit_)
    assert [m.WhichOneof("body") for m in written] == ["progress", "process_exited", "heartbeat"]
    assert written[2].heartbeat.processes[0].state == pb.PROCESS_EXITED


class BreakingCall:
    """A session call whose first write fails, as a write into a session that has just ended does."""

    def __init__(self) -> None:
        self.written: list[pb.AgentMessage] = []

    async def write(self, message: pb.AgentMessage) -> None:
        if not self.written:
            self.written.append(pb.AgentMessage())  # the failed attempt
            raise asyncio.InvalidStateError("RPC already finished")
        self.written.append(message)


def test_a_report_whose_write_failed_goes_out_on_the_next_session(tmp_path: Path) -> None:
    async def scenario() -> None:
        link = make_link(["127.0.0.1:1"], tmp_path)
        lock = asyncio.Lock()
        exited = pb.AgentMessage(process_exited=pb.ProcessExited(generation=7, rank=0, pid=42, exit_code=1))
        link.send(exited)
        broken = BreakingCall()
        try:
            await link._forward_outbox(broken, lock)
        except asyncio.InvalidStateError:
            pass
        else:
            raise AssertionError("the broken write did not end the forwarder")
        again = SlowWriteCall()
        again.release.set()
        forwarder = asyncio.create_task(link._forward_outbox(again, lock))
        while not again.written:
            await asyncio.sleep(0.01)
        forwarder.cancel()
        await asyncio.gather(forwarder, return_exceptions=True)
        assert again.written == [exited]

    asyncio.run(asyncio.wait_for(scenario(), 20))


FROZEN_COORDINATOR = """
import asyncio
import grpc
from daemon.app import SERVER_OPTIONS
from proto import trainerd_pb2_grpc as pb_grpc

class HoldsHellos(pb_grpc.CoordinatorServicer):
    async def Session(self, request_iterator, context):
        first = await context.read()
        print(first.hello.next_welcome_wait_s, flush=True)
        await asyncio.Event().wait()

async def main():
    server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_CoordinatorServicer_to_server(HoldsHellos(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()

asyncio.run(main())
"""


def test_a_coordinator_frozen_with_the_hello_does_not_hold_the_agent_for_its_whole_welcome_wait(
        tmp_path: Path) -> None:
    """The agent is patient for its Welcome (60 s) because a live coordinator's queue can be that long,
    not a dead one's: a coordinator process frozen after it took the Hello stops answering gRPC's
    keepalive pings (10 s, then 20 s for the answer: CHANNEL_OPTIONS), the call ends, and the agent
    dials the other coordinator it knows well before its wait is over."""
    leader = LeaderCoordinator("live")
    handler = RecordingHandler()

    async def scenario(frozen: subprocess.Popen) -> None:
        assert frozen.stdout is not None
        port = int(await asyncio.to_thread(frozen.stdout.readline))
        async with serving(leader) as live_address:
            link = make_link([f"127.0.0.1:{port}", live_address], tmp_path)
            async with running(link, handler):
                # the Hello names the agent's whole patience, the default
                assert float(await asyncio.to_thread(frozen.stdout.readline)) == MAX_WELCOME_WAIT_S
                frozen.send_signal(signal.SIGSTOP)
                await asyncio.wait_for(link.connected.wait(), MAX_WELCOME_WAIT_S - 15)
                assert link.welcome is not None and link.welcome.coordinator_id == "live"

    frozen = subprocess.Popen([sys.executable, "-c", FROZEN_COORDINATOR], stdout=subprocess.PIPE, text=True,
                              cwd=REPO)
    try:
        asyncio.run(asyncio.wait_for(scenario(frozen), 60))
    finally:
        frozen.kill()
        frozen.wait()
