"""Self-fencing: when the agent counts a coordinator as heard (ContactWatch with a FakeClock), how the
link keeps it (real grpc.aio servers: acks, a standby's refusals, a silent leader), and the
supervisor's fence (fake processes): SIGTERM, SIGKILL after the grace, exits reported unexpected."""

from __future__ import annotations

import asyncio
import math
import signal
from pathlib import Path

import grpc

from agent.fence import ContactWatch, FenceTerms
from common.clock import FakeClock
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc
from proto.vocabulary import LEADER_ADDRESS_METADATA
from tests.agent.supervisor_fakes import START, Host, launch, run
from tests.agent.test_coordinator_link import RecordingHandler, make_link, running, serving
from tests.ports import free_port

WAIT_S = 5.0


def test_no_fence_before_a_welcome_with_terms_and_once_per_loss_of_contact() -> None:
    clock = FakeClock()
    watch = ContactWatch(clock)
    clock.advance(100)
    assert not watch.overdue()  # never welcomed: nothing to fence by
    watch.welcomed(None)
    clock.advance(100)
    assert not watch.overdue()  # a coordinator that acknowledges nothing: no fencing

    watch.welcomed(FenceTerms(timeout_s=5.0, stop_grace_s=3.0))
    clock.advance(5.0)
    assert not watch.overdue() and not watch.silent_too_long()
    clock.advance(0.1)
    assert watch.silent_too_long() and watch.overdue()
    assert not watch.overdue()  # fenced once for this loss of contact
    watch.heard()
    clock.advance(4.0)
    assert not watch.overdue()
    clock.advance(1.5)
    assert watch.overdue()


class AckingLeader(pb_grpc.CoordinatorServicer):
    """Welcomes with fence terms and acknowledges heartbeats while `acking` is set."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.acking = True
        self.sessions = 0

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        self.sessions += 1
        await context.write(pb.CoordinatorMessage(welcome=pb.Welcome(
            node_name=first.hello.node_name, resume_token="t", heartbeat_interval_s=0.05, coordinator_id="c",
            heartbeat_timeout_s=self.timeout_s, stop_grace_s=1.0)))
        while (message := await context.read()) is not grpc.aio.EOF:
            if message.WhichOneof("body") == "heartbeat" and self.acking:
                await context.write(pb.CoordinatorMessage(
                    heartbeat_ack=pb.HeartbeatAck(sequence=message.heartbeat.sequence)))


def test_acks_keep_contact_and_a_silent_session_is_given_up(tmp_path: Path) -> None:
    leader = AckingLeader(timeout_s=0.5)
    handler = RecordingHandler()

    async def scenario() -> None:
        async with serving(leader) as address:
            link = make_link([address], tmp_path)
            async with running(link, handler):
                await asyncio.wait_for(link.connected.wait(), WAIT_S)
                assert link.contact.terms == FenceTerms(0.5, 1.0)
                await asyncio.sleep(1.0)  # twice the timeout, acknowledged all along
                assert link.contact.silent_for() < 0.5 and leader.sessions == 1
                assert handler.commands.empty()  # acks are the link's, not commands

                leader.acking = False  # the session stays open but nothing comes back, like a cut link
                await asyncio.sleep(1.0)
                assert leader.sessions >= 2  # given up after the timeout and dialled again

    asyncio.run(asyncio.wait_for(scenario(), 20))


class PacingLeader(pb_grpc.CoordinatorServicer):
    """Welcomes at a 0.05 s interval and a 0.5 s timeout, then names `pace` (interval, timeout) in its
    acks; records when each heartbeat arrived."""

    def __init__(self) -> None:
        self.pace = (0.05, 0.5)
        self.arrivals: list[float] = []

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        await context.write(pb.CoordinatorMessage(welcome=pb.Welcome(
            node_name=first.hello.node_name, resume_token="t", heartbeat_interval_s=0.05, coordinator_id="c",
            heartbeat_timeout_s=0.5, stop_grace_s=1.0)))
        while (message := await context.read()) is not grpc.aio.EOF:
            if message.WhichOneof("body") == "heartbeat":
                self.arrivals.append(asyncio.get_running_loop().time())
                interval_s, timeout_s = self.pace
                await context.write(pb.CoordinatorMessage(heartbeat_ack=pb.HeartbeatAck(
                    sequence=message.heartbeat.sequence, interval_s=interval_s, timeout_s=timeout_s)))


def test_the_agent_heartbeats_and_fences_at_the_pace_each_ack_names_and_ignores_an_insane_one(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        leader = PacingLeader()
        async with serving(leader) as address:
            link = make_link([address], tmp_path)
            async with running(link, RecordingHandler()):
                await asyncio.wait_for(link.connected.wait(), WAIT_S)
                await asyncio.sleep(0.5)
                assert len(leader.arrivals) >= 5  # at the Welcome's 0.05 s
                leader.pace = (0.4, 2.0)  # the leader holds more agents now
                await asyncio.sleep(0.3)
                assert link.interval_s == 0.4 and link.contact.terms == FenceTerms(2.0, 1.0)
                before = len(leader.arrivals)
                await asyncio.sleep(1.3)
                assert 2 <= len(leader.arrivals) - before <= 4  # about every 0.4 s
                assert not link.contact.overdue()
                for insane in ((0.0, 2.0), (math.nan, 2.0), (0.4, math.inf), (1.5, 2.0), (1e6, 3e6)):
                    leader.pace = insane
                    await asyncio.sleep(0.5)
                    assert link.interval_s == 0.4 and link.contact.terms == FenceTerms(2.0, 1.0), insane
                leader.pace = (0.0, 0.0)  # an older leader names no pace: the session keeps its own
                await asyncio.sleep(0.5)
                assert link.interval_s == 0.4

    asyncio.run(asyncio.wait_for(scenario(), 20))


class LeaderThenStandby(pb_grpc.CoordinatorServicer):
    """Welcomes the first session and aborts it (the leader stepped down); from then on it refuses like
    a standby waiting out the dead leader's lease: it names no leader yet. (The abort also makes the
    link's next write fail with "RPC already finished", which once ended the link for good.)"""

    def __init__(self) -> None:
        self.sessions = 0

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        self.sessions += 1
        if self.sessions == 1:
            await context.write(pb.CoordinatorMessage(welcome=pb.Welcome(
                node_name=first.hello.node_name, resume_token="t", heartbeat_interval_s=0.1, coordinator_id="c",
                heartbeat_timeout_s=0.5, stop_grace_s=1.0)))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this coordinator just lost leadership; retry")
        context.set_trailing_metadata(((LEADER_ADDRESS_METADATA, ""),))
        await context.abort(grpc.StatusCode.UNAVAILABLE, "not the leader")


def test_a_standby_answering_during_a_failover_counts_as_contact_and_a_dead_address_does_not(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        coordinator = LeaderThenStandby()
        async with serving(coordinator) as address:
            link = make_link([address], tmp_path)
            async with running(link, RecordingHandler()):
                await asyncio.wait_for(link.connected.wait(), WAIT_S)
                await asyncio.sleep(1.5)  # three timeouts of refusals: the link redials every interval
                assert coordinator.sessions > 3
                assert not link.contact.overdue()

        dead = make_link([f"127.0.0.1:{free_port()}"], tmp_path)
        dead.contact.welcomed(FenceTerms(timeout_s=0.5, stop_grace_s=1.0))
        async with running(dead, RecordingHandler()):
            await asyncio.sleep(1.0)
            assert dead.contact.overdue()

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_fence_terms_then_kills_after_the_grace_and_reports_the_exits_as_unexpected(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        assert not await host.supervisor.fence(2.0, "cut off")  # nothing running: nothing to do
        await host.supervisor.launch(launch(1))
        stubborn = host.launcher.started["rank1"]
        stubborn.obeys_sigterm = False
        assert await host.supervisor.fence(2.0, "cut off")
        assert stubborn.signums(while_running=True) == [signal.SIGTERM, signal.SIGKILL]
        assert stubborn.signals[1].at == START + 2.0
        assert all(not m.running for m in host.supervisor.processes.values())
        exits = {(e.role, e.rank): (e.signal, e.expected) for e in host.sent("process_exited")}
        assert exits == {("scheduler", -1): (signal.SIGTERM, False), ("worker", 0): (signal.SIGTERM, False),
                         ("worker", 1): (signal.SIGKILL, False)}
        # Each says why, so that the coordinator takes none of them for the process's own crash.
        assert {(e.cause.kind, e.cause.message) for e in host.sent("process_exited")} == {
            ("fenced", "stopped by its agent: cut off")}
        assert not host.sent("stopped")  # no coordinator asked for this stop
        assert not await host.supervisor.fence(2.0, "cut off")

    run(scenario())


def test_a_silent_session_is_redialled_well_before_the_agent_fences_or_the_leader_declares_it_lost() -> None:
    from agent.session import redial_after_s

    assert redial_after_s(1.0, 5.0) == 3.0   # the defaults: redial at 3 s, fence and LOST at 5 s
    assert redial_after_s(0.5, 2.0) == 1.5   # the tests' timing
    assert redial_after_s(1.0, 2.0) == 2.0   # never later than the timeout
