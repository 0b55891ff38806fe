"""On every new session the agent sends the current generation's newest checkpoint commit and each
rank's newest progress again: the coordinator that now leads may never have had them (they went to a
leader that lost office, or were in flight). Exactly the newest, one per rank and one commit, and
nothing of a generation it no longer runs.

First the supervisor with its fakes; then the agent with its real CoordinatorLink against a real
grpc.aio server that ends the first session, as a leader that loses office does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from agent.config import AgentConfig
from agent.main import Agent
from agent.session import CoordinatorLink, IdentityFile
from agent.supervisor import Supervisor
from agent.systemd import SystemdNotifier
from common.clock import FakeClock, SystemClock
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc
from proto.progress_datagram import CheckpointReport, StepReport
from tests.agent.supervisor_fakes import PYTHON, START, FakeLauncher, FakeStackDumper, Host, launch, run

WAIT_S = 5.0


def step(rank: int, number: int, generation: int = 1) -> StepReport:
    return StepReport("job", generation, rank, number, loss=0.5, grad_norm=1.0, samples_per_s=10.0,
                      consumed_samples=number * 8)


def commit(number: int, generation: int = 1) -> CheckpointReport:
    return CheckpointReport("job", generation, 0, number, number * 8, f"/ckpt/step_{number:08d}")


def summary(messages: list[pb.AgentMessage]) -> list[tuple]:
    """What each report says that a test compares: (kind, generation, rank, step, ...)."""
    out: list[tuple] = []
    for message in messages:
        kind = message.WhichOneof("body")
        if kind == "checkpoint_saved":
            saved = message.checkpoint_saved
            out.append((kind, saved.generation, saved.step, saved.consumed_samples, saved.path))
        elif kind == "progress":
            out.append((kind, message.progress.generation, message.progress.rank, message.progress.step))
    return out


def test_the_newest_commit_and_each_ranks_newest_progress_are_sent_again_and_nothing_older(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = Host(tmp_path)
        await host.supervisor.launch(launch(1, workers=2))
        host.progress(step(0, 1))  # sent at once
        host.progress(step(0, 2))  # held back by the throttle...
        host.progress(step(0, 3))  # ...and replaced
        host.progress(step(1, 1))
        host.progress(commit(2))
        host.progress(commit(4))
        # A commit sends the held-back step 3 first: the coordinator believes no commit beyond the steps reported.
        assert summary(host.reports) == [("progress", 1, 0, 1), ("progress", 1, 1, 1), ("progress", 1, 0, 3),
                                         ("checkpoint_saved", 1, 2, 16, "/ckpt/step_00000002"),
                                         ("checkpoint_saved", 1, 4, 32, "/ckpt/step_00000004")]
        newest = [("progress", 1, 0, 3), ("progress", 1, 1, 1), ("checkpoint_saved", 1, 4, 32, "/ckpt/step_00000004")]
        for _ in range(2):  # the newest of each, the steps before the commit
            host.reports.clear()
            host.supervisor.resend_reports()
            assert summary(host.reports) == newest

        await host.supervisor.launch(launch(2, workers=2))
        host.reports.clear()
        host.supervisor.resend_reports()
        assert host.reports == []  # generation 1's reports are refused by now: not kept

    run(scenario())


class SessionsServer(pb_grpc.CoordinatorServicer):
    """Welcomes every Hello and keeps what each session received; `end_session` ends the open one."""

    def __init__(self) -> None:
        self.sessions: list[list[pb.AgentMessage]] = []
        self._end = asyncio.Event()

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        received: list[pb.AgentMessage] = []
        self.sessions.append(received)
        await context.write(pb.CoordinatorMessage(welcome=pb.Welcome(
            node_name=first.hello.node_name, resume_token=f"token-{len(self.sessions)}",
            heartbeat_interval_s=0.05, coordinator_id=f"c{len(self.sessions)}")))

        async def read() -> None:
            while (message := await context.read()) is not grpc.aio.EOF:
                received.append(message)
        reader = asyncio.create_task(read())
        try:
            await self._end.wait()
            self._end.clear()
        finally:
            reader.cancel()

    def end_session(self) -> None:
        self._end.set()

    def reports(self, session: int) -> list[pb.AgentMessage]:
        return [m for m in self.sessions[session] if m.WhichOneof("body") != "heartbeat"]

    async def heartbeats(self, session: int, count: int) -> None:
        """Waits until session `session` received `count` heartbeats."""
        async with asyncio.timeout(WAIT_S):
            while len(self.sessions) <= session or sum(
                    m.WhichOneof("body") == "heartbeat" for m in self.sessions[session]) < count:
                await asyncio.sleep(0.01)


def test_a_reconnected_agent_sends_its_newest_reports_on_the_new_session(tmp_path: Path) -> None:
    async def scenario() -> None:
        server = SessionsServer()
        grpc_server = grpc.aio.server()
        pb_grpc.add_CoordinatorServicer_to_server(server, grpc_server)
        address = f"127.0.0.1:{grpc_server.add_insecure_port('127.0.0.1:0')}"
        await grpc_server.start()
        link = CoordinatorLink(addresses=[address], hello=pb.Hello(node_name="n1", host="10.0.0.1"),
                               identity=IdentityFile(tmp_path / "identity.json"), clock=SystemClock())
        clock = FakeClock(start=START)
        launcher = FakeLauncher(clock)
        supervisor = Supervisor(work_dir=tmp_path, progress_socket=tmp_path / "progress.sock", report=link.send,
                                launcher=launcher, stack_dumper=FakeStackDumper(clock, launcher), clock=clock,
                                allowed_entrypoints=[["{python}"]], python=PYTHON)
        agent = Agent(AgentConfig(coordinator=[address], work_dir=str(tmp_path)), link=link, supervisor=supervisor,
                      notifier=SystemdNotifier(), clock=clock, launcher=launcher)
        session = asyncio.create_task(link.run(agent))
        try:
            await asyncio.wait_for(link.connected.wait(), WAIT_S)
            await supervisor.launch(launch(1, workers=1))
            for message in (step(0, 5), commit(5), step(0, 6)):
                supervisor.on_progress(message, launcher.started["rank0"].pid)
            clock.advance(1.0)
            supervisor.on_progress(step(0, 7), launcher.started["rank0"].pid)
            await server.heartbeats(0, 2)
            assert summary(server.reports(0)) == [("progress", 1, 0, 5),
                                                  ("checkpoint_saved", 1, 5, 40, "/ckpt/step_00000005"),
                                                  ("progress", 1, 0, 7)]

            server.end_session()  # as a leader that lost office: the agent dials again
            await server.heartbeats(1, 3)
            assert summary(server.reports(1)) == [("progress", 1, 0, 7),
                                                  ("checkpoint_saved", 1, 5, 40, "/ckpt/step_00000005")]
            assert server.sessions[1][2].WhichOneof("body") == "heartbeat"  # they went first
        finally:
            session.cancel()
            await asyncio.gather(session, return_exceptions=True)
            await supervisor.shutdown(grace_s=1)
            await grpc_server.stop(None)

    asyncio.run(asyncio.wait_for(scenario(), 20))
